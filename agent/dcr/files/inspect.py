"""``dcr inspect`` and ``dcr history``: what a version's delta holds, per tensor, and
what a store's history commits and keeps.

Streams are shared by all items of a payload, so a tensor's wire bytes are estimated by
giving each item the share of every stream's compressed size that its raw bytes take.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from dcr.errors import ConfigError, ObjectNotFound
from dcr.files.history import HistoryStore
from dcr.format.dtypes import DTYPES
from dcr.format.history import HISTORY_KEY
from dcr.format.manifest import Manifest
from dcr.format.payload import read_payload
from dcr.transport.store import Store


class NoHistory(ConfigError):
    """The store holds no history (a ``dcr diff`` store): nothing to read or build from."""


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



NO_HISTORY = ("{uri} holds no history: only a coordinator (the operator, dcr.client, "
              "dcr refit) writes one as it commits; versions `dcr diff` wrote are read "
              "with `dcr inspect --version N` and applied with `dcr patch`.")


def history_report(store: Store, digest: str | None = None) -> dict[str, Any]:
    """What the store's history holds: every committed version (its base, attempt,
    manifest parts and payload bytes) and the snapshots kept. NoHistory if it has none."""
    hs = HistoryStore(store, digest)
    history = hs.read()
    if digest is None and not store.exists(HISTORY_KEY):
        raise NoHistory(NO_HISTORY.format(uri=store.uri))
    return {"committed": history.committed,
            "versions": [{"version": c.version, "base_version": c.base_version,
                          "attempt": c.attempt, "parts": len(c.parts),
                          "payload_bytes": c.payload_bytes} for c in history.versions],
            "snapshots": [{"version": s.version, "bytes": s.bytes, "index": s.index.key}
                          for s in history.snapshots]}


def render_history(report: dict[str, Any]) -> str:
    lines = [f"committed version {report['committed']}; {len(report['versions'])} versions, "
             f"{len(report['snapshots'])} snapshots kept", "",
             f"{'version':>7}  {'base':>5}  {'attempt':<16} {'parts':>5} {'payload bytes':>15}"]
    lines += [f"{v['version']:>7}  {v['base_version']:>5}  {v['attempt']:<16} {v['parts']:>5} "
              f"{v['payload_bytes']:>15,}" for v in report["versions"]]
    lines += ["", f"{'snapshot':>8}  {'bytes':>15}  index"]
    lines += [f"{s['version']:>8}  {s['bytes']:>15,}  {s['index']}" for s in report["snapshots"]]
    return "\n".join(lines)


def committed_manifest(store: Store, version: int, digest: str | None = None) -> Manifest:
    """The manifest of a version a coordinator committed (its owners' parts, merged and
    checked against the history): what ``dcr inspect`` reads where no ``dcr diff`` wrote."""
    hs = HistoryStore(store, digest)
    history = hs.read()
    entry = next((c for c in history.versions if c.version == version), None)
    if entry is None:
        kept = ", ".join(str(c.version) for c in history.versions) or "none"
        raise ObjectNotFound(f"{store.uri} holds no manifest of version {version}, and its "
                             f"history commits no such version (it commits: {kept}).")
    return hs.manifest(entry)
