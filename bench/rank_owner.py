"""What an owner inside a trainer rank costs per step: host memory, offer time, publish time.

One rank's shard of ``--mib`` MiB of BF16 tensors (64 MiB each, rows split over 8 ranks,
so the maps are a real row split), a step that changes ``--changed`` of its elements, then
per step: ``offer`` (the read in 64 MiB steps and the diff against the baseline),
``write`` (encode and put the payloads and the manifest part into a file store, with the
owner's parts of the region sums: the first write sums the whole shard once, later ones
only what the changes move) and ``advance`` (the commit applied to the baseline). Host
bytes held are the baseline plus the overlay's positions and bits, beside the shard's own
bytes. CPU tensors, read in place here; a GPU tensor's steps are device-to-host copies,
each overlapped with the last diff.
Writes ``bench/results/rank-owner.json``.

    .venv/bin/python bench/rank_owner.py [--mib 1024] [--changed 0.01] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dcr.owner.rank import RankOwner
from dcr.owner.shards import ShardMap
from dcr.settings import MiB
from dcr.transport.store import FileStore

RESULTS = Path(__file__).resolve().parent / "results" / "rank-owner.json"
TENSOR_MIB, RANKS, RANK = 64, 8, 3


def shard(mib: int) -> tuple[dict[str, ShardMap], dict[str, torch.Tensor]]:
    rows = TENSOR_MIB * MiB // 2 // 4096  # local rows of a [rows * RANKS, 4096] BF16 tensor
    maps, tensors = {}, {}
    gen = torch.Generator().manual_seed(0)
    for k in range(mib // TENSOR_MIB):
        name = f"model.layers.{k}.mlp.up_proj.weight"
        maps[name] = ShardMap(kind="rows", canonical=(name,), shape=(rows * RANKS, 4096),
                              dtype="BF16", rank=RANK, ranks=RANKS)
        tensors[name] = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16)
    return maps, tensors


def perturb(tensors: dict[str, torch.Tensor], rate: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        mask = torch.rand(t.shape, generator=gen) < rate
        t[mask] = (t[mask].float() * 1.01 + 1e-3).to(torch.bfloat16)


def run(mib: int, changed: float, steps: int) -> dict[str, Any]:
    maps, tensors = shard(mib)
    shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        owner = RankOwner(store=FileStore(Path(tmp)), maps=maps, tensors=tensors, version=0,
                          rank=RANK, ranks=RANKS)
        rows: list[dict[str, Any]] = [{"baseline_s": round(time.perf_counter() - t0, 3)}]
        for v in range(1, steps + 1):
            perturb(tensors, changed, v)
            t0 = time.perf_counter()
            overlay = owner.offer(tensors, v)
            t1 = time.perf_counter()
            held = sum(b.nbytes for b in owner.baseline.values()) + sum(
                p.nbytes + x.nbytes for p, x in overlay.changes.values())
            m = owner.write(attempt=f"a-{v}", mode="mixed", base_version=v - 1,
                            target_version=v)
            t2 = time.perf_counter()
            owner.advance(v, f"a-{v}")
            t3 = time.perf_counter()
            rows.append({"version": v, "changed_elements": overlay.elements,
                         "offer_s": round(t1 - t0, 3), "write_s": round(t2 - t1, 3),
                         "advance_s": round(t3 - t2, 3), "payload_bytes":
                         m.stats.payload_bytes, "host_bytes_held": held,
                         "held_over_shard": round(held / shard_bytes, 4)})
            print(f"v{v}: offer {t1 - t0:.2f} s, write {t2 - t1:.2f} s, advance "
                  f"{t3 - t2:.2f} s, held {held / shard_bytes:.3f}x the shard", flush=True)
    steady = rows[2:] if steps > 1 else rows[1:]  # the first write sums the shard once
    gib = shard_bytes / (1 << 30)
    return {"shard_bytes": shard_bytes, "changed": changed, "steps": rows,
            "per_gib_of_shard": {
                key: round(float(np.median([r[f"{key}_s"] for r in steady])) / gib, 3)
                for key in ("offer", "write", "advance")},
            "held_over_shard_max": max(r["held_over_shard"] for r in steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "command": f"bench/rank_owner.py --mib {a.mib} --changed {a.changed} "
                         f"--steps {a.steps}",
              **run(a.mib, a.changed, a.steps)}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["per_gib_of_shard"]), result["held_over_shard_max"])


if __name__ == "__main__":
    main()
