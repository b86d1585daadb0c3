"""GRPO step time by phase with DCR's refit against a dense one, by model size and learning rate.

Runs the RL main job (:mod:`dcr.rl.loop`: TRL's GRPOTrainer, rollout pods behind 200 Mbit/s
links to a real S3 server, a DCR refit after every step) once per size and learning rate,
no kill, and records each step's reward, generate / train / refit seconds, the refit's
share of the step, the share of BF16 elements the step changed and the bytes down the
pods' links; beside each DCR refit, in the same run, a dense full-checkpoint refit of the
same weights through the same store and links (``--no-dense`` leaves it out). The
learning rate decides what DCR can save: the job's 3e-3 (a tiny model learning in a few
steps) changes nearly every element each step, RL fine-tuning's 1e-6..1e-5 a small part.
Writes ``bench/results/rl.json`` (one run per size and rate, each with its settings);
docs/evaluation-rl.md quotes it.

    .venv/bin/python bench/rl.py --steps 8 --lrs 3e-3,1e-5,1e-6
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
    p.add_argument("--lrs", default="3e-3", help="comma-separated learning rates")
    p.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                   help="time a dense full-checkpoint refit beside each DCR refit")
    args = p.parse_args()
    lrs = [_rate(x) for x in args.lrs.split(",")]
    runs: list[dict[str, Any]] = []
    for size in args.sizes.split(","):
        for lr in lrs:
            with tempfile.TemporaryDirectory(prefix=f"rl-{size}-") as out:
                s = RlSettings(out=Path(out), steps=args.steps, kill_step=0, dense=args.dense,
                               lr=lr, size=size)
                runs.append(run_rl(s))
    command = f"bench/rl.py --steps {args.steps} --sizes {args.sizes} --lrs {args.lrs}" + (
        "" if args.dense else " --no-dense")
    RESULTS.write_text(json.dumps({"command": command, "machine": platform.machine(),
                                   "cpus": _cpus(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


def _rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"--lrs: {text!r} is not a learning rate") from None


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
