"""The commit record as a RolloutFleet object holds it, in ``status.commit``.

Reading it from a fleet (:func:`record_of`, the fleet's ``spec.initial`` until a refit
writes one) and writing it as status (:func:`commit_status`) are plain data, needed by the
compare-and-set (:mod:`dcr_operator.commitstore`), by what publishes the record to the
fleet's pods (:mod:`dcr_operator.commitmap`) and by the fleet's status poll
(:mod:`dcr_operator.fleet`); none of them talks to the API server here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dcr.protocol.records import CommitRecord


def initial_record(fleet: Mapping[str, Any]) -> CommitRecord:
    """The record before any refit: the fleet's ``spec.initial``."""
    initial = fleet["spec"]["initial"]
    return CommitRecord(committed_version=int(initial.get("version", 0)),
                        baseline_id=str(initial["checkpoint"]), attempt="")


def record_of(fleet: Mapping[str, Any]) -> CommitRecord:
    """The commit record a fleet object holds (the initial one if none was written yet)."""
    commit = (fleet.get("status") or {}).get("commit")
    if not commit:
        return initial_record(fleet)
    return CommitRecord(committed_version=int(commit["committedVersion"]),
                        baseline_id=str(commit["baselineId"]), attempt=str(commit["attempt"]),
                        history_digest=str(commit.get("historyDigest") or ""))


def commit_status(record: CommitRecord, *, refit: str | None = None,
                  at: str | None = None) -> dict[str, Any]:
    """``status.commit`` holding ``record`` (and the WeightRefit that wrote it, and when)."""
    out: dict[str, Any] = {"committedVersion": record.committed_version,
                           "baselineId": record.baseline_id, "attempt": record.attempt}
    if record.history_digest:
        out["historyDigest"] = record.history_digest
    if refit is not None:
        out["refit"] = refit
    if at is not None:
        out["committedAt"] = at
    return out
