"""Prometheus text exposition, shared by the agent's and the operator's ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

Sample = tuple[str, float]  # (labels as written, e.g. '{outcome="committed"}' or "", value)


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "counter" or "gauge"
    help: str
    samples: list[Sample]


def render(families: list[Family]) -> str:
    lines: list[str] = []
    for f in families:
        lines += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} {f.kind}"]
        lines += [f"{f.name}{labels} {value}" for labels, value in f.samples]
    return "\n".join(lines) + "\n"
