"""The RL main job's plot, ``rl.png``: reward per step, and each step's seconds by phase
(generate, train, refit) beside the refit a full checkpoint would take. Without
matplotlib there is no plot."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from dcr.rl.job import StepRow


def plot_rl(rows: Sequence[StepRow], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    steps = [r.step for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.plot(steps, [r.reward for r in rows], marker="o")
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean reward (share of digits)")
    ax1.set_title("reward per GRPO step")
    bottom = [0.0] * len(rows)
    for k, phase in enumerate(("generate_s", "train_s", "refit_s")):
        values = [getattr(r, phase) for r in rows]
        ax2.bar([s - 0.2 for s in steps], values, 0.4, bottom=bottom, color=f"C{k}",
                label=phase.removesuffix("_s") + (" (DCR)" if phase == "refit_s" else ""))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    dense = [r.dense_refit_s for r in rows]
    if all(d is not None for d in dense):
        ax2.bar([s + 0.2 for s in steps], [d or 0.0 for d in dense], 0.4, color="C3",
                label="full-checkpoint refit")
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.set_title("step time by phase")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
