"""The main job's bytes across the boundary, counted apart: DCR refits, rejoins, and the
full-checkpoint refits timed beside them for comparison.

Each pod's link is read before a step, after its DCR refit and rejoins, and after its full
refit. A rejoin's bytes are what the pod's agent read from the store to rebuild a version
(its own counter, at an attempt's admission or after the commit); the rest of the first
phase is the DCR refit's payloads, manifests and polling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PHASES = (("dcr", "DCR refits"), ("rejoin", "rejoins"), ("full", "full-checkpoint refits"))


def split_down(before: Mapping[str, int], refit: Mapping[str, int], full: Mapping[str, int],
               rejoins: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Bytes down each pod's link in one step, by phase: ``before`` the refit, after the
    DCR ``refit`` and its rejoins, after the ``full`` refit; ``rejoins`` by pod."""
    out = {}
    for name, b in before.items():
        rejoin = min(rejoins.get(name, 0), refit[name] - b)
        out[name] = {"dcr": refit[name] - b - rejoin, "rejoin": rejoin,
                     "full": full[name] - refit[name]}
    return out


def mb(n: int) -> str:
    """``n`` bytes in MB, as the main job prints them."""
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{n / 1e6:.1f} MB"


def totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Each pod's bytes down its link over the run, by phase."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        for pod, phases in r.get("link_down_bytes", {}).items():
            into = out.setdefault(pod, dict.fromkeys((p for p, _ in PHASES), 0))
            for p, n in phases.items():
                into[p] += n
    return out


def crossed_lines(rows: Sequence[Mapping[str, Any]],
                  crossed: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The summary's lines on the boundary: none without links."""
    if not crossed:
        return []
    lines = ["bytes across the boundary, down each pod's link over the run, counted apart: "
             + ", ".join(label for _, label in PHASES)]
    for pod, phases in totals(rows).items():
        lines.append(f"  {pod}: " + ", ".join(f"{label} {mb(phases[p])}"
                                             for p, label in PHASES))
    if "relay-root" in crossed:
        lines.append(f"  relay-root (the trainer's link, DCR attempts only): "
                     f"{mb(crossed['relay-root']['up'])} up")
    pods = totals(rows).values()
    dcr = sum(p["dcr"] + p["rejoin"] for p in pods)
    full = sum(p["full"] for p in pods)
    if dcr and full:
        lines.append(f"  all pods: DCR refits and rejoins {mb(dcr)}, full-checkpoint refits "
                     f"{mb(full)} ({full / dcr:.0f}x DCR's)")
    return lines
