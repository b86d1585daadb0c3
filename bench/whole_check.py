"""What checking a rank's whole state at every flush costs per GiB, on this CPU.

The flush compares every tensor and region a rank holds with the manifest's targets, not
only what the attempt wrote (docs/protocol.md, "What is checked before and after apply"):
one pass over the rank's weights per flush. A rank holding a tensor whole pays xxh3-128 of
its bits; a TP rank holding a shard pays the additive region sum of its elements (the C
kernel on the CPU; on a device torch's elementwise passes, not measured here). Both are
timed on one BF16 tensor of each size, median of ``--repeat`` runs, one core. Writes
``bench/results/whole-check.json``.

    .venv/bin/python bench/whole_check.py [--mib 16 64 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from dcr.checkpoint import fingerprint
from dcr.codec.sums import span_sum
from dcr.settings import GiB, MiB
from region_sums import timed  # the median of repeated runs, as that bench times

RESULTS = Path(__file__).resolve().parent / "results" / "whole-check.json"


def measure(mib: int, repeat: int) -> dict[str, Any]:
    bits = np.random.default_rng(mib).integers(0, 1 << 16, mib * MiB // 2, dtype=np.uint16)
    span = (0, (bits.size,), (1,))
    xxh3_s = timed(lambda: fingerprint(bits), repeat)
    sum_s = timed(lambda: span_sum(bits, span), repeat)
    return {"mib": mib, "xxh3_s": xxh3_s, "sum_s": sum_s,
            "xxh3_gb_s": bits.nbytes / xxh3_s / 1e9, "sum_gb_s": bits.nbytes / sum_s / 1e9,
            "xxh3_ms_per_gib": xxh3_s * GiB / bits.nbytes * 1e3,
            "sum_ms_per_gib": sum_s * GiB / bits.nbytes * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = [measure(m, args.repeat) for m in args.mib]
    out = {"bench": "whole-check", "machine": platform.machine(), "cpus": os.cpu_count(),
           "command": "bench/whole_check.py " + " ".join(
               ["--mib", *map(str, args.mib), "--repeat", str(args.repeat)]),
           "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
