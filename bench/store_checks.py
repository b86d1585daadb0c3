"""What the store's new checks cost a refit and a catch-up, before and after, in one run.

The main job's model (``dcr refit``'s trainer: the 23M-parameter Llama, AdamW steps
exported in BF16) refits two fleets side by side, in process, each through its own file
store: two warm encoders and two receivers as the main job's pods hold the model (a
transformers rank, and both ranks of a vLLM-layout TP2 model with FP8 ``o_proj``), each
an :class:`~dcr.receiver.service.AgentService` driving a
:class:`~dcr.serve.local.LocalDriver`. The fleets take turns at every version.

* **after**: the code as it is: each flush compares every fingerprint and region sum the
  manifest carries on every rank; the coordinator stages the history under its digest
  before the commit (``Coordinator(history=HistoryStore)``), adopting a new snapshot only
  once every piece is read back and fingerprinted, and publishes it after.
* **before**, rebuilt from the lower-level pieces: a driver whose ``check_targets`` keeps
  only what the attempt's payloads wrote (``ApplyOutcome.names``; the flush check before
  it covered every rank), and the history written after the commit by ``on_commit`` through
  ``HistoryStore.commit`` with an ``adopt`` that compares the snapshot index's
  fingerprints and fetches no piece (the adoption before read-back).

After every odd version the training side writes that version's snapshot into both stores
(not timed), so every even version's commit adopts one. Then ``--repeat`` refits whose
candidate equals the baseline: nothing written (such a manifest lists no tensor, so
neither side has a fingerprint to compare at flush).

Catch-up builds the newest version from the "after" store ``--repeat`` times each way:
replay from a seed of v0, and a snapshot plus the deltas after it, by
:func:`~dcr.files.materialize.materialize` (what ``dcr materialize`` and an agent's
``FromStore`` run) given the record's history digest, and by the same pieces called as
before its new checks: the store's history read whole with no digest, the seed copied
whole (``shutil.copytree``, not ``copy_vouched``), one route with no fallback.

Medians over repetitions; ratios after / before. Writes ``bench/results/store-checks.json``.
Not a test: nothing asserts speed.

    .venv/bin/python bench/store_checks.py [--versions 6] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.drivers.base import ApplyOutcome
from dcr.errors import ManifestError
from dcr.files.history import HistoryStore
from dcr.files.materialize import (
    VERSION_FILE,
    CountingStore,
    _check_held,
    _replay,
    materialize,
    plan,
)
from dcr.files.snapshot import fetch_snapshot, write_snapshot
from dcr.format.history import ObjectRef, Snapshot, SnapshotIndex
from dcr.format.names import object_digest
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.encoder import Encoder
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.records import CommitRecord
from dcr.receiver.service import AgentService
from dcr.refit.trainer import Trainer, TrainerSettings
from dcr.runtimes import build_runtime
from dcr.serve.local import LocalDriver
from dcr.transport.receive import StoreSource
from dcr.transport.store import FileStore

RESULTS = Path(__file__).resolve().parent / "results" / "store-checks.json"
PODS = {"hf": {"runtime": "hf", "tp": 1, "fp8": ()},  # as the main job's pods hold it
        "vllm-ref-tp2": {"runtime": "vllm-ref", "tp": 2, "fp8": ("self_attn.o_proj",)}}
STAGES = ("prepare", "publish", "flush", "commit", "finish")


class TouchedOnly(LocalDriver):
    """The flush check before the whole-state check: only what the payloads wrote. Its
    ranks log at every flush the tensors it leaves unchecked ("no fingerprint it can
    recompute"): every one the step did not move, such as the norm weights in BF16. That
    is the hole the "after" fleet closes; its ranks log none."""

    touched: set[str]

    def apply(self, payloads: Sequence[str]) -> ApplyOutcome:
        out = super().apply(payloads)
        self.touched |= out.names
        return out

    def check_targets(self, expect: Mapping[str, str]) -> dict[str, str]:
        kept = {k: v for k, v in expect.items() if k.partition("@")[0] in self.touched}
        self.touched = set()  # one attempt's flush
        return super().check_targets(kept)


class IndexOnly(HistoryStore):
    """Snapshot adoption before read-back: the index's fingerprints compared, no piece
    fetched, its declared size taken."""

    def _read_back(self, version: int, key: str, expect: dict[str, str],
                   tensor_bytes: int) -> Snapshot:
        data = self.store.get(key)
        index = SnapshotIndex.parse(data, f"{self.store.uri}/{key}")
        if index.version != version or index.tensors != expect:
            raise ManifestError(f"snapshot {key} is not the committed version {version}")
        return Snapshot(version=version, index=ObjectRef(key=key, size=len(data),
                                                         digest=object_digest(data)),
                        bytes=index.total_bytes)


@dataclass
class Fleet:
    name: str
    store: FileStore
    coordinator: Coordinator
    owners: list[Encoder]
    commits: SqliteCommitStore
    rows: list[dict[str, Any]] = field(default_factory=list)

    def refit(self, version: int, candidate: Checkpoint, kind: str) -> None:
        for o in self.owners:
            o.set_candidate(candidate, version)
        first = len(self.coordinator.history)
        t0 = time.perf_counter()
        self.coordinator.refit(version, f"v{version}")
        total = time.perf_counter() - t0
        tries = self.coordinator.history[first:]
        stages = tries[-1].stages
        self.rows.append({"kind": kind, "version": version, "total_s": total,
                          "attempts": [t.outcome.split(":")[0] for t in tries],
                          "rejoined": [n for t in tries for n in t.rejoined],
                          "stages": {s: stages.get(s, 0.0) for s in STAGES}})


def receiver(name: str, pod: dict[str, Any], ckpts: Path, work: Path, before: bool
             ) -> AgentService:
    staging = work / f"{name}-staging"
    built = [build_runtime(pod["runtime"], ckpts / "v0", tp_size=pod["tp"], tp_rank=r,
                           fp8=pod["fp8"]) for r in range(pod["tp"])]
    models = [getattr(b, "model", b) for b in built]  # a transformers rank: its model
    driver = TouchedOnly if before else LocalDriver
    engine = driver(models, staging_dir=staging, checkpoint_root=ckpts)  # type: ignore[arg-type]
    if before:
        engine.touched = set()  # type: ignore[attr-defined]
    engine.load_dense("v0")
    with Checkpoint(ckpts / "v0") as c:
        canonical = [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=i.shape)
                     for i in c]
    store = FileStore(work / "store")
    return AgentService(
        name, engine, lambda spec: StoreSource(store=store, version=spec.target_version,
                                               attempt=spec.attempt, owners=spec.owners),
        canonical=canonical, staging_dir=staging, version=0)


def fleet(name: str, ckpts: Path, work: Path, v0: Checkpoint) -> Fleet:
    before = name == "before"
    work.mkdir(parents=True)
    store = FileStore(work / "store")
    rxs = [receiver(f"{name}-{k}", pod, ckpts, work, before) for k, pod in PODS.items()]
    profile = merge(ReceiverProfile.model_validate(r.profile()) for r in rxs)
    owners = [Encoder(store=store, baseline=v0, version=0, owner=k, owners=2, profile=profile)
              for k in range(2)]
    commits = SqliteCommitStore(work / "commit.db", CommitRecord(
        committed_version=0, baseline_id="v0", attempt=""))
    if before:
        old = IndexOnly(store)

        def on_commit(rec: CommitRecord, n: int) -> None:
            old.commit(rec.committed_version, rec.attempt, n)

        coord = Coordinator(commits, owners, rxs, on_commit=on_commit)
    else:
        coord = Coordinator(commits, owners, rxs, history=HistoryStore(store))
    return Fleet(name=name, store=store, coordinator=coord, owners=owners, commits=commits)


def materialize_before(store: FileStore, out: Path, *, version: int, route: str,
                       seed: Path | None) -> int:
    """``materialize`` as it ran before its new checks, from the same pieces: the history
    read whole without a digest, the seed copied whole, one route, no fallback."""
    counted = CountingStore(store)
    hs = HistoryStore(counted)
    history = hs.read()
    held = 0 if seed is not None else None
    if seed is not None:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(seed, out, symlinks=False)
        _check_held(hs, history, out, 0)
    p = plan(history, version, held, route=route)  # type: ignore[arg-type]
    if p.route == "snapshot":
        assert p.snapshot is not None
        fresh = out.with_name(f".{out.name}.snapshot")
        fetch_snapshot(counted, p.snapshot, fresh, hs.fingerprints(history, p.start))
        _replay(hs, history, fresh, p.start, version)
        shutil.rmtree(out, ignore_errors=True)
        fresh.rename(out)
    else:
        _replay(hs, history, out, p.start, version)
    (out / VERSION_FILE).write_text(json.dumps({"version": version}) + "\n")
    return counted.bytes


def catch_up(store: FileStore, digest: str, version: int, seed: Path, work: Path,
             repeat: int) -> dict[str, Any]:
    cases: dict[str, Callable[[Path], int]] = {}
    for route in ("replay", "snapshot"):
        from_seed = seed if route == "replay" else None
        cases[f"{route} after"] = lambda out, r=route, s=from_seed: materialize(
            store, out, version=version, held=0 if s else None, seed=s, digest=digest,
            route=r).fetched_bytes  # type: ignore[arg-type]
        cases[f"{route} before"] = lambda out, r=route, s=from_seed: materialize_before(
            store, out, version=version, route=r, seed=s)
    runs: dict[str, list[float]] = {k: [] for k in cases}
    fetched: dict[str, int] = {}
    for i in range(repeat):
        for name, build in (cases.items() if i % 2 == 0 else reversed(cases.items())):
            out = work / f"{name.replace(' ', '-')}-{i}"
            t0 = time.perf_counter()
            fetched[name] = build(out)
            runs[name].append(time.perf_counter() - t0)
            shutil.rmtree(out)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {route: {"before_s": med[f"{route} before"], "after_s": med[f"{route} after"],
                    "after_over_before": med[f"{route} after"] / med[f"{route} before"],
                    "fetched_bytes": fetched[f"{route} after"],
                    "runs_before_s": runs[f"{route} before"],
                    "runs_after_s": runs[f"{route} after"]}
            for route in ("replay", "snapshot")}


def summary(fleets: dict[str, Fleet], kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, f in fleets.items():
        rows = [r for r in f.rows if r["kind"] == kind]
        out[name] = {"refits": len(rows),
                     "total_s": statistics.median(r["total_s"] for r in rows),
                     "prepare_to_commit_s": statistics.median(
                         sum(r["stages"][s] for s in STAGES[:4]) for r in rows),
                     **{f"{s}_s": statistics.median(r["stages"][s] for r in rows)
                        for s in STAGES}}
    a, b = out["after"], out["before"]
    out["after_over_before"] = {k: a[k] / b[k] for k in a if k != "refits" and b[k] > 0}
    return out


def run(work: Path, versions: int, repeat: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    # The main job's model and optimizer; no warmup and two sequences a step, so the
    # checkpoints take seconds on a busy machine (an AdamW step moves as many bits).
    trainer = Trainer(TrainerSettings(warmup_steps=0, batch=2))
    ckpts = work / "checkpoints"
    trainer.export(ckpts / "v0")
    for v in range(1, versions + 1):
        trainer.step()
        trainer.export(ckpts / f"v{v}")
    print(f"{versions + 1} checkpoints in {time.perf_counter() - t0:.0f} s", flush=True)
    opened = {v: Checkpoint(ckpts / f"v{v}") for v in range(versions + 1)}
    dense = sum(i.nbytes for i in opened[0])
    fleets = {n: fleet(n, ckpts, work / n, opened[0]) for n in ("before", "after")}
    try:
        for v in range(1, versions + 1):
            kind = "adopts a snapshot" if v % 2 == 0 else "plain"
            order = list(fleets.values()) if v % 2 else list(fleets.values())[::-1]
            for f in order:
                f.refit(v, opened[v], kind)
                if v % 2:  # the training side's snapshot; the next commit adopts it
                    write_snapshot(f.store, ckpts / f"v{v}", v)
            print(f"v{v} ({kind}): " + ", ".join(
                f"{f.name} {f.rows[-1]['total_s']:.2f} s" for f in fleets.values()), flush=True)
        after = fleets["after"]
        record = after.commits.read()
        catch = catch_up(after.store, record.history_digest, versions, ckpts / "v0",
                         work / "catch-up", repeat)
        ratios = {k: round(v["after_over_before"], 3) for k, v in catch.items()}
        print(f"catch-up, after / before: {ratios}", flush=True)
        for i in range(repeat):
            v = versions + 1 + i
            for f in (fleets.values() if i % 2 else list(fleets.values())[::-1]):
                f.refit(v, opened[versions], "no change")
        snaps = HistoryStore(after.store, record.history_digest).read().snapshots
    finally:
        for f in fleets.values():
            f.coordinator.close()
        for c in opened.values():
            c.close()
    return {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "machine": platform.machine()},
        "command": f"bench/store_checks.py --versions {versions} --repeat {repeat}",
        "model": {"parameters": trainer.parameters, "dense_bytes": dense,
                  "receivers": list(PODS), "owners": 2},
        "snapshots_adopted_after": [s.version for s in snaps],
        "refit": {kind: summary(fleets, kind)
                  for kind in ("plain", "adopts a snapshot", "no change")},
        "catch_up": catch,
        "refits": {n: f.rows for n, f in fleets.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=6, help="AdamW steps refitted (even)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-store-checks-"))
    try:
        result = run(work, args.versions, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["refit"], indent=1))


if __name__ == "__main__":
    main()
