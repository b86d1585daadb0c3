"""Transitions, attempts, and the commit record that binds a version to its baseline.

The record ``(committed_version, baseline_id, attempt, history_digest)`` is the one durable
fact of a refit: a version counts as delivered exactly when the record names it, and the
record changes only by compare-and-set (:mod:`dcr.protocol.commitstore`). Its history digest
vouches for the store's history written with the commit (docs/catch-up.md, "The trust
chain"), so whoever may write the store cannot put another history in its place.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dcr.errors import ConfigError
from dcr.format.names import Mode, new_attempt_id


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    committed_version: int
    # The committed version's source checkpoint (a directory or URI): owners rebuild their
    # baseline from it and receivers rejoin by a dense load of it. One meaning everywhere:
    # the main job, the operator (RolloutFleet status.commit.baselineId) and the tests.
    baseline_id: str
    attempt: str  # the attempt that committed it ("" for the initial record)
    # BLAKE2b-128 of the store's history written with this commit: readers given the
    # version are given this too, and refuse any other history ("" where no history is
    # kept: a relay fleet, the initial record, or a record from before it was carried).
    history_digest: str = ""


class CommitOutcome(enum.Enum):
    SUCCESS = "success"  # the record now names the new version
    FAILED = "failed"  # the store refused for a reason other than a race; nothing changed
    UNKNOWN = "unknown"  # no answer: read the record to learn what happened
    CONFLICT = "conflict"  # the record was not what the caller expected


@dataclass(frozen=True, kw_only=True)
class Transition:
    base_version: int
    target_version: int

    def __post_init__(self) -> None:
        if self.target_version <= self.base_version or self.base_version < 0:
            raise ConfigError(
                f"A transition goes forward: {self.base_version} -> {self.target_version}."
            )


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One try at a transition: fresh id, mode, the receivers that must acknowledge."""

    transition: Transition
    mode: Mode
    receivers: tuple[str, ...]
    deadline: float  # time.time() seconds by which flush must have succeeded
    owners: int = 1  # owner processes; receivers wait for every owner's manifest part
    history_digest: str = ""  # the base record's: the history receivers may read
    id: str = field(default_factory=new_attempt_id)

    def __post_init__(self) -> None:
        if not self.receivers:
            raise ConfigError(f"Attempt {self.id} names no required receivers.")
        if self.owners < 1:
            raise ConfigError(f"Attempt {self.id} has {self.owners} owners; at least 1.")
        if len(set(self.receivers)) != len(self.receivers):
            raise ConfigError(f"Attempt {self.id} names a receiver twice: {self.receivers}.")

    @property
    def expired(self) -> bool:
        return time.time() > self.deadline
