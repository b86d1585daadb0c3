"""Receiving an attempt while it is still being sent: fetch, verify, stage, in order.

A bounded window of payloads is fetched from the source and verified as it lands; ``stage``
gets each verified :class:`~dcr.format.payload.Payload` in its owner's ``seq`` order, and the
call returns the manifest once exactly the payloads it lists are staged; owners outside the
attempt are never fetched. ``release="when_listed"`` (the agent's) stages a payload only once
its owner's manifest part lists it (docs/protocol.md, "The life of an attempt");
``"on_arrival"`` stages at once and compares at the end, when a foreign payload may already
have been applied.

A receiver waiting for its owners learns nothing new from most of its requests, and a fleet
of them asks one bucket: an idle receiver's waits grow geometrically (jittered, capped at
how late it may notice an arrival), misses on manifest keys back off the same way, and both
start over when something new appears or when the caller says the owners have published
(``wake``; the agent learns it from the coordinator's next call). docs/evaluation-scale.md,
"Waiting for owners", counts the requests.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from dcr.errors import Interrupted, ManifestError, ObjectNotFound
from dcr.format.layout import (
    attempt_prefix,
    manifest_key,
    owner_manifest_key,
    parse_payload_key,
    payload_key,
    version_prefix,
)
from dcr.format.manifest import (
    DEFAULT_MANIFEST_LIMITS,
    Manifest,
    ManifestLimits,
    PayloadEntry,
    merge_manifests,
)
from dcr.format.names import object_digest
from dcr.format.payload import Payload, read_payload
from dcr.settings import GiB, backoff_s
from dcr.transport.store import Store

log = logging.getLogger(__name__)

PayloadId = tuple[int, int]  # (owner, seq)
Release = Literal["when_listed", "on_arrival"]


class ReceiveStopped(Interrupted):
    """The receiver was told to stop (its attempt became obsolete)."""


class ForeignPayload(ManifestError):
    """An object under the attempt's prefix is not what its owner wrote: its bytes differ
    from the manifest's size and digest for it, or its header names other ids than its
    key. Someone else can write the store; nothing of the object was staged."""


class Source(Protocol):
    def available(self) -> list[PayloadId]:
        """Ids of the attempt's payloads that can be fetched now."""
        ...

    def fetch(self, pid: PayloadId) -> bytes: ...

    def manifest(self) -> Manifest | None:
        """The attempt's manifest, or None while it has not been written."""
        ...


@runtime_checkable
class WaitingSource(Source, Protocol):
    """A source that can wait for its listing to change (a relay node's long poll), so an
    idle receiver asks once instead of polling every ``poll_s``."""

    def wait_for_change(self, timeout_s: float) -> None:
        """Return once what ``available`` or ``manifest`` would answer may have changed,
        or after ``timeout_s``."""
        ...


@runtime_checkable
class PartSource(Source, Protocol):
    """A source that serves each owner's manifest part on its own, so one owner's payloads
    can be staged while the others still stream (``"when_listed"``)."""

    def manifest_part(self, owner: int) -> Manifest | None:
        """Owner ``owner``'s part of the attempt's manifest, or None while not written."""
        ...


def whole_manifest(source: PartSource, owners: int, where: str) -> Manifest | None:
    """Every owner's part of ``source`` merged (one owner's part as it is), or None while
    one is missing; ``where`` names the attempt in errors."""
    parts = []
    for owner in range(owners):
        part = source.manifest_part(owner)
        if part is None:
            return None
        parts.append(part)
    return parts[0] if owners == 1 else merge_manifests(parts, where)


class Clock(Protocol):
    """What the receive loop reads of time: a seam, so a test can wait for hours at once."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def sleep(self, seconds: float, wake: threading.Event | None) -> None:
        """Wait ``seconds``, or until ``wake`` is set."""
        ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float, wake: threading.Event | None) -> None:
        if wake is None:
            time.sleep(seconds)
        else:
            wake.wait(seconds)


REAL_CLOCK = RealClock()


@runtime_checkable
class ExpectingSource(Source, Protocol):
    """A source that can be told its owners have published, so that it asks for every
    manifest part at once instead of waiting for its next scheduled look."""

    def expect_manifest(self) -> None: ...


@dataclass(kw_only=True)
class _Listing:
    """What a :class:`StoreSource` learnt from its store: the keys its last LIST showed
    (None before the first), and when each manifest key no LIST showed may next be asked
    for: ``probe_s`` after the listing last changed, then twice as long after each miss, up
    to ``probe_max_s``."""

    keys: frozenset[str] | None = None
    since: float | None = None  # when the listing last showed something new
    due: dict[str, float] = field(default_factory=dict)  # key -> when it may be asked unlisted
    misses: dict[str, int] = field(default_factory=dict)  # key -> unlisted asks since `since`
    lock: threading.Lock = field(default_factory=threading.Lock)

    def shows(self, key: str, now: float, probe_s: float, probe_max_s: float) -> bool:
        """Whether to GET ``key``: a LIST showed it, no LIST happened yet, or it is due
        (a LIST that lags must not stall forever, nor a miss be asked for every poll)."""
        with self.lock:
            if self.keys is None or key in self.keys:
                return True
            since = now if self.since is None else self.since
            if now < self.due.get(key, since + probe_s):
                return False
            n = self.misses.get(key, 0)
            self.misses[key] = n + 1
            self.due[key] = now + min(probe_max_s, probe_s * 2.0**n)
            return True

    def listed(self, keys: frozenset[str], now: float) -> None:
        """A LIST showed ``keys``: if any is new, unlisted keys are due ``probe_s`` on."""
        with self.lock:
            if self.since is None or not keys <= (self.keys or frozenset()):
                self.since, self.due, self.misses = now, {}, {}
            self.keys = keys

    def expect(self) -> None:
        """Every manifest key is due now (its owners have published)."""
        with self.lock:
            self.since, self.misses = float("-inf"), {}
            self.due = {}


@dataclass(frozen=True, kw_only=True)
class StoreSource:
    """An attempt's objects in a store, at the keys :mod:`dcr.format.layout` gives.

    Protocol owners write their manifest parts under the attempt; the manifest is
    present once every owner wrote its part. A single owner's manifest may also be the
    file-level one at the version (``dcr diff``), if it names this attempt.

    Over a WAN every request costs a round trip, so one LIST per poll decides what to
    GET: a manifest key is fetched once a LIST shows it, not asked for (and missed) on
    every idle poll. A single owner's LIST covers the whole version, so that it shows
    the file-level manifest too; a version holds few attempts, so this stays one page.
    What is fetched is verified exactly as before; LIST only decides when.

    S3 lists strongly (read-after-write for LIST too: AWS since December 2020; MinIO,
    ``rclone serve s3`` over a directory, and the file and memory stores always did).
    A store whose LIST lags behind its writes must still not stall a refit: a manifest
    key no LIST has shown is fetched anyway, ``probe_s`` after the listing last changed,
    then ever less often (twice the wait after each miss, at most ``probe_max_s``), and at
    once after :meth:`expect_manifest`.
    """

    store: Store
    version: int
    attempt: str
    owners: int = 1
    probe_s: float = 2.0  # seconds to the first GET of a manifest key no LIST has shown
    probe_max_s: float = 60.0  # cap of the doubling wait between such GETs (each a miss)
    clock: Clock = REAL_CLOCK  # a test's fake clock, shared with receive()
    limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS  # the receiver's (limits_for)
    _seen: _Listing = field(default_factory=_Listing, init=False, repr=False, compare=False)

    @property
    def _prefix(self) -> str:
        return attempt_prefix(self.version, self.attempt)

    @property
    def _list_prefix(self) -> str:
        return self._prefix if self.owners > 1 else f"{version_prefix(self.version)}/"

    def available(self) -> list[PayloadId]:
        keys = self.store.list(self._list_prefix)
        out = []
        for key in keys:
            k = parse_payload_key(key)
            if k is not None and (k.version, k.attempt) == (self.version, self.attempt):
                out.append((k.owner, k.seq))
        self._seen.listed(frozenset(keys), self.clock.now())
        return out

    def expect_manifest(self) -> None:
        self._seen.expect()

    def fetch(self, pid: PayloadId) -> bytes:
        return self.store.get(payload_key(self.version, self.attempt, *pid))

    def manifest(self) -> Manifest | None:
        return whole_manifest(self, self.owners, f"{self.store.uri}/{self._prefix}")

    def manifest_part(self, owner: int) -> Manifest | None:
        m = self._part(owner_manifest_key(self.version, self.attempt, owner))
        if m is None and self.owners == 1:  # a single owner's file-level version manifest
            m = self._part(manifest_key(self.version))
        return m if m is not None and m.attempt == self.attempt else None

    def _part(self, key: str) -> Manifest | None:
        if not self._seen.shows(key, self.clock.now(), self.probe_s, self.probe_max_s):
            return None
        try:
            return Manifest.parse(self.store.get(key), f"{self.store.uri}/{key}", self.limits)
        except ObjectNotFound:
            return None


@dataclass(kw_only=True)
class _Parts:
    """The manifest parts read so far, and what each lists, by owner. A source without
    parts of its own (:class:`PartSource`) gives them all at once, in its whole manifest."""

    source: Source
    attempt: str
    owners: int
    got: dict[int, Manifest] = field(default_factory=dict)
    listed: dict[int, dict[int, PayloadEntry]] = field(default_factory=dict)  # owner -> seq

    def poll(self) -> None:
        missing = [o for o in range(self.owners) if o not in self.got]
        if not missing:
            return
        if not isinstance(self.source, PartSource):
            whole = self.source.manifest()
            if whole is not None:
                for owner in missing:
                    self.got[owner] = whole
                    self.listed[owner] = {e.seq: e for e in whole.payloads if e.owner == owner}
            return
        for owner in missing:
            part = self.source.manifest_part(owner)
            if part is None:
                continue
            if any(e.owner != owner for e in part.payloads):
                raise ForeignPayload(f"Attempt {self.attempt}: owner {owner}'s manifest part "
                                     "lists payloads of another owner.")
            self.got[owner] = part
            self.listed[owner] = {e.seq: e for e in part.payloads}

    @property
    def complete(self) -> bool:
        return len(self.got) == self.owners

    def manifest(self) -> Manifest:
        parts = [self.got[o] for o in range(self.owners)]
        if self.owners == 1 or not isinstance(self.source, PartSource):
            return parts[0]
        return merge_manifests(parts, f"attempt {self.attempt}")


@dataclass(kw_only=True)
class _Idle:
    """An idle receiver's next wait: ``first_s``, doubling per quiet poll up to ``max_s``,
    jittered; ``news`` starts over."""

    first_s: float
    max_s: float
    steps: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def news(self) -> None:
        self.steps = 0

    def next_s(self) -> float:
        self.steps += 1
        return backoff_s(self.first_s, self.max_s, self.steps - 1, self.rng.random())


def receive(
    source: Source,
    attempt: str,
    stage: Callable[[Payload], None],
    *,
    owners: int = 1,
    release: Release = "on_arrival",
    hold_bytes: int = GiB,
    window: int = 4,
    poll_s: float = 0.05,
    max_poll_s: float = 4.0,
    idle_wait_s: float = 0.25,
    timeout_s: float = 600.0,
    stop: threading.Event | None = None,
    wake: threading.Event | None = None,
    clock: Clock = REAL_CLOCK,
) -> Manifest:
    """Stage every payload of ``attempt`` as ``release`` allows; return the manifest.

    ``stage`` is called with each verified payload, in order (see the module docstring).
    ``window`` bounds the payloads being fetched; ``hold_bytes`` those fetched but not yet
    staged (each owner's next payload is fetched regardless, so order can always make
    progress); ``stage`` may block to push back further. With nothing in flight, the loop
    waits before asking again: ``poll_s`` at first, twice as long after each poll that
    learnt nothing, up to ``max_poll_s``, each wait jittered down by up to a quarter (so a
    receiver waiting for its owners lists a store about log2(max_poll_s / poll_s) +
    T / max_poll_s times in T seconds, and notices an arrival at most ``max_poll_s`` late);
    from a :class:`WaitingSource`, up to ``idle_wait_s`` for a change. Setting ``wake``
    ends an idle wait: the caller sets it once the owners have published (the loop starts
    its waits over and has an :class:`ExpectingSource` ask for the manifest at once) and
    when it sets ``stop``, which is otherwise seen within one wait. Raises :class:`ManifestError`
    if the manifest disagrees with what arrived (:class:`ForeignPayload` if an object is
    not what its owner wrote), or if ``timeout_s`` passes first, and
    :class:`ReceiveStopped` once ``stop`` is set (between payloads: a ``stage`` call in
    progress always finishes).
    """
    deadline = clock.now() + timeout_s
    idle = _Idle(first_s=poll_s, max_s=max(poll_s, max_poll_s))
    listed_only = release == "when_listed"
    parts = _Parts(source=source, attempt=attempt, owners=owners)
    pending: dict[PayloadId, Future[Payload]] = {}
    held: dict[PayloadId, Payload] = {}
    staged: set[PayloadId] = set()
    objects: dict[PayloadId, tuple[int, str]] = {}  # size and object digest of what was staged
    next_seq = dict.fromkeys(range(owners), 0)
    listed_ids: set[PayloadId] = set()  # every id the source has listed so far
    known = (0, 0)  # the listing's size and the parts read, when last compared

    def wanted(pid: PayloadId) -> bool:
        owner, seq = pid
        if owner >= owners or seq < next_seq[owner] or pid in pending or pid in held:
            return False
        listed = parts.listed.get(owner)
        return listed is None or seq in listed or not listed_only

    with ThreadPoolExecutor(window) as pool:
        while True:
            if stop is not None and stop.is_set():
                for f in pending.values():
                    f.cancel()
                raise ReceiveStopped(f"Attempt {attempt}: stopped after {len(staged)} payloads.")
            held_bytes = sum(p.size for p in held.values())
            # Each LIST is a round trip to a remote store: list only when the window has
            # room and nothing listed before is still waiting to be fetched.
            if len(pending) < window and not any(map(wanted, listed_ids)):
                listed_ids.update(source.available())
            for pid in sorted(filter(wanted, listed_ids)):
                if len(pending) >= window:
                    break
                if held_bytes >= hold_bytes and pid != (pid[0], next_seq[pid[0]]):
                    continue
                pending[pid] = pool.submit(_fetch_verified, source, pid, attempt)
            for pid in [p for p, f in pending.items() if f.done()]:
                held[pid] = pending.pop(pid).result()
            progressed = False
            for owner in range(owners):
                vouched = parts.listed.get(owner, {}) if listed_only else None
                while (pid := (owner, next_seq[owner])) in held:
                    if vouched is not None and pid[1] not in vouched:
                        break  # its owner's part has not vouched for it (yet)
                    payload = held.pop(pid)
                    got = (payload.size, object_digest(payload.data))
                    entry = vouched[pid[1]] if vouched is not None else None
                    if entry is not None and got != (entry.size, entry.digest):
                        raise ForeignPayload(_differs(attempt, pid, got, entry, "arrived"))
                    stage(payload)
                    staged.add(pid)
                    objects[pid] = got
                    next_seq[owner] += 1
                    progressed = True
            manifest: Manifest | None = None
            if not pending:
                parts.poll()
                _drop_unlisted(parts, held, listed_only)
                if parts.complete:
                    manifest = parts.manifest()
                    listed = {(e.owner, e.seq) for e in manifest.payloads}
                    if listed <= staged:
                        if staged != listed:
                            raise ManifestError(
                                f"Attempt {attempt}: applied payloads "
                                f"{sorted(staged - listed)} that its manifest does not list."
                            )
                        _check_objects(attempt, manifest, objects)
                        return manifest
            now = clock.now()
            if now >= deadline:
                raise ManifestError(
                    f"Attempt {attempt}: not complete after {timeout_s} s "
                    f"({len(staged)} payloads applied, manifest "
                    f"{'present' if manifest else 'missing'})."
                )
            if progressed or (len(listed_ids), len(parts.got)) != known:
                idle.news()
                known = (len(listed_ids), len(parts.got))
                if progressed:
                    continue
            if pending:  # wake for the first fetch to land, not after a fixed sleep
                wait(pending.values(), timeout=poll_s, return_when=FIRST_COMPLETED)
            elif isinstance(source, WaitingSource):  # wake when something arrives
                source.wait_for_change(max(0.0, min(idle_wait_s, deadline - now)))
            else:
                clock.sleep(max(0.0, min(idle.next_s(), deadline - now)), wake or stop)
            if wake is not None and wake.is_set():  # the owners have published (or a stop)
                wake.clear()
                idle.news()
                if isinstance(source, ExpectingSource):
                    source.expect_manifest()


def _drop_unlisted(parts: _Parts, held: dict[PayloadId, Payload], listed_only: bool) -> None:
    """Forget held objects that their owner's part does not list: never staged."""
    if not listed_only:
        return
    for pid in [p for p in held if p[0] in parts.listed and p[1] not in parts.listed[p[0]]]:
        log.warning("Attempt %s: ignoring payload o%d/s%d, which its owner's manifest part "
                    "does not list.", parts.attempt, *pid)
        del held[pid]


def _differs(attempt: str, pid: PayloadId, got: tuple[int, str], entry: PayloadEntry,
             how: str) -> str:
    return (f"Attempt {attempt}: payload o{pid[0]}/s{pid[1]} {how} as {got[0]} bytes, "
            f"digest {got[1]}; the manifest lists {entry.size} bytes, digest {entry.digest}.")


def _check_objects(attempt: str, manifest: Manifest,
                   objects: dict[PayloadId, tuple[int, str]]) -> None:
    """Every applied object is the one the manifest lists (size and digest), not merely one
    with the same id (an owner that published the same attempt twice, differently)."""
    for e in manifest.payloads:
        got = objects[(e.owner, e.seq)]
        if got != (e.size, e.digest):
            raise ManifestError(_differs(attempt, (e.owner, e.seq), got, e, "applied"))


def _fetch_verified(source: Source, pid: PayloadId, attempt: str) -> Payload:
    payload = read_payload(source.fetch(pid))
    h = payload.header
    if (h.attempt, h.owner, h.seq) != (attempt, *pid):
        raise ForeignPayload(
            f"Payload {pid} of {attempt} says attempt {h.attempt}, owner {h.owner}, "
            f"seq {h.seq}."
        )
    return payload
