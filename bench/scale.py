"""A refit at 10, 100 and 1,000 receivers through the real operator and API server.

The scale harness of tests/support/farm.py: N Pod objects in a real kube-apiserver (with
etcd and kube-controller-manager, tests/support/controlplane.py), Ready at their own
loopback addresses, and at each a real agent (AgentService behind the agent's HTTP app)
over the small vLLM-layout reference model, all in this process; the operator as the
chart runs it, its encoder Job run as a local process. One refit per N (v0 -> v1, ~3% of
the elements changed), from the WeightRefit's creation to Committed. Recorded per N: wall
time and stages, the operator's CPU seconds and peak memory, API-server requests by verb
and resource (the bench's own polls of the WeightRefit included, and counted), status
bytes, and the agents' store requests by kind, also per receiver (waiting for the owners
included). Everything shares this machine's cores:
the agents' work and the operator's run side by side, so times are upper bounds.
Writes ``bench/results/scale.json``.

    .venv/bin/python bench/scale.py [--receivers 10 100 1000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from controlplane import ControlPlane, build_binaries, built
from farm import ScaleFleet
from transitions import reference_transition

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"


def per_receiver(r: dict[str, Any]) -> dict[str, Any]:
    """The agents' store requests per receiver for the refit, by kind and in all: from the
    WeightRefit's creation to Committed, so the polls of receivers waiting for their owners
    (prepared before the encoder publishes, while it publishes) are in them. With the
    seconds of that wait (the attempt's publish stage) and the requests per receiver per
    second of the refit, what waiting costs as it grows."""
    n, counts = r["receivers"], r["agent_store_requests"]
    each = {kind: round(c / n, 2) for kind, c in sorted(counts.items())}
    total = sum(counts.values()) / n
    return {"agent_store_requests_per_receiver": {**each, "total": round(total, 2)},
            "receivers_waited_for_owners_s": r["stages_s"].get("publish"),
            "agent_store_requests_per_receiver_s": round(total / r["created_to_end_s"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--receivers", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    # 1,000 agents hold several thousand sockets and threads.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 65536), hard), hard))
    helm = built("helm")["helm"]
    transition = reference_transition()
    runs: list[dict[str, Any]] = []
    with ControlPlane(build_binaries()) as cp:
        for n in args.receivers:
            with tempfile.TemporaryDirectory(prefix=f"dcr-scale-{n}-") as tmp:
                started = time.monotonic()
                with ScaleFleet(cp, helm, n, Path(tmp), transition,
                                fleet_status_seconds=max(5.0, n / 100)) as fleet:
                    setup_s = time.monotonic() - started
                    r = fleet.refit(timeout_s=1800)
                    r["bit_exact"] = fleet.farm.exact()
                r.pop("refit")
                r["setup_s"] = round(setup_s, 1)
                r.update(per_receiver(r))
                runs.append(r)
                print(f"{n:>5} receivers: {r['phase']} in {r['created_to_end_s']:.1f} s, "
                      f"operator {r['operator_cpu_s']:.1f} CPU s, peak "
                      f"{r['operator_peak_rss_mib']:.0f} MiB; agents {r['agents_cpu_s']:.1f} "
                      f"CPU s; {r['apiserver_requests']} API "
                      f"requests, status {r['weightrefit_status_bytes']:,} B, store requests "
                      f"per receiver {r['agent_store_requests_per_receiver']}, bit-exact "
                      f"{r['bit_exact']}", flush=True)
    base = runs[0]
    for r in runs:
        r["time_vs_smallest"] = round(r["created_to_end_s"] / base["created_to_end_s"], 2)
    args.out.write_text(json.dumps({
        "bench": "scale", "machine": {"cpus": len(os.sched_getaffinity(0)),
                                      "python": platform.python_version()},
        "model": {"config": {k: str(v) if k == "dtype" else v
                             for k, v in dataclasses.asdict(transition.cfg).items()},
                  "elements": sum(t.numel() for t in transition.old.values())},
        "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
