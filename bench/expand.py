"""Where records become positions: the codec's C kernel on the host, or torch on the device.

The applier's device path (``Applier(expand="device")``, ``agent/dcr/apply/expand.py``)
sends each item's location coding and values to the device and expands and scatters them
there with torch operations; the host path expands them with the codec's C kernel. Both
run on the CPU too, and this benchmark puts them side by side there: one rank of the
vLLM-layout reference Llama (0.62 GB BF16; TP 1 and 2), one torch thread, a uniform 1%,
3% and 5% of the elements moved by one ulp, the same payload set applied through both
paths in alternating order, best of ``--reps``. After each set both ranks must hold the
same bits and equal a dense load (it exits 1 otherwise). Writes
``bench/results/expand.json``; the GPU numbers come from ``make gpu-check ENGINE=reference``
on a machine that has one. Nothing here asserts a time.

    .venv/bin/python bench/expand.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from apply import canonical, one_ulp, source, throughput_config
from dcr.apply.applier import Applier
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

PATHS = ("host", "device")


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = dense_state(a), dense_state(b)
    return all(torch.equal(sa[n].view(torch.uint8), sb[n].view(torch.uint8)) for n in sa)


def compare(cfg: ReferenceConfig, tp: int, rate: float, reps: int) -> dict[str, Any]:
    base = random_checkpoint(cfg, 0)
    dense_bytes = sum(t.numel() * t.element_size() for t in base.values())
    models = {p: ReferenceModel(cfg, tp_size=tp, tp_rank=0) for p in PATHS}
    engines = {}
    for p, model in models.items():
        model.load_weights(base.items())
        engines[p] = Applier(VllmRuntime(model), expand=p)  # type: ignore[arg-type]
    profile = engines["host"].prewarm(canonical(base))
    engines["device"].prewarm(canonical(base))
    best: dict[str, dict[str, Any]] = {}
    exact = True
    for rep in range(reps):
        new = one_ulp(base, rate, seed=rep)
        store = MemoryStore()
        m = diff_checkpoints(source(base), source(new), store, EncodeSettings(
            target_version=rep + 1, base_version=rep, profile=profile, attempt=f"a-{rep}"))
        payloads = [store.get(e.key) for e in m.payloads]
        for p in (PATHS if rep % 2 == 0 else PATHS[::-1]):
            t0 = time.perf_counter()
            report = engines[p].apply_payloads(payloads)
            seconds = time.perf_counter() - t0
            if p not in best or seconds < best[p]["seconds"]:
                best[p] = {"seconds": round(seconds, 4),
                           "decode_s": round(report.decode_s, 4),
                           "scatter_s": round(report.scatter_s, 4),
                           "expand_s": round(report.expand_s, 4),
                           "loader_s": round(report.loader_s, 4),
                           "dense_equivalent_GBps": round(dense_bytes / seconds / 1e9, 2)}
        dense = ReferenceModel(cfg, tp_size=tp, tp_rank=0)
        dense.load_weights(new.items())
        exact &= _same(models["host"], models["device"]) and _same(models["host"], dense)
        records = report.records
        base = new
    return {"tp": tp, "changed_pct": 100 * rate, "records": records,
            "dense_bytes": dense_bytes, **{p: best[p] for p in PATHS},
            "device_over_host": round(best["device"]["seconds"] / best["host"]["seconds"], 3),
            "scatter_device_over_host": round(
                best["device"]["scatter_s"] / best["host"]["scatter_s"], 3),
            "bit_exact": exact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/expand.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = throughput_config(args.quick)
    reps = 2 if args.quick else args.reps
    rows = []
    print(f"{'TP':>3} {'changed':>7} {'host s':>7} {'device s':>8} {'ratio':>6} "
          f"{'host scatter':>12} {'device scatter':>14} {'exact':>5}")
    for tp in (1, 2):
        for rate in (0.01, 0.03, 0.05):
            r = compare(cfg, tp, rate, reps)
            rows.append(r)
            print(f"{tp:>3} {r['changed_pct']:>6.0f}% {r['host']['seconds']:>7.3f} "
                  f"{r['device']['seconds']:>8.3f} {r['device_over_host']:>6.2f} "
                  f"{r['host']['scatter_s']:>12.3f} {r['device']['scatter_s']:>14.3f} "
                  f"{r['bit_exact']!s:>5}", flush=True)
    exact = all(r["bit_exact"] for r in rows)
    doc = {
        "benchmark": "expand",
        "command": "python bench/expand.py" + (" --quick" if args.quick else ""),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": 1,
                    "load_average": [round(x, 2) for x in os.getloadavg()]},
        "config": {k: str(v) for k, v in vars(cfg).items()},
        "reps": reps, "rows": rows, "bit_exact": exact,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"bit-exact: {exact}; wrote {args.out}")
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
