"""The main job's plot, ``refit.png``: every stage of every attempt and the rejoins after
it, bytes per step on a linear axis (DCR's share written on its bars), and the
full-checkpoint refit's seconds beside DCR's. Without matplotlib there is no plot.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The coordinator's stages in the order they run; "other" is the rest of a step's
# total_s (admission, a rejoin at admission, abandoning a failed attempt).
STAGES = ("prepare", "publish", "stage", "gate", "flush", "commit", "finish")
OTHER = "admission, rejoin at admission, abandon"
AFTER = "rejoin after the commit"
LEGEND = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.18), "fontsize": 8, "ncol": 2}


def _label(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(**LEGEND)


def _timeline(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Stacked seconds per attempt; each step's bars sum to its total_s, and a step's
    rejoin after the commit sits on its last attempt."""
    colors = {name: f"C{k}" for k, name in enumerate((*STAGES, OTHER, AFTER))}
    seen: set[str] = set()
    x, ticks, top = 0.0, [], 0.0

    def bar(sec: float, bottom: float, name: str, hatch: str | None) -> float:
        if sec > 0:
            ax.bar(x, sec, bottom=bottom, color=colors[name], hatch=hatch,
                   label=None if name in seen else name)
            seen.add(name)
        return bottom + sec

    for r in rows:
        attempts = r["attempts"]
        drawn = sum(sum(h["stages"].values()) for h in attempts)
        for i, h in enumerate(attempts):
            hatch = "//" if h["outcome"] != "committed" else None
            bottom = 0.0
            for name in STAGES:
                bottom = bar(h["stages"].get(name, 0.0), bottom, name, hatch)
            if i == len(attempts) - 1:
                bottom = bar(max(0.0, r["total_s"] - drawn), bottom, OTHER, None)
                bottom = bar(r.get("rejoin_after_s", 0.0), bottom, AFTER, None)
            top = max(top, bottom)
            ticks.append((x, f"{r['step']}{'' if h['mode'] == 'mixed' else ' ow'}"))
            x += 1
        x += 0.5
    ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=8)
    ax.set_ylim(0, 1.1 * top)
    _label(ax, "step (attempts; ow = overwrite, hatched = failed)", "seconds",
           "refit timeline by stage")


def _bytes(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Dense bytes, DCR's payload (its share written on the bar) and rejoins' fetches."""
    steps = [r["step"] for r in rows]
    ax.bar([s - 0.27 for s in steps], [r["dense_bytes"] / 1e6 for r in rows], 0.27,
           label="dense (what a full refit applies)")
    bars = ax.bar(steps, [r["payload_bytes"] / 1e6 for r in rows], 0.27,
                  label="DCR payload")
    ax.bar([s + 0.27 for s in steps], [r.get("rejoin_fetched_bytes", 0) / 1e6 for r in rows],
           0.27, label="rejoins: fetched from the store")
    for b, r in zip(bars, rows, strict=True):
        ax.annotate(f"1/{r['dense_bytes'] / r['payload_bytes']:.0f}",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(steps)
    _label(ax, "step", "MB", "bytes per refit (1/N: DCR's share of dense)")


def _times(ax: Any, rows: list[dict[str, Any]]) -> None:
    steps = [r["step"] for r in rows]
    ax.bar([s - 0.2 for s in steps], [r["full_s"] for r in rows], 0.4,
           label="full checkpoint: upload, then download + dense load")
    ax.bar([s + 0.2 for s in steps], [r["total_s"] for r in rows], 0.4,
           label="DCR refit (all attempts)")
    ax.set_xticks(steps)
    _label(ax, "step", "seconds", "refit time per step, same store and links")


def plot_refit(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    for draw, ax in zip((_timeline, _bytes, _times), axes, strict=True):
        draw(ax, rows)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
