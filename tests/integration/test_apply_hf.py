"""In-place apply through transformers models: bit-exact against a dense refit.

A fp32 master model is trained with AdamW; after every step its BF16 export is diffed
against the previous one (with the receiver's profile) and applied to a receiver model
through ``load_state_dict`` under interception. After each step every tensor of the
receiver's state dict must equal, bit for bit, a fresh model loaded densely with the
same export.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from dcr.apply.applier import Applier, DuplicatePayload
from dcr.apply.intercept import LoaderPathError
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.format.payload import Mode
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.hf import HFRuntime
from dcr.transport.store import MemoryStore

SMALL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def build(kind: str, tied: bool) -> torch.nn.Module:
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied))
    return MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4,
                                            num_experts_per_tok=2, tie_word_embeddings=tied))


def export(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    sd = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight")  # as save_pretrained writes tied checkpoints
    return sd


def as_source(sd: dict[str, torch.Tensor]) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                .view(np.uint16)) for n, t in sd.items()})


def bits_equal(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [n for n in sa if not torch.equal(sa[n].view(torch.uint8), sb[n].view(torch.uint8))]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
# (device, where records expand): the CPU's C path, the device path run on the CPU, and on
# a machine with CUDA both paths there (make gpu-check runs them too).
WHERE = [pytest.param("cpu", "host", id="cpu-host"), pytest.param("cpu", "device", id="cpu-device"),
         pytest.param("cuda", "host", id="cuda-host", marks=[pytest.mark.gpu, CUDA]),
         pytest.param("cuda", "device", id="cuda-device", marks=[pytest.mark.gpu, CUDA])]


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("llama", True), ("mixtral", False)])
@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
@pytest.mark.parametrize(("device", "where"), WHERE)
def test_refits_of_real_adamw_steps_equal_a_dense_load(kind: str, tied: bool, mode: Mode,
                                                       device: str, where: str) -> None:
    torch.manual_seed(0)
    master = build(kind, tied)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-4)
    receiver = build(kind, tied).to(torch.bfloat16).to(device)
    runtime = HFRuntime(receiver)
    old = export(master, tied)
    runtime.load_weights(old.items())
    engine = Applier(runtime, device=device, verify=True, expand=where)  # type: ignore[arg-type]
    profile = engine.prewarm(
        CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape)) for n, t in old.items()
    )
    assert set(profile.tensors.values()) == {"xor"}
    store = MemoryStore()
    for version in range(1, 4):
        tokens = torch.randint(0, 128, (2, 16))
        loss = master(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        new = export(master, tied)
        m = diff_checkpoints(as_source(old), as_source(new), store, EncodeSettings(
            target_version=version, base_version=version - 1, mode=mode, profile=profile))
        assert m.stats.changed_elements > 0
        report = engine.apply_payloads([store.get(e.key) for e in m.payloads])
        assert report.records == m.stats.changed_elements
        # load_state_dict takes the whole set in one call, its writes deferred
        assert (report.loads, report.deferred) == (1, report.tensors)
        dense = build(kind, tied).to(torch.bfloat16).to(device)
        HFRuntime(dense).load_weights(new.items())
        assert bits_equal(receiver, dense) == []
        assert engine.check_targets({t.name: t.target for t in m.tensors}) == {}
        old = new


def test_the_same_payload_applied_twice_is_refused() -> None:
    torch.manual_seed(1)
    model = build("llama", False)
    receiver = build("llama", False).to(torch.bfloat16)
    runtime = HFRuntime(receiver)
    old = export(model, False)
    runtime.load_weights(old.items())
    engine = Applier(runtime)
    engine.prewarm(CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                   for n, t in old.items())
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)
    new = export(model, False)
    store = MemoryStore()
    m = diff_checkpoints(as_source(old), as_source(new), store,
                         EncodeSettings(target_version=1, base_version=0))
    payloads = [store.get(e.key) for e in m.payloads]
    engine.apply_payloads(payloads)
    after = {n: t.clone() for n, t in receiver.state_dict().items()}
    with pytest.raises(DuplicatePayload, match="already applied"):
        engine.apply_payloads(payloads)
    assert all(torch.equal(after[n], t) for n, t in receiver.state_dict().items())


def test_a_receiver_that_casts_on_load_is_profiled_overwrite_and_refits_exactly() -> None:
    """An fp32 receiver of a BF16 checkpoint: every copy converts, XOR cannot apply."""
    torch.manual_seed(2)
    master = build("llama", False)
    receiver = build("llama", False)  # stays fp32: load_state_dict casts BF16 -> fp32
    runtime = HFRuntime(receiver)
    old = export(master, False)
    runtime.load_weights(old.items())
    engine = Applier(runtime, verify=True)
    profile = engine.prewarm(
        CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape)) for n, t in old.items()
    )
    assert set(profile.tensors.values()) == {"overwrite"}
    with torch.no_grad():
        for p in master.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    new = export(master, False)
    store = MemoryStore()
    m = diff_checkpoints(as_source(old), as_source(new), store,
                         EncodeSettings(target_version=1, base_version=0, profile=profile))
    engine.apply_payloads([store.get(e.key) for e in m.payloads])
    dense = build("llama", False)
    HFRuntime(dense).load_weights(new.items())
    assert bits_equal(receiver, dense) == []


class Rebinding(HFRuntime):
    """Behaves during prewarm; once armed, swaps the final norm's storage on any load."""

    armed = False

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        if self.armed:
            norm = self.model.model.norm.weight  # type: ignore[union-attr]
            norm.data = norm.data.clone()
        return super().load_weights(weights)


def test_a_loader_that_replaces_storage_during_apply_fails_loudly() -> None:
    torch.manual_seed(3)
    master = build("llama", False)
    receiver = build("llama", False).to(torch.bfloat16)
    runtime = Rebinding(receiver)
    old = export(master, False)
    runtime.load_weights(old.items())
    engine = Applier(runtime)
    engine.prewarm(CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                   for n, t in old.items())
    with torch.no_grad():
        master.model.embed_tokens.weight.add_(0.25)
    new = export(master, False)
    store = MemoryStore()
    m = diff_checkpoints(as_source(old), as_source(new), store,
                         EncodeSettings(target_version=1, base_version=0))
    runtime.armed = True
    with pytest.raises(LoaderPathError, match=r"replaced the storage of \['model.norm.weight'\]"):
        engine.apply_payloads([store.get(e.key) for e in m.payloads])
