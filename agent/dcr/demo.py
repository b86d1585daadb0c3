"""``make demo``: a real refit on one machine with embedded defaults.

Trains a small Llama-architecture model (transformers, random init, byte-level tokens)
on real text (the Python standard library's own source) with AdamW in fp32 and exports
a BF16 Hugging Face checkpoint after every optimizer step, as a trainer does. Each step
is then refit file-level: ``dcr diff`` writes the delta to a local file store and
``dcr patch`` brings a rollout copy of the previous version to the new one. After each
step every tensor of the rollout copy is compared bit for bit with the trainer's export.
"""

from __future__ import annotations

import inspect
import json
import shutil
import time
from pathlib import Path

import numpy as np

from dcr.checkpoint import Checkpoint
from dcr.files.diff import DiffSettings, diff_checkpoints
from dcr.files.patch import patch_checkpoint
from dcr.transport.store import FileStore

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


def run_demo(out: Path, *, steps: int = 3, seed: int = 0) -> list[dict[str, float]]:
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
    header = (f"{'step':>4} {'loss':>7} {'changed':>9} {'payload B':>10} {'% dense':>8} "
              f"{'B/changed':>9} {'diff s':>7} {'patch s':>8}  bit-exact")
    print(header)
    rows = []
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
        exact = bit_exact(rollout, trainer / f"v{v}")
        st = m.stats
        row = {
            "step": v, "loss": loss, "changed_pct": 100 * st.changed_elements / st.total_elements,
            "payload_bytes": st.payload_bytes, "dense_pct": 100 * st.payload_bytes / st.dense_bytes,
            "bytes_per_changed": st.payload_bytes / max(1, st.changed_elements),
            "diff_s": t_diff, "patch_s": t_patch, "bit_exact": exact,
        }
        rows.append(row)
        print(f"{v:>4} {loss:>7.4f} {row['changed_pct']:>8.3f}% {st.payload_bytes:>10,} "
              f"{row['dense_pct']:>7.3f}% {row['bytes_per_changed']:>9.3f} {t_diff:>7.3f} "
              f"{t_patch:>8.3f}  {'yes' if exact else 'NO'}")
        shutil.rmtree(trainer / f"v{v - 1}")
        if not exact:
            raise SystemExit(f"rollout copy differs from the trainer's export at version {v}")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(f"all {steps} refits bit-exact; summary in {out / 'summary.json'}")
    return rows
