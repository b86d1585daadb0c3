"""In-place apply through the vLLM-layout reference runtime: bit-exact against dense.

Every rank of a simulated tensor-parallel group (TP 1, 2, 4; expert parallelism on and
off) holds its shard in vLLM's layout (fused qkv and gate_up, stacked experts, padded
vocabulary, tied embeddings, an FP8 module with a whole-tensor scale). A trainer's fp32
master weights take real AdamW steps; each BF16 export is diffed with the ranks' merged
profile and applied on every rank through ``VllmRuntime`` (the same adapter the vLLM
worker extension uses). After each step every parameter of every rank must equal, bit
for bit, the same rank loaded densely with the export.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dcr.apply.applier import Applier, DuplicatePayload
from dcr.apply.intercept import LoaderPathError
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.errors import TargetMismatch
from dcr.format.payload import Mode
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.loader import VllmRuntime
from dcr.runtimes.vllm_reference import (
    ReferenceConfig,
    ReferenceModel,
    dense_state,
    random_checkpoint,
)
from dcr.transport.store import MemoryStore

DENSE = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=True,
                        fp8_modules=("self_attn.o_proj",))
MOE = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, tie_word_embeddings=False, num_experts=4,
                      moe_intermediate_size=16)


class Trainer:
    """fp32 master weights, AdamW at an RL-like rate, BF16 exports."""

    def __init__(self, cfg: ReferenceConfig, seed: int) -> None:
        self.params = {n: torch.nn.Parameter(t.float()) for n, t in
                       random_checkpoint(cfg, seed).items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.gen)
        self.opt.step()

    def export(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in self.params.items()}


def source(sd: dict[str, torch.Tensor]) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                .view(np.uint16)) for n, t in sd.items()})


def canonical(sd: dict[str, torch.Tensor]) -> list[CanonicalTensor]:
    return [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape)) for n, t in sd.items()]


def mismatches(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sa, sb = dense_state(a), dense_state(b)
    return [n for n in sa if not torch.equal(sa[n].view(torch.uint8), sb[n].view(torch.uint8))]


def refit_matrix(cfg: ReferenceConfig, tp: int, ep: bool, mode: Mode, steps: int
                 ) -> ReceiverProfile:
    trainer = Trainer(cfg, seed=tp)
    old = trainer.export()
    ranks = [ReferenceModel(cfg, tp_size=tp, tp_rank=r, ep=ep) for r in range(tp)]
    engines = []
    for model in ranks:
        model.load_weights(old.items())
        engines.append(Applier(VllmRuntime(model), verify=True))
    profile = merge(e.prewarm(canonical(old)) for e in engines)
    store = MemoryStore()
    for version in range(1, steps + 1):
        trainer.step()
        new = trainer.export()
        m = diff_checkpoints(source(old), source(new), store, EncodeSettings(
            target_version=version, base_version=version - 1, mode=mode, profile=profile))
        payloads = [store.get(e.key) for e in m.payloads]
        for rank, (model, engine) in enumerate(zip(ranks, engines, strict=True)):
            engine.apply_payloads(payloads)
            dense = ReferenceModel(cfg, tp_size=tp, tp_rank=rank, ep=ep)
            dense.load_weights(new.items())
            assert mismatches(model, dense) == [], f"rank {rank} after version {version}"
        old = new
    return profile


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
def test_dense_model_with_fp8_and_tied_vocab_refits_bit_exactly(tp: int, mode: Mode) -> None:
    profile = refit_matrix(DENSE, tp, ep=False, mode=mode, steps=3)
    assert profile.tensors["model.layers.0.self_attn.o_proj.weight"] == "dense"
    assert profile.tensors["model.layers.0.self_attn.q_proj.weight"] == "xor"
    assert profile.tensors["model.embed_tokens.weight"] == "xor"


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
def test_moe_model_refits_bit_exactly(tp: int, ep: bool, mode: Mode) -> None:
    profile = refit_matrix(MOE, tp, ep=ep, mode=mode, steps=3)
    assert set(profile.tensors.values()) == {"xor"}


def test_expert_parallel_ranks_skip_experts_they_do_not_hold() -> None:
    ckpt = random_checkpoint(MOE, 0)
    model = ReferenceModel(MOE, tp_size=2, tp_rank=1, ep=True)
    profile = Applier(VllmRuntime(model)).prewarm(canonical(ckpt))
    assert profile.tensors["model.layers.0.mlp.experts.0.gate_proj.weight"] == "skip"
    assert profile.tensors["model.layers.0.mlp.experts.3.gate_proj.weight"] == "xor"


def test_fp8_tensor_sent_as_xor_is_refused_before_any_write() -> None:
    trainer = Trainer(DENSE, seed=5)
    old = trainer.export()
    model = ReferenceModel(DENSE)
    model.load_weights(old.items())
    engine = Applier(VllmRuntime(model))
    engine.prewarm(canonical(old))
    trainer.step()
    store = MemoryStore()
    m = diff_checkpoints(source(old), source(trainer.export()), store,
                         EncodeSettings(target_version=1, base_version=0))  # no profile: all XOR
    before = {n: t.clone() for n, t in dense_state(model).items()}
    with pytest.raises(TargetMismatch, match="through a dense path on this rank"):
        engine.apply_payloads([store.get(e.key) for e in m.payloads])
    assert all(torch.equal(before[n], t) for n, t in dense_state(model).items())


class Bypassing(ReferenceModel):
    """A loader that writes one tensor behind the hook's back (rebinding param.data)."""

    def load_weights(self, weights):  # type: ignore[no-untyped-def, override]
        out = set()
        for name, t in weights:
            if name == "model.norm.weight":
                self.model.norm.weight.data = t.clone()  # type: ignore[union-attr]
                out.add("model.norm.weight")
            else:
                out |= super().load_weights([(name, t)])
        return out


def test_a_loader_that_bypasses_interception_fails_loudly() -> None:
    cfg = replace(DENSE, fp8_modules=())
    ckpt = random_checkpoint(cfg, 0)
    model = Bypassing(cfg)
    with pytest.raises(LoaderPathError, match="bypasses the hook"):
        Applier(VllmRuntime(model)).prewarm(canonical(ckpt))


@pytest.mark.parametrize("crash_after", [1, 7, 20])
def test_crash_mid_apply_then_overwrite_retry_reaches_dense_bits(crash_after: int) -> None:
    """A receiver dies after some of its writes (inside a tensor, between tensors)."""
    tp = 2
    trainer = Trainer(MOE, seed=9)
    old = trainer.export()
    ranks = [ReferenceModel(MOE, tp_size=tp, tp_rank=r) for r in range(tp)]
    engines = []
    for model in ranks:
        model.load_weights(old.items())
        engines.append(Applier(VllmRuntime(model)))
    profile = merge(e.prewarm(canonical(old)) for e in engines)
    trainer.step()
    new = trainer.export()
    store = MemoryStore()
    first = diff_checkpoints(source(old), source(new), store, EncodeSettings(
        target_version=1, base_version=0, profile=profile, attempt="a-first"))
    victim = engines[1]
    real = victim._write_mapped
    calls = 0

    def dying(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        real(*args, **kwargs)
        calls += 1
        if calls == crash_after:
            raise RuntimeError("receiver killed")

    victim._write_mapped = dying  # type: ignore[method-assign]
    payloads = [store.get(e.key) for e in first.payloads]
    engines[0].apply_payloads(payloads)
    with pytest.raises(RuntimeError, match="killed"):
        victim.apply_payloads(payloads)
    victim._write_mapped = real  # type: ignore[method-assign]
    dense = ReferenceModel(MOE, tp_size=tp, tp_rank=1)
    dense.load_weights(new.items())
    assert mismatches(ranks[1], dense), "the crash should leave old and new bits mixed"
    with pytest.raises(DuplicatePayload, match="already applied"):
        victim.apply_payloads(payloads)  # the crashed attempt's payloads never apply twice
    retry = diff_checkpoints(source(old), source(new), store, EncodeSettings(
        target_version=1, base_version=0, profile=profile, mode="overwrite", attempt="a-retry"))
    for model, engine, rank in zip(ranks, engines, range(tp), strict=True):
        engine.apply_payloads([store.get(e.key) for e in retry.payloads])
        want = ReferenceModel(MOE, tp_size=tp, tp_rank=rank)
        want.load_weights(new.items())
        assert mismatches(model, want) == []
