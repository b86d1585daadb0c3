"""The coordinator: attempts of one transition ``v -> v+1`` until commit, over abstract parties.

The algorithm is docs/protocol.md ("The life of an attempt", "Admission and rejoin",
"Coordinator failover"). Its invariants: the record moves only by compare-and-set from the
one the refit started from; owners advance, receivers learn the commit and gates reopen only
after that succeeded; after a failure every receiver has stopped before the next attempt,
which runs in overwrite mode, after a wait that grows with each failure (``retry_wait_s``):
a store or link fault that lasts seconds outlasts few attempts, and an abort cuts it short.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar, runtime_checkable

from dcr.errors import ConfigError, DcrError, RefitError, StateConflict
from dcr.format.payload import Mode
from dcr.protocol.agent_api import AgentStatus, FlushAck
from dcr.protocol.commitstore import CommitStore
from dcr.protocol.records import Attempt, CommitOutcome, CommitRecord, Transition
from dcr.protocol.state import FINAL
from dcr.protocol.states import AttemptState
from dcr.settings import backoff_s, option

log = logging.getLogger(__name__)
T = TypeVar("T")
_FINAL = frozenset(s.value for s in FINAL)


class CommitConflict(StateConflict):
    """The commit record moved under the coordinator: another refit committed first."""


class RefitFailed(RefitError):
    """Every allowed attempt failed (or too few receivers could take part)."""


class RefitAborted(RefitError):
    """An operator aborted the refit between attempts."""


class CommitUnknown(RefitError):
    """The commit's outcome could not be learned: nothing is abandoned; ``refit`` again
    reads the record and finishes or continues."""


class ReceiverHandle(Protocol):
    """One receiver as the coordinator drives it; each call answers with its status.

    ``AgentService`` is one in process, ``AgentClient`` over HTTP (both from the table
    in :mod:`dcr.protocol.agent_api`); the operator wraps clients to record progress.
    """

    name: str

    def status(self) -> AgentStatus: ...

    def prepare(self, attempt: Attempt) -> AgentStatus: ...

    def close_gate(self) -> AgentStatus: ...

    def open_apply(self, attempt: Attempt) -> AgentStatus: ...

    def wait_staged(self, attempt: Attempt) -> AgentStatus: ...

    def flush(self, attempt: Attempt) -> FlushAck: ...

    def committed(self, attempt: str, history_digest: str | None = None) -> AgentStatus:
        """The record names ``attempt``; ``history_digest``, the history it vouches for
        (the one later dense loads of the committed version are checked against)."""
        ...

    def stop_and_wait(self, attempt: str) -> AgentStatus:
        """Mark obsolete; return only when none of its writes can still happen."""
        ...

    def open_gate(self) -> AgentStatus: ...

    def rejoin(self, version: int, checkpoint: str | None = None,
               history_digest: str | None = None) -> AgentStatus:
        """Restore ``version`` (between attempts): a dense load of ``checkpoint``, or
        without one, from the store's history (the one ``history_digest`` names, where
        given), checked by its fingerprints."""
        ...


class HistoryWriter(Protocol):
    """The store's history as its one writer keeps it (``dcr.files.history.HistoryStore``):
    the commit record vouches for it by digest."""

    def vouched(self, record: CommitRecord) -> object:
        """Read the history ``record`` vouches for; raise when the store holds no copy of it."""
        ...

    def stage(self, base: CommitRecord, version: int, attempt: str, owners: int) -> str:
        """Store, under its digest, the history that records ``attempt`` committing
        ``version`` after ``base``'s; that digest (the history object is not changed)."""
        ...

    def publish(self, record: CommitRecord, owners: int) -> None:
        """Make the store's history the one ``record`` vouches for (idempotent)."""
        ...


@runtime_checkable
class AttemptCache(Protocol):
    """Where attempts are staged for receivers only until a newer one commits (the relay
    tree: ``dcr.transport.relay.publish.RelayPublisher``). Not a history: nothing reads a
    dropped attempt again."""

    def drop_attempts(self, attempts: Sequence[str]) -> None:
        """Drop each attempt (one not held is no error); raise naming those not dropped."""
        ...


class OwnerHandle(Protocol):
    def publish(self, attempt: Attempt) -> None:
        """Encode the candidate against the baseline and send the attempt's payloads."""
        ...

    def advance_baseline(self, record: CommitRecord) -> None: ...


@dataclass(frozen=True, kw_only=True)
class CoordinatorSettings:
    """How one refit is driven. Torch-free: the operator builds these from a fleet's spec."""

    max_attempts: int = option(4, metavar="N", doc="attempts per transition before "
                               "RefitFailed: the first mixed, the rest overwrite retries, "
                               "which repair any mix of bits; more rarely helps")
    attempt_timeout_s: float = option(600.0, metavar="S", doc="seconds from prepare to "
                                      "commit of one attempt: room for a large model's "
                                      "encode, transfer and apply; a stuck attempt fails then")
    gate: Literal["sync", "async"] = option("sync", doc="sync: close the request gates at "
                                            "the start (synchronous RL); async: after every "
                                            "receiver has staged, so serving pauses only "
                                            "for the apply")
    min_receivers: int = option(1, metavar="N", doc="fewer admitted receivers fail the refit "
                                "before any attempt; one suffices to make progress")
    receiver_calls: int = option(64, metavar="N", doc="calls to receivers in flight at once: "
                                 "a fleet of thousands is driven by this many threads, not a "
                                 "thread each (owners get one each: a publish is long)")
    retry_wait_s: float = option(2.0, metavar="S", doc="seconds from a failed attempt to the "
                                 "next, doubled after each further failure up to "
                                 "retry_wait_max_s, each wait jittered down by up to a "
                                 "quarter: a fault of the store or a link that lasts seconds "
                                 "then outlasts few attempts, not every one; 0 retries at once")
    retry_wait_max_s: float = option(30.0, metavar="S", doc="the longest wait between two "
                                     "attempts: past it, waiting longer mostly delays the "
                                     "repair of a fleet left mixed")

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.min_receivers < 1 or self.attempt_timeout_s <= 0 \
                or self.receiver_calls < 1:
            raise ConfigError(f"Coordinator settings out of range: {self}.")
        if not 0 <= self.retry_wait_s <= self.retry_wait_max_s:
            raise ConfigError(f"retry_wait_s is {self.retry_wait_s} and retry_wait_max_s "
                              f"{self.retry_wait_max_s}: the first must be at least 0 and "
                              "the second at least the first.")

    def retry_wait(self, failures: int, draw: float) -> float:
        """Seconds to wait after ``failures`` failed attempts (1 or more); ``draw`` in
        [0, 1) picks where in the jitter band (the top quarter of the step) it falls."""
        return backoff_s(self.retry_wait_s, self.retry_wait_max_s, failures - 1, draw)


@dataclass(kw_only=True)
class AttemptResult:
    attempt: str
    mode: Mode
    receivers: tuple[str, ...]
    outcome: str = "running"  # "committed", or the failure that made it obsolete
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage
    payload_bytes: int = 0  # bytes each receiver applied, summed over receivers
    rejoined: tuple[str, ...] = ()  # receivers restored by a dense refit at admission
    left_out: tuple[str, ...] = ()  # receivers that could not take part (they rejoin later)
    error: str = ""  # the failure's class name (e.g. "AgentError"): a bounded label for it


class Coordinator:
    def __init__(self, commits: CommitStore, owners: Sequence[OwnerHandle],
                 receivers: Sequence[ReceiverHandle], *,
                 settings: CoordinatorSettings | None = None,
                 dense_checkpoint: Callable[[int], str] | None = None,
                 on_commit: Callable[[CommitRecord, int], None] | None = None,
                 history: HistoryWriter | None = None,
                 cache: AttemptCache | None = None,
                 wait: Callable[[float], bool] | None = None,
                 rng: random.Random | None = None) -> None:
        """``dense_checkpoint(v)`` names a full checkpoint of version ``v`` for rejoins;
        without it a receiver rejoins from its store's history. ``history``: the store's
        history, staged before each commit so the record carries its digest and written
        once receivers are settled. ``cache``: where attempts wait for receivers (the
        relay tree); once a commit is settled, the attempt it replaced and every other
        attempt of the refit are dropped there, best effort. ``on_commit(record, owners)``
        runs after that, once the record names a new version; it must be idempotent, as a
        refit that finishes a committed transition again calls it again. ``wait(s)``
        pauses between attempts and says whether it was cut short (default:
        ``abort.wait``, so an abort, and the operator's deadline, which aborts, end it at
        once); ``rng`` draws the jitter."""
        self.commits = commits
        self.owners = owners
        self.receivers = receivers
        self.settings = settings or CoordinatorSettings()
        self.dense_checkpoint = dense_checkpoint
        self.on_commit = on_commit
        self.writer = history
        self.cache = cache
        self.abort = threading.Event()  # set by an operator: no further attempt starts
        self._wait = wait or self.abort.wait
        self._rng = rng or random.Random()
        self.history: list[AttemptResult] = []
        self._pool = ThreadPoolExecutor(
            max(1, min(self.settings.receiver_calls, len(receivers))),
            thread_name_prefix="coord-receivers")
        self._owner_pool = ThreadPoolExecutor(max(1, len(owners)),
                                              thread_name_prefix="coord-owners")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._owner_pool.shutdown(wait=True)

    def refit(self, target_version: int, baseline_id: str) -> CommitRecord:
        start = self.commits.read()
        if start.committed_version == target_version and start.baseline_id == baseline_id:
            log.info("version %s is already committed (%s): finishing", target_version,
                     start.attempt)
            self._finish(start)
            return start
        if start.committed_version >= target_version:
            raise CommitConflict(
                f"The commit record already names version {start.committed_version} "
                f"({start.baseline_id}); cannot refit to {target_version}."
            )
        if self.writer is not None:  # refused before any gate closes
            self.writer.vouched(start)
        transition = Transition(base_version=start.committed_version,
                                target_version=target_version)
        first = len(self.history)  # this refit's attempts are history[first:]
        mode: Mode = "mixed"
        last: Exception | None = None
        for n in range(self.settings.max_attempts):
            if n and self.settings.retry_wait_s > 0 and not self.abort.is_set():
                self._pause(n, last)
            if self.abort.is_set():
                raise RefitAborted(f"Refit to {target_version} aborted after "
                                   f"{len(self.history)} attempts; last: {last}.")
            live, rejoined, mixed = self._admit(transition, start)
            if mixed:
                mode = "overwrite"
            attempt = Attempt(transition=transition, mode=mode, owners=len(self.owners),
                              history_digest=start.history_digest,
                              receivers=tuple(r.name for r in live),
                              deadline=time.time() + self.settings.attempt_timeout_s)
            left_out = tuple(r.name for r in self.receivers if r.name not in attempt.receivers)
            result = AttemptResult(attempt=attempt.id, mode=mode, receivers=attempt.receivers,
                                   rejoined=rejoined, left_out=left_out)
            self.history.append(result)
            try:
                record = self._run(attempt, live, start, baseline_id, result)
            except CommitUnknown as e:
                result.outcome, result.error = f"unknown: {e}", type(e).__name__
                raise  # receivers stay flushed; the record decides on the next call
            except CommitConflict as e:
                seen = self.commits.read()
                ours = {h.attempt for h in self.history}
                if (seen.committed_version, seen.baseline_id) == (target_version, baseline_id) \
                        and seen.attempt in ours:
                    # An earlier attempt of ours committed after all (its answer was lost):
                    # the transition is done, not conflicted.
                    result.outcome = f"superseded: {seen.attempt} had committed"
                    with _Stages(result.stages)("finish"):
                        self._finish(seen, ours=ours)
                    self._drop_replaced(seen, start, self.history[first:])
                    return seen
                result.outcome, result.error = f"conflict: {e}", type(e).__name__
                raise
            except Exception as e:  # any failure after admission: retry by overwrite
                last = e
                result.outcome, result.error = f"failed: {e}", type(e).__name__
                log.warning("attempt %s (%s) failed: %s", attempt.id, mode, e)
                self._abandon(attempt, live)
                mode = "overwrite"
                continue
            result.outcome = "committed"
            # Outside the retry: the record stands, so a failure from here on (an owner
            # that cannot advance) must not abandon the committed attempt or retry a
            # committed transition. It reaches the caller; ``refit`` again finishes.
            with _Stages(result.stages)("finish"):
                self._finish(record, live)
            self._drop_replaced(record, start, self.history[first:])
            return record
        raise RefitFailed(
            f"Refit to version {target_version} failed {self.settings.max_attempts} "
            f"attempts; last: {last}"
        ) from last

    def _pause(self, failures: int, last: Exception | None) -> None:
        """Wait before the attempt after ``failures`` failed ones; an abort ends it."""
        seconds = self.settings.retry_wait(failures, self._rng.random())
        log.info("%d attempts failed (last: %s); the next starts in %.1f s", failures, last,
                 seconds)
        if self._wait(seconds):
            log.info("the wait before the next attempt was cut short: the refit is aborted")

    # --- admission -----------------------------------------------------------------

    def _admit(self, t: Transition, start: CommitRecord
               ) -> tuple[list[ReceiverHandle], tuple[str, ...], bool]:
        """The receivers that take part, those rejoined, and whether any holds a mix."""
        def check(r: ReceiverHandle) -> tuple[ReceiverHandle, str]:
            st = r.status()
            if st.attempt is not None and st.state not in _FINAL:
                log.info("%s is still in attempt %s (%s): stopping it", r.name, st.attempt,
                         st.state)
                r.stop_and_wait(st.attempt)
                st = r.status()
            if st.dirty is None and st.version == t.base_version:
                return r, "ready"
            if st.dirty == (t.base_version, t.target_version):
                return r, "mixed"
            log.info("%s holds %s (dirty %s, %s): rejoins at %s", r.name, st.version,
                     st.dirty, st.unknown, t.base_version)
            dense = self.dense_checkpoint
            r.rejoin(t.base_version, dense(t.base_version) if dense else None,
                     start.history_digest or None)
            return r, "rejoined"

        live: list[ReceiverHandle] = []
        rejoined: list[str] = []
        mixed = False
        for r, outcome in zip(self.receivers, self._each(check, self.receivers, strict=False),
                              strict=True):
            if isinstance(outcome, Exception):
                log.warning("%s left out of this attempt: %s", r.name, outcome)
                continue
            live.append(r)
            mixed |= outcome[1] == "mixed"
            if outcome[1] == "rejoined":
                rejoined.append(r.name)
        if len(live) < self.settings.min_receivers:
            raise RefitFailed(f"Only {len(live)} receivers can take part in "
                              f"{t.base_version} -> {t.target_version}; at least "
                              f"{self.settings.min_receivers} are required.")
        return live, tuple(rejoined), mixed

    # --- one attempt ---------------------------------------------------------------

    def _run(self, attempt: Attempt, live: list[ReceiverHandle], start: CommitRecord,
             baseline_id: str, result: AttemptResult) -> CommitRecord:
        log.info("attempt %s: %s -> %s (%s) on %s", attempt.id,
                 attempt.transition.base_version, attempt.transition.target_version,
                 attempt.mode, ", ".join(attempt.receivers))
        clock = _Stages(result.stages)
        with clock("prepare"):
            self._each(lambda r: r.prepare(attempt), live)
            if self.settings.gate == "sync":
                self._each(lambda r: r.close_gate(), live)
                self._each(lambda r: r.open_apply(attempt), live)
        with clock("publish"):
            self._each(lambda o: o.publish(attempt), self.owners, pool=self._owner_pool)
        if self.settings.gate == "async":
            with clock("stage"):
                self._each(lambda r: r.wait_staged(attempt), live)
            with clock("gate"):
                self._each(lambda r: r.close_gate(), live)
                self._each(lambda r: r.open_apply(attempt), live)
        with clock("flush"):
            acks = self._each(lambda r: r.flush(attempt), live)
        result.payload_bytes = sum(a.bytes for a in acks)
        if attempt.expired:
            raise DcrError(f"Attempt {attempt.id} passed its deadline before commit.")
        target = attempt.transition.target_version
        with clock("commit"):
            digest = "" if self.writer is None else self.writer.stage(
                start, target, attempt.id, len(self.owners))
            new = CommitRecord(committed_version=target, baseline_id=baseline_id,
                               attempt=attempt.id, history_digest=digest)
            outcome = self.commits.compare_and_set(start, new)
            if outcome is CommitOutcome.UNKNOWN:
                seen = self._read_settled(attempt)
                outcome = CommitOutcome.SUCCESS if seen == new else (
                    CommitOutcome.CONFLICT if seen != start else CommitOutcome.FAILED)
        if outcome is CommitOutcome.CONFLICT:
            raise CommitConflict(
                f"Attempt {attempt.id}: the commit record is no longer {start}; another "
                "refit committed. Baselines stay where they are."
            )
        if outcome is not CommitOutcome.SUCCESS:
            raise DcrError(f"Attempt {attempt.id}: the commit was refused ({outcome.value}).")
        return new

    def _read_settled(self, attempt: Attempt) -> CommitRecord:
        """Read the record after an unknown outcome, retrying a store that does not answer."""
        last: Exception | None = None
        for delay in (0.0, 0.1, 0.3, 1.0, 3.0):
            time.sleep(delay)
            try:
                return self.commits.read()
            except Exception as e:
                last = e
        raise CommitUnknown(f"Attempt {attempt.id}: the commit's outcome is unknown and the "
                            f"record cannot be read ({last}); nothing is abandoned.") from last

    def _finish(self, record: CommitRecord,
                receivers: Sequence[ReceiverHandle] | None = None,
                ours: set[str] | None = None) -> None:
        """After a commit: receivers learn it, gates reopen, owners advance, and only then
        is the store's history written (a failure there raises with every gate settled:
        ``refit`` again writes it).

        Without ``receivers`` (failover, or a commit learned late), each receiver is asked:
        one that flushed the committed attempt, or another attempt of this coordinator
        (``ours``) of the same transition, holds the target's bits and learns the commit.
        """
        settled = {record.attempt} | (ours or set())

        def settle(r: ReceiverHandle) -> None:
            if receivers is None:
                st = r.status()
                flushed = st.state == AttemptState.FLUSHED.value and st.attempt in settled \
                    and st.dirty is not None and st.dirty[1] == record.committed_version
                if flushed and st.attempt is not None:
                    r.committed(st.attempt, record.history_digest or None)
                elif st.version != record.committed_version:
                    return  # rejoins by a dense refit at the next admission
            else:
                r.committed(record.attempt, record.history_digest or None)
            r.open_gate()

        errors = [e for e in self._each(settle, receivers or self.receivers, strict=False)
                  if isinstance(e, Exception)]
        for e in errors:  # the record stands; such a receiver rejoins later
            log.warning("after commit %s: %s", record.attempt, e)
        for o in self.owners:  # only now, with the record naming the new version
            o.advance_baseline(record)
        if record.attempt and self.writer is not None:
            self.writer.publish(record, len(self.owners))
        if record.attempt and self.on_commit is not None:
            self.on_commit(record, len(self.owners))

    def _drop_replaced(self, record: CommitRecord, start: CommitRecord,
                       tried: Sequence[AttemptResult]) -> None:
        """After ``record`` committed and settled: drop from the cache the attempt it
        replaced (``start``'s) and this refit's others (failed or superseded). No receiver
        reads them again: those that flushed ``record`` hold its bits, the rest rejoin from
        a checkpoint or the history, never from the cache. Best effort: the commit stands,
        and a node's own bound (``keep_attempts``) evicts what a failed drop leaves."""
        if self.cache is None:
            return
        older = [start.attempt, *(t.attempt for t in tried)]
        drop = [a for a in dict.fromkeys(older) if a and a != record.attempt]
        if not drop:
            return
        try:
            self.cache.drop_attempts(drop)
        except Exception as e:
            log.warning("after commit %s: could not drop replaced attempts %s: %s",
                        record.attempt, ", ".join(drop), e)
        else:
            log.info("after commit %s: dropped replaced attempts %s", record.attempt,
                     ", ".join(drop))

    def _abandon(self, attempt: Attempt, live: list[ReceiverHandle]) -> None:
        def stop(r: ReceiverHandle) -> None:
            r.stop_and_wait(attempt.id)

        for r, e in zip(live, self._each(stop, live, strict=False), strict=True):
            if isinstance(e, Exception):  # a dead receiver rejoins later, by a dense refit
                log.warning("receiver %s did not stop cleanly: %s", r.name, e)

    def _each(self, fn: Callable[[T], object], parties: Sequence[T], *, strict: bool = True,
              pool: ThreadPoolExecutor | None = None) -> list:  # type: ignore[type-arg]
        """Call ``fn`` on every party concurrently (receivers: ``receiver_calls`` at a
        time); the first error wins when strict."""
        futures = [(pool or self._pool).submit(fn, p) for p in parties]
        out: list[object] = []
        first: Exception | None = None
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:
                out.append(e)
                first = first or e
        if strict and first is not None:
            raise first
        return out


class _Stages:
    """Context managers that add wall seconds per stage into a dict."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into = into

    def __call__(self, name: str) -> _Stage:
        return _Stage(self.into, name)


class _Stage:
    def __init__(self, into: dict[str, float], name: str) -> None:
        self.into, self.name = into, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.into[self.name] = self.into.get(self.name, 0.0) + time.perf_counter() - self.t0
