"""The main job's plot, ``refit.png``: each attempt's stages, bytes per step, and the
full-checkpoint refit's seconds beside DCR's. Without matplotlib there is no plot.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def plot_refit(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    stages = ("prepare", "publish", "flush", "commit", "finish")
    x = 0.0
    ticks = []
    for r in rows:
        for h in r["attempts"]:
            bottom = 0.0
            for k, stage in enumerate(stages):
                sec = h["stages"].get(stage, 0.0)
                ax1.bar(x, sec, bottom=bottom, color=f"C{k}", label=stage if x == 0 else None,
                        hatch="//" if h["outcome"] != "committed" else None)
                bottom += sec
            ticks.append((x, f"{r['step']}{'' if h['mode'] == 'mixed' else ' ow'}"))
            x += 1
        x += 0.5
    ax1.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=8)
    ax1.set_xlabel("step (attempts; ow = overwrite, hatched = failed)")
    ax1.set_ylabel("seconds")
    ax1.set_title("refit timeline by stage")
    ax1.legend(fontsize=8)
    steps = [r["step"] for r in rows]
    ax2.bar([s - 0.2 for s in steps], [r["dense_bytes"] for r in rows], 0.4, label="dense")
    ax2.bar([s + 0.2 for s in steps], [r["payload_bytes"] for r in rows], 0.4, label="DCR payload")
    ax2.set_yscale("log")
    ax2.set_xticks(steps)
    ax2.set_xlabel("step")
    ax2.set_ylabel("bytes")
    ax2.set_title("bytes per refit")
    ax2.legend(fontsize=8)
    ax3.bar([s - 0.2 for s in steps], [r["full_s"] for r in rows], 0.4,
            label="full checkpoint: upload, then download + dense load")
    ax3.bar([s + 0.2 for s in steps], [r["total_s"] for r in rows], 0.4,
            label="DCR refit (all attempts)")
    ax3.set_xticks(steps)
    ax3.set_ylim(0, 1.4 * max(max(r["full_s"], r["total_s"]) for r in rows))  # legend room
    ax3.set_xlabel("step")
    ax3.set_ylabel("seconds")
    ax3.set_title("refit time per step, same store and links")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
