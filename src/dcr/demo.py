"""``make demo``: a real refit on one machine with embedded defaults.

Trains a small Llama-architecture model (transformers, random init, byte-level tokens)
on real text (the Python standard library's own source) with AdamW in fp32 and exports
a BF16 Hugging Face checkpoint after every optimizer step, as a trainer does. Each step
is then refit twice:

* file-level: ``dcr diff`` writes the delta to a local file store and ``dcr patch``
  brings a rollout copy of the previous checkpoint to the new one;
* in place, as rollout replicas are refit: a transformers Llama receiver and two
  tensor-parallel ranks of the vLLM-layout reference runtime (fused qkv/gate_up, padded
  vocabulary, an FP8 ``o_proj`` with a whole-tensor scale) apply the delta through
  their own loaders, encoded with their merged receiver profile.

After each step every tensor of the rollout copy, and every parameter of every
receiver, is compared bit for bit with a dense load of the trainer's export.
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dcr.checkpoint import Checkpoint
from dcr.files.patch import patch_checkpoint
from dcr.format.profile import ReceiverProfile, coverage, merge
from dcr.owner.diff import DiffSettings, diff_checkpoints
from dcr.transport.store import FileStore, MemoryStore

LR = 1e-6  # RL fine-tuning learning rate: most BF16 elements round back to the same bits
SEQ = 128
BATCH = 8


def _corpus() -> bytes:
    import argparse
    import collections
    import json as json_mod

    return "".join(inspect.getsource(m) for m in (json_mod, argparse, collections)).encode()


def _export(model: object, path: Path) -> None:
    """Export BF16 weights the way a trainer hands them to rollout (sharded HF layout)."""
    import copy

    import torch

    shutil.rmtree(path, ignore_errors=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(  # type: ignore[attr-defined]
        path, max_shard_size="2MB", safe_serialization=True
    )


def bit_exact(a: Path, b: Path) -> bool:
    """Every tensor of ``a`` equals ``b`` as raw bits (and the tensor sets match)."""
    with Checkpoint(a) as x, Checkpoint(b) as y:
        if x.names() != y.names():
            return False
        return all(np.array_equal(x.bits(n), y.bits(n)) for n in x.names())


def run_demo(out: Path, *, steps: int = 3, seed: int = 0) -> list[dict[str, object]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = torch.tensor(list(_corpus()), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)

    def train_step() -> float:
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
        batch = torch.stack([data[s : s + SEQ] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())

    for _ in range(3):  # leave Adam's first, sign-like steps behind
        train_step()
    trainer, rollout, store = out / "trainer", out / "rollout", FileStore(out / "store")
    shutil.rmtree(store.root, ignore_errors=True)
    _export(model, trainer / "v0")
    shutil.rmtree(rollout, ignore_errors=True)
    shutil.copytree(trainer / "v0", rollout)
    n_params = sum(p.numel() for p in model.parameters())
    shards = len(list(rollout.glob("*.safetensors")))
    print(f"model: Llama, {n_params:,} parameters, BF16 export in {shards} shards; "
          f"AdamW lr={LR}; store {store.uri}")
    with Checkpoint(trainer / "v0") as v0:
        fleet = _Fleet(cfg, v0)
    print("receivers: " + ", ".join(r.label for r in fleet.receivers))
    print("coverage (share of weight bytes by path): " + ", ".join(
        f"{k} {100 * v:.1f}%" for k, v in fleet.coverage.items() if v))
    print(f"{'step':>4} {'loss':>7} {'changed':>9} {'payload B':>10} {'% dense':>8} "
          f"{'B/changed':>9} {'diff s':>7} {'patch s':>8} {'in-place B':>10} {'apply s':>8}"
          "  bit-exact")
    rows: list[dict[str, object]] = []
    for v in range(1, steps + 1):
        loss = train_step()
        _export(model, trainer / f"v{v}")
        with Checkpoint(trainer / f"v{v - 1}") as b, Checkpoint(trainer / f"v{v}") as t:
            t0 = time.perf_counter()
            m = diff_checkpoints(b, t, store, DiffSettings(version=v, base_version=v - 1))
            t_diff = time.perf_counter() - t0
            t0 = time.perf_counter()
            patch_checkpoint(rollout, store, v)
            t_patch = time.perf_counter() - t0
            in_place_bytes, t_apply, fleet_exact = fleet.refit(b, t, v)
        exact = bit_exact(rollout, trainer / f"v{v}") and fleet_exact
        st = m.stats
        row: dict[str, object] = {
            "step": v, "loss": loss, "changed_pct": 100 * st.changed_elements / st.total_elements,
            "payload_bytes": st.payload_bytes, "dense_pct": 100 * st.payload_bytes / st.dense_bytes,
            "bytes_per_changed": st.payload_bytes / max(1, st.changed_elements),
            "diff_s": t_diff, "patch_s": t_patch, "in_place_payload_bytes": in_place_bytes,
            "apply_s": t_apply, "bit_exact": exact,
        }
        rows.append(row)
        print(f"{v:>4} {loss:>7.4f} {row['changed_pct']:>8.3f}% {st.payload_bytes:>10,} "
              f"{row['dense_pct']:>7.3f}% {row['bytes_per_changed']:>9.3f} {t_diff:>7.3f} "
              f"{t_patch:>8.3f} {in_place_bytes:>10,} {t_apply:>8.3f}  "
              f"{'yes' if exact else 'NO'}")
        shutil.rmtree(trainer / f"v{v - 1}")
        if not exact:
            raise SystemExit(f"a receiver differs from the trainer's export at version {v}")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(f"all {steps} refits bit-exact on the checkpoint copy and on "
          f"{len(fleet.receivers)} receivers; summary in {out / 'summary.json'}")
    return rows


class _Receiver:
    def __init__(self, label: str, make: Callable[[], Any], runtime_of: Callable[[Any], Any]):
        from dcr.apply.engine import ApplyEngine

        self.label, self.make, self.runtime_of = label, make, runtime_of
        self.model = make()
        self.engine = ApplyEngine(runtime_of(self.model))

    def load_dense(self, model: Any, tensors: dict[str, Any]) -> None:
        self.runtime_of(model).load_weights(tensors.items())

    def matches_dense(self, tensors: dict[str, Any]) -> bool:
        import torch

        want = self.make()
        self.load_dense(want, tensors)
        a = dict(self.runtime_of(self.model).named_tensors())
        b = dict(self.runtime_of(want).named_tensors())
        return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


class _Fleet:
    """Rollout receivers that refit in place through their own loaders."""

    def __init__(self, cfg: Any, v0: Checkpoint) -> None:
        import torch
        from transformers import LlamaForCausalLM

        from dcr.apply.engine import CanonicalTensor
        from dcr.runtimes.hf import HFRuntime
        from dcr.runtimes.vllm import VllmRuntime
        from dcr.runtimes.vllm_reference import ReferenceConfig, ReferenceModel

        ref = ReferenceConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            tie_word_embeddings=False, fp8_modules=("self_attn.o_proj",),
        )
        def llama() -> torch.nn.Module:
            return LlamaForCausalLM(cfg).to(dtype=torch.bfloat16)  # type: ignore[call-arg, no-any-return]

        self.receivers = [
            _Receiver("transformers Llama", llama, HFRuntime),
            *(
                _Receiver(f"vLLM-layout TP2 rank {r}",
                          functools.partial(ReferenceModel, ref, tp_size=2, tp_rank=r),
                          VllmRuntime)
                for r in range(2)
            ),
        ]
        tensors = _torch_tensors(v0)
        for r in self.receivers:
            r.load_dense(r.model, tensors)
        canon = [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=i.shape) for i in v0]
        self.profile: ReceiverProfile = merge(r.engine.prewarm(canon) for r in self.receivers)
        self.coverage = coverage(self.profile, {i.name: i.nbytes for i in v0})
        self.store = MemoryStore()

    def refit(self, base: Checkpoint, target: Checkpoint, version: int
              ) -> tuple[int, float, bool]:
        m = diff_checkpoints(base, target, self.store, DiffSettings(
            version=version, base_version=version - 1, profile=self.profile))
        payloads = [self.store.get(e.key) for e in m.payloads]
        t0 = time.perf_counter()
        for r in self.receivers:
            r.engine.apply_payloads(payloads)
        seconds = time.perf_counter() - t0
        tensors = _torch_tensors(target)
        return m.stats.payload_bytes, seconds, all(r.matches_dense(tensors)
                                                   for r in self.receivers)


def _torch_tensors(ckpt: Checkpoint) -> dict[str, Any]:
    import torch

    return {
        i.name: torch.from_numpy(np.array(ckpt.bits(i.name)).view(np.int16))
        .view(torch.bfloat16).reshape(i.shape)
        for i in ckpt
    }
