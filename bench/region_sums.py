"""What the post-apply checks cost: xxh3-128 of a whole tensor beside the region sums.

One BF16 tensor of ``--mib`` MiB ([rows, 4096]), side by side in one run: the whole-tensor
fingerprint a rank holding it whole compares (xxh3-128), the additive sum of the whole
tensor (the C kernel: what a rank on the CPU runs; a device's rank runs torch's, whose
dozen elementwise passes are bound by a GPU's memory and are not measured here), a TP 2 rank's
region of it as a row-parallel shard holds it (every row's second half: the strided copy
out of storage and the sum), and what an owner's publish adds per step instead of a pass
(``delta_sum`` over 1% of the elements changed). Each is the median of ``--repeat`` runs.
Writes ``bench/results/region-sums.json``.

    .venv/bin/python bench/region_sums.py [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dcr.checkpoint import fingerprint
from dcr.codec.sums import delta_sum, span_sum
from dcr.settings import MiB

RESULTS = Path(__file__).resolve().parent / "results" / "region-sums.json"
COLS = 4096


def timed(fn: Callable[[], object], repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return float(np.median(runs))


def run(mib: int, repeat: int) -> dict[str, Any]:
    rows = mib * MiB // 2 // COLS
    bits = np.random.default_rng(0).integers(0, 1 << 16, size=rows * COLS, dtype=np.uint16)
    whole = (0, (bits.size,), (1,))
    half = (COLS // 2, (rows, COLS // 2), (COLS, 1))  # rank 1 of a row-parallel split
    stored = bits.reshape(rows, COLS)[:, COLS // 2 :]  # as the rank's storage holds it
    changed = np.sort(np.random.default_rng(1).choice(bits.size, bits.size // 100,
                                                      replace=False)).astype(np.int64)
    new = bits[changed] ^ np.uint16(1)
    cases: dict[str, Callable[[], object]] = {
        "xxh3-128 whole": lambda: fingerprint(bits),
        "sum64 whole (C)": lambda: span_sum(bits, whole),
        "sum64 TP 2 region (copy + C)": lambda: span_sum(np.ascontiguousarray(stored), half),
        "owner step: delta_sum at 1% (whole + region)": lambda: (
            delta_sum([whole], changed, bits[changed], new),
            delta_sum([half], changed, bits[changed], new)),
    }
    out = {}
    for name, fn in cases.items():
        s = timed(fn, repeat)
        out[name] = {"seconds": round(s, 4), "gb_per_s_of_tensor": round(bits.nbytes / s / 1e9, 2)}
        print(f"{name}: {s:.3f} s, {bits.nbytes / s / 1e9:.2f} GB/s of tensor", flush=True)
    base = out["xxh3-128 whole"]["seconds"]
    for v in out.values():
        v["over_xxh3"] = round(v["seconds"] / base, 2)
    return {"tensor_bytes": int(bits.nbytes), "cases": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "command": f"bench/region_sums.py --mib {a.mib} --repeat {a.repeat}",
              **run(a.mib, a.repeat)}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
