"""``dcr materialize``: a committed version's checkpoint, built from the store alone.

From a checkpoint held at a version the history vouches for (checked by fingerprints),
or from a snapshot at or below the target, then the committed deltas in order through the
file-level patch path (base fingerprints checked before each step, targets after). The
route that fetches fewest bytes goes first, and the next when one is refused (a snapshot
that does not hold what the history vouches for, a payload gone). A snapshot is fetched
and advanced beside the output and takes its place only when whole; a replay patches the
held copy in place, file by file, so a refused step leaves every file whole at one
version or the next (the next route then starts from a snapshot).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dcr.checkpoint import Checkpoint
from dcr.errors import CheckpointError, ManifestError, ObjectNotFound
from dcr.files.history import HistoryStore
from dcr.files.patch import patch_chain
from dcr.files.prints import held_prints
from dcr.files.snapshot import differing, fetch_snapshot
from dcr.files.vouched import copy_vouched
from dcr.format.history import History, Snapshot
from dcr.format.manifest import DEFAULT_MANIFEST_LIMITS, ManifestLimits
from dcr.transport.store import Store

log = logging.getLogger(__name__)
VERSION_FILE = ".dcr-version"  # in a built checkpoint: what it holds (snapshots skip it)

Route = Literal["held", "replay", "snapshot"]


class CountingStore:
    """A store that counts the bytes read through it: what crossed the boundary."""

    def __init__(self, store: Store) -> None:
        self.inner, self.uri, self.bytes, self.gets = store, store.uri, 0, 0

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.bytes += len(data)
        self.gets += 1
        return data

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)


@dataclass(frozen=True, kw_only=True)
class Plan:
    target: int
    route: Route
    snapshot: Snapshot | None  # the one fetched (route "snapshot")
    start: int  # the version the chain starts from
    steps: int  # committed deltas applied
    fetch_bytes: int  # snapshot plus payloads, as the history lists them


@dataclass(frozen=True, kw_only=True)
class Materialized:
    plan: Plan  # the route that built it
    fetched_bytes: int  # every byte read from the store, history and manifests included
    path: Path
    refused: tuple[str, ...] = ()  # the cheaper routes tried first, each with its refusal


REFUSALS = (ManifestError, CheckpointError, ObjectNotFound)  # a route's, not the store's


def routes(history: History, target: int, held: int | None, *,
           route: Route | None = None) -> list[Plan]:
    """Every way to ``target``, cheapest first: replay from ``held`` (a version already on
    disk), and each snapshot at or below ``target`` the history still holds a chain from
    (``route`` keeps one kind, for measurements). A snapshot's size is what the history
    declares; a route that turns out not to build is refused and the next one taken."""
    if held is not None and held > target:
        raise ManifestError(f"The checkpoint holds version {held}, past the target {target}.")
    options = []
    if held is not None:
        steps = history.chain(held, target)
        options.append(Plan(target=target, route="held" if held == target else "replay",
                            snapshot=None, start=held, steps=len(steps),
                            fetch_bytes=sum(c.payload_bytes for c in steps)))
    for s in (s for s in history.snapshots if s.version <= target):
        try:
            steps = history.chain(s.version, target)
        except ManifestError:
            continue  # older than the deltas kept
        options.append(Plan(target=target, route="snapshot", snapshot=s, start=s.version,
                            steps=len(steps),
                            fetch_bytes=s.bytes + sum(c.payload_bytes for c in steps)))
    options = [p for p in options if route is None or p.route == route]
    if not options:
        raise ManifestError(f"No way to version {target} from the store: no snapshot at or "
                            f"below it and no checkpoint held ({history.span()}, snapshots "
                            f"{[s.version for s in history.snapshots]}).")
    return sorted(options, key=lambda p: (p.fetch_bytes, -p.start))


def plan(history: History, target: int, held: int | None, *,
         route: Route | None = None) -> Plan:
    """The cheapest of :func:`routes`, the one :func:`materialize` tries first."""
    return routes(history, target, held, route=route)[0]


def materialize(store: Store, out: Path, *, version: int | None = None,
                held: int | None = None, seed: Path | None = None, digest: str | None = None,
                route: Route | None = None, limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS,
                progress: Callable[[int], None] | None = None) -> Materialized:
    """Bring ``out`` to ``version`` (default: the newest committed). ``held``: ``out``
    already holds that version, which is checked against the history's fingerprints
    before anything is fetched; with ``seed`` (a checkpoint of version ``held`` the pod
    has, such as the run's public starting model, or of the version it records, such as
    a mirror's generation), ``out`` is first copied from it unless an earlier run left
    its version recorded there. Only tensor files and the seed's allow-listed files are
    copied (:mod:`dcr.files.vouched`). ``digest``: the history object's, if the caller
    knows it; ``limits``: what the manifests it reads may cost (a receiver's
    :func:`~dcr.format.manifest.limits_for`). The cheapest route is tried first, and a
    refused one gives way to the next (:attr:`Materialized.refused`). Records the version
    in ``out`` (:data:`VERSION_FILE`)."""
    counted = CountingStore(store)
    hs = HistoryStore(counted, digest, limits=limits)
    history = hs.read()
    target = history.committed if version is None else version
    recorded = recorded_version(out)
    if recorded is not None and recorded <= target:
        held = recorded  # a restarted init container, or the agent's own copy
    elif seed is not None:
        seed = seed.resolve()  # a mirror's current generation, pinned for the whole copy
        held = recorded_version(seed) if held is None else held
        if held is None:
            raise CheckpointError(f"The seed {seed} needs the version it holds (--held); "
                                  f"it records none ({VERSION_FILE}).")
        shutil.rmtree(out, ignore_errors=True)
        copy_vouched(seed, out)
    if held is not None and history.versions and not history.vouches(held):
        log.info("materialize %s: the history no longer vouches for version %s (it holds "
                 "%s, retention pruned the rest): the held copy is not used", out, held,
                 history.span())
        held = None  # nothing checks it: a snapshot starts the build
    if held is not None and not (held == 0 == target and not history.versions):
        _check_held(hs, history, out, held)  # (nothing vouches for a start with no commit)
    refused: list[str] = []
    for p in routes(history, target, held, route=route):
        log.info("materialize %s: version %s by %s from %s (%d deltas, %d bytes)", out,
                 target, p.route, p.start, p.steps, p.fetch_bytes)
        try:
            _build(hs, history, p, out, seed, progress)
        except REFUSALS as e:
            refused.append(f"{p.route} from version {p.start}: {e}")
            log.warning("materialize %s: the %s route from version %s was refused (%s); "
                        "trying the next", out, p.route, p.start, e)
            continue
        (out / VERSION_FILE).write_text(json.dumps({"version": target}) + "\n")
        return Materialized(plan=p, fetched_bytes=counted.bytes, path=out,
                            refused=tuple(refused))
    raise ManifestError(f"No route to version {target} could be built from the store; "
                        f"each was refused: {'; '.join(refused)}")


def _build(hs: HistoryStore, history: History, p: Plan, out: Path, seed: Path | None,
           progress: Callable[[int], None] | None) -> None:
    if p.route != "snapshot":
        _replay(hs, history, out, p.start, p.target)
        return
    assert p.snapshot is not None
    expect = hs.fingerprints(history, p.snapshot.version)
    fresh = out.with_name(f".{out.name}.snapshot")  # whole before it takes out's place
    shutil.rmtree(fresh, ignore_errors=True)  # a leftover of a killed run
    fetch_snapshot(hs.store, p.snapshot, fresh, expect, progress=progress)
    try:
        _replay(hs, history, fresh, p.start, p.target)
        carry = seed if seed is not None else out if out.is_dir() else None
        if carry is not None:  # configs and tokenizer: only ever from the pod's own side
            copy_vouched(carry, fresh, tensors=False)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    take_place(fresh, out)


def take_place(fresh: Path, out: Path) -> None:
    """The whole directory ``fresh`` becomes ``out`` (the old one moved aside first and
    removed after, so ``out`` is never a mix of both)."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    fresh.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def recorded_version(checkpoint: Path) -> int | None:
    """The version :func:`materialize` recorded in ``checkpoint``, if it did."""
    try:
        return int(json.loads((checkpoint / VERSION_FILE).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_held(hs: HistoryStore, history: History, out: Path, held: int) -> None:
    expect = hs.fingerprints(history, held)
    try:
        with Checkpoint(out) as ckpt:
            have = held_prints(ckpt, expect)  # sums where the owners were ranks
    except CheckpointError as e:
        raise CheckpointError(f"{out} should hold version {held}: {e}") from e
    differ = differing(have, expect)
    if differ:
        raise ManifestError(f"{out} does not hold version {held}: {len(differ)} tensors "
                            f"differ from the fingerprints the history vouches for, first "
                            f"{differ[:3]}. Nothing was fetched or changed.")


def _replay(hs: HistoryStore, history: History, root: Path, start: int, target: int) -> None:
    """Patch ``root`` from ``start`` to ``target`` by the committed deltas in one pass
    (base fingerprints checked first, each step's targets after it). Its recorded version
    goes first: a replay that fails midway leaves none, so the next run starts over."""
    steps = history.chain(start, target)
    if steps:
        (root / VERSION_FILE).unlink(missing_ok=True)
        # Its start was just checked: the held copy by _check_held, a snapshot on fetching.
        patch_chain(root, hs.store, [hs.manifest(entry) for entry in steps], base_checked=True)
