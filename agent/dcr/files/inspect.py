"""``dcr inspect``: what a version's delta holds, per tensor.

Streams are shared by all items of a payload, so a tensor's wire bytes are estimated by
giving each item the share of every stream's compressed size that its raw bytes take.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from dcr.format.dtypes import DTYPES
from dcr.format.manifest import Manifest
from dcr.format.payload import read_payload
from dcr.transport.store import Store


def describe(store: Store, m: Manifest) -> dict[str, Any]:
    numel = {t.name: math.prod(t.shape) for t in m.tensors}
    dtype = {t.name: t.dtype for t in m.tensors}
    changed: dict[str, int] = defaultdict(int)
    wire: dict[str, float] = defaultdict(float)
    coding: dict[str, set[str]] = defaultdict(set)
    for e in m.payloads:
        h = read_payload(store.get(e.key)).header
        ratio = {s.id: s.packed / s.raw for s in h.streams}
        for it in h.items:
            changed[it.name] += it.count
            coding[it.name].add(f"{it.entry}/{it.loc}")
            wire[it.name] += sum(ratio[sid] * n for sid, n in it.stream_sizes())
    tensors = [
        {
            "name": t.name,
            "dtype": t.dtype,
            "elements": numel[t.name],
            "changed": changed[t.name],
            "changed_pct": 100 * changed[t.name] / max(1, numel[t.name]),
            "encoding": ",".join(sorted(coding[t.name])) or "-",
            "bytes": round(wire[t.name]),
            "dense_bytes": numel[t.name] * DTYPES[dtype[t.name]].itemsize,
        }
        for t in m.tensors
    ]
    return {
        "version": m.target_version,
        "base_version": m.base_version,
        "attempt": m.attempt,
        "mode": m.mode,
        "payloads": len(m.payloads),
        **m.stats.model_dump(),
        "tensor_rows": tensors,
    }


def render(report: dict[str, Any]) -> str:
    rows = report["tensor_rows"]
    width = max([len(r["name"]) for r in rows] + [6])
    lines = [
        f"version {report['base_version']} -> {report['version']}  attempt {report['attempt']}  "
        f"mode {report['mode']}  {report['payloads']} payloads",
        f"{'tensor':<{width}}  {'dtype':<7} {'changed':>12} {'%':>8}  {'encoding':<24} "
        f"{'bytes':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r['name']:<{width}}  {r['dtype']:<7} {r['changed']:>12,} {r['changed_pct']:>7.3f}%"
            f"  {r['encoding']:<24} {r['bytes']:>12,}"
        )
    dense = max(1, report["dense_bytes"])
    lines.append(
        f"total: {report['changed_elements']:,} of {report['total_elements']:,} elements changed; "
        f"{report['payload_bytes']:,} payload bytes = {100 * report['payload_bytes'] / dense:.3f}% "
        f"of {report['dense_bytes']:,} dense bytes"
    )
    return "\n".join(lines)

