"""The coordinator: attempts until commit (DESIGN section 6), over abstract parties.

One transition ``v -> v+1``: a mixed first attempt; on any failure after admission the
attempt is marked obsolete, every receiver stops and waits until none of its writes can
still happen, and the next attempt runs in overwrite mode (absolute values repair any
mix of old and new bits). A success is a compare-and-set of the commit record from the
record the coordinator started from; only then do owners advance their baselines and
gates reopen. An unknown outcome is resolved by reading the record; a conflict (someone
else moved it) ends the refit without touching baselines.

Receivers and owners are seams (``ReceiverHandle``, ``OwnerHandle``): in process for
the embedded demo and tests; the agent's HTTP API and the encoder Job implement the
same calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dcr.errors import DcrError
from dcr.format.payload import Mode
from dcr.protocol.commitstore import CommitStore
from dcr.protocol.records import Attempt, CommitOutcome, CommitRecord, Transition

log = logging.getLogger(__name__)


class CommitConflict(DcrError):
    """The commit record moved under the coordinator: another refit committed first."""


class RefitFailed(DcrError):
    """Every allowed attempt failed; the last failure is the cause."""


class ReceiverHandle(Protocol):
    name: str

    def prepare(self, attempt: Attempt) -> None: ...

    def close_gate(self) -> None: ...

    def apply(self, attempt: Attempt) -> None:
        """open_apply and flush: apply every payload of the attempt, then acknowledge."""
        ...

    def stop_and_wait(self, attempt: Attempt) -> None:
        """Mark obsolete; return only when none of its writes can still happen."""
        ...

    def open_gate(self) -> None: ...


class OwnerHandle(Protocol):
    def publish(self, attempt: Attempt) -> None:
        """Encode the candidate against the baseline and send the attempt's payloads."""
        ...

    def advance_baseline(self, record: CommitRecord) -> None: ...


@dataclass(frozen=True, kw_only=True)
class AttemptResult:
    attempt: str
    mode: Mode
    outcome: str  # "committed", or the failure that made it obsolete
    seconds: float


class Coordinator:
    def __init__(self, commits: CommitStore, owners: Sequence[OwnerHandle],
                 receivers: Sequence[ReceiverHandle], *, max_attempts: int = 4,
                 attempt_timeout_s: float = 600.0) -> None:
        self.commits = commits
        self.owners = owners
        self.receivers = receivers
        self.max_attempts = max_attempts
        self.attempt_timeout_s = attempt_timeout_s
        self.history: list[AttemptResult] = []

    def refit(self, target_version: int, baseline_id: str) -> CommitRecord:
        start = self.commits.read()
        new_base = start.committed_version
        if new_base >= target_version:
            raise CommitConflict(
                f"The commit record already names version {new_base}; cannot refit to "
                f"{target_version}."
            )
        transition = Transition(base_version=new_base, target_version=target_version)
        mode: Mode = "mixed"
        last: Exception | None = None
        for _ in range(self.max_attempts):
            attempt = Attempt(transition=transition, mode=mode,
                              receivers=tuple(r.name for r in self.receivers),
                              deadline=time.time() + self.attempt_timeout_s)
            t0 = time.perf_counter()
            try:
                record = self._run(attempt, start, baseline_id)
            except CommitConflict:
                raise
            except Exception as e:  # any failure after admission: retry by overwrite
                last = e
                log.warning("attempt %s (%s) failed: %s", attempt.id, mode, e)
                self._abandon(attempt)
                self.history.append(AttemptResult(attempt=attempt.id, mode=mode,
                                                  outcome=f"failed: {e}",
                                                  seconds=time.perf_counter() - t0))
                mode = "overwrite"
                continue
            self.history.append(AttemptResult(attempt=attempt.id, mode=mode,
                                              outcome="committed",
                                              seconds=time.perf_counter() - t0))
            return record
        raise RefitFailed(
            f"Refit to version {target_version} failed {self.max_attempts} attempts; "
            f"last: {last}"
        ) from last

    def _run(self, attempt: Attempt, start: CommitRecord, baseline_id: str) -> CommitRecord:
        log.info("attempt %s: %s -> %s (%s)", attempt.id, attempt.transition.base_version,
                 attempt.transition.target_version, attempt.mode)
        for r in self.receivers:
            r.prepare(attempt)
        for o in self.owners:
            o.publish(attempt)
        for r in self.receivers:
            r.close_gate()
        for r in self.receivers:
            r.apply(attempt)
        if attempt.expired:
            raise DcrError(f"Attempt {attempt.id} passed its deadline before commit.")
        new = CommitRecord(committed_version=attempt.transition.target_version,
                           baseline_id=baseline_id, attempt=attempt.id)
        outcome = self.commits.compare_and_set(start, new)
        if outcome is CommitOutcome.UNKNOWN:
            seen = self.commits.read()
            outcome = CommitOutcome.SUCCESS if seen == new else (
                CommitOutcome.CONFLICT if seen != start else CommitOutcome.FAILED)
        if outcome is CommitOutcome.CONFLICT:
            raise CommitConflict(
                f"Attempt {attempt.id}: the commit record is no longer {start}; another "
                "refit committed. Baselines stay where they are."
            )
        if outcome is not CommitOutcome.SUCCESS:
            raise DcrError(f"Attempt {attempt.id}: the commit was refused ({outcome.value}).")
        for o in self.owners:  # only now, with the record naming the new version
            o.advance_baseline(new)
        for r in self.receivers:
            r.open_gate()
        return new

    def _abandon(self, attempt: Attempt) -> None:
        for r in self.receivers:
            try:
                r.stop_and_wait(attempt)
            except Exception as e:  # a dead receiver rejoins later, by a dense refit
                log.warning("receiver %s did not stop cleanly: %s", r.name, e)
