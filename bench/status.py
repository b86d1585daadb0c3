"""What a refit writes into its WeightRefit status as the fleet grows.

The operator's ``Recorder`` and ``TrackedReceiver`` run as a refit drives them, with the API
server faked at the operator's own seam (it keeps each merge patch's JSON); N agents answer
prepare and flush at once. Two refits per N: a clean one (one attempt), and one whose
first 32 attempts fail with every hundredth agent refusing its flush with a 4 KiB error.
Recorded: status writes per refit, bytes written in all, and the largest status object
(etcd refuses objects over 1.5 MiB). Acknowledgements fold into one write per
``--interval`` seconds, so the write count depends on how long the loop runs; nothing
here asserts a number. Writes ``bench/results/status.json``.

    .venv/bin/python bench/status.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from pathlib import Path
from typing import Any

from dcr.protocol.agent_api import AgentError, FlushAck
from dcr.protocol.coordinator import AttemptResult
from dcr.protocol.records import Attempt, Transition
from dcr_operator.progress import Recorder, TrackedReceiver

RESULTS = Path(__file__).resolve().parent / "results" / "status.json"
REFIT = {"metadata": {"name": "policy-v2", "namespace": "rl", "generation": 1}}


class Patches:
    """The API server, as far as a Recorder sees it: each status write's JSON."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.sizes.append(len(json.dumps(body)))
        return body


class ScaleReceiver:
    """One of many agents: acknowledges, or refuses with a long error of its own."""

    def __init__(self, name: str, refuse: bool) -> None:
        self.name, self.refuse = name, refuse

    def prepare(self, attempt: Attempt) -> None:
        pass

    def flush(self, attempt: Attempt) -> FlushAck:
        if self.refuse:
            raise AgentError(f"Agent {self.name} (POST /v1/flush): " + "x" * 4096, 500,
                             "FlushFailed")
        return FlushAck(attempt=attempt.id, payloads=16, bytes=1 << 20, apply_s=0.25,
                        wait_s=0.1)


def refit(n: int, failed_attempts: int, interval_s: float) -> dict[str, Any]:
    kube = Patches()
    rec = Recorder(kube, REFIT, emit=lambda *a: None, clock=lambda: "2026-01-01T00:00:00Z",  # type: ignore[arg-type]
                   min_interval_s=interval_s)
    names = tuple(f"rollout-{i:04d}" for i in range(n))
    history: list[AttemptResult] = []
    started = time.perf_counter()
    for k in range(failed_attempts + 1):
        failing = k < failed_attempts
        a = Attempt(transition=Transition(base_version=1, target_version=2),
                    mode="mixed" if k == 0 else "overwrite", receivers=names,
                    deadline=time.time() + 600, id=f"a-{k:012x}")
        history.append(AttemptResult(attempt=a.id, mode=a.mode, receivers=names))
        for i, name in enumerate(names):
            rx = TrackedReceiver(ScaleReceiver(name, failing and i % 100 == 7), rec,  # type: ignore[arg-type]
                                 lambda x: rec.attempt_started(x, history))
            rx.prepare(a)
            with contextlib.suppress(AgentError):
                rx.flush(a)
        history[-1].outcome = "failed: some agents refused" if failing else "committed"
        rec.sync(history)
        rec.flush()
    return {"receivers": n, "failed_attempts": failed_attempts,
            "seconds": round(time.perf_counter() - started, 3), "writes": len(kube.sizes),
            "bytes_written": sum(kube.sizes), "largest_status_bytes": max(kube.sizes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=1.0,
                   help="the Recorder's seconds between folded writes (the operator's: 1)")
    args = p.parse_args()
    rows = [refit(n, failed, args.interval) for n in (16, 64, 256, 1024) for failed in (0, 32)]
    for r in rows:
        print(f"{r['receivers']:5d} receivers, {r['failed_attempts']:2d} failed attempts: "
              f"{r['writes']:4d} writes, {r['bytes_written']:,} bytes, largest "
              f"{r['largest_status_bytes']:,} bytes ({r['seconds']} s)")
    RESULTS.write_text(json.dumps({
        "benchmark": "status", "command": "python bench/status.py",
        "machine": {"python": platform.python_version()}, "interval_s": args.interval,
        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
