"""GRPO step time by phase with DCR's refit, and the refit's share, at two model sizes.

Runs the RL main job (:mod:`dcr.rl.loop`: TRL's GRPOTrainer, rollout pods behind 200 Mbit/s
links to a real S3 server, a DCR refit after every step) once per size, no kill, and
records each step's reward, generate / train / refit seconds and the refit's share of the
step; beside each DCR refit, in the same run, a dense full-checkpoint refit of the same
weights through the same store and links (``--no-dense`` leaves it out). Writes
``bench/results/rl.json``; docs/evaluation.md quotes it.

    .venv/bin/python bench/rl.py --steps 8
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

from dcr.rl.job import RlSettings
from dcr.rl.loop import run_rl

RESULTS = Path(__file__).resolve().parent / "results" / "rl.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="GRPO steps per size")
    p.add_argument("--sizes", default="tiny,small", help="comma-separated model sizes")
    p.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                   help="time a dense full-checkpoint refit beside each DCR refit")
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"rl-{size}-") as out:
            s = RlSettings(out=Path(out), steps=args.steps, size=size,  # type: ignore[arg-type]
                           kill_step=0, dense=args.dense)
            runs.append(run_rl(s))
    command = f"bench/rl.py --steps {args.steps} --sizes {args.sizes}" + (
        "" if args.dense else " --no-dense")
    RESULTS.write_text(json.dumps({"command": command, "machine": platform.machine(),
                                   "cpus": _cpus(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
