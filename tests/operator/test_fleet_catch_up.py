"""Which agents the fleet poll brings to the committed version between refits.

A replaced or added rollout pod starts from the fleet's initial checkpoint; without a
refit running, the poll rejoins it by a dense load of the committed checkpoint (as a
refit's admission would), so it never serves older weights until the next refit. The
deploy tier (tests/deploy) shows it on a real node; these pin the rule.
"""

from __future__ import annotations

from typing import Any

import pytest

from dcr.protocol.agent_api import AgentStatus
from dcr.protocol.records import CommitRecord
from dcr_operator.fleet import _report, behind, serving_versions
from dcr_operator.reconcile import Receiver

RECORD = CommitRecord(committed_version=2, baseline_id="/checkpoints/policy-a/v2",
                      attempt="a-0123456789ab")


def _status(**over: Any) -> AgentStatus:
    fields: dict[str, Any] = {
        "name": "rollout-0", "version": 2, "dirty": None, "unknown": None, "attempt": None,
        "state": None, "error": None, "gate_open": True, "payloads_staged": 0,
        "payloads_applied": 0, "bytes_staged": 0}
    return AgentStatus(**{**fields, **over})


@pytest.mark.parametrize(("status", "expected"), [
    ({}, False),  # at the committed version: nothing to do
    ({"version": 0}, True),  # a replacement pod, started from the initial checkpoint
    ({"version": 3}, True),  # ahead of the record (a commit that did not land): back
    ({"version": None, "unknown": "restarted mid-attempt"}, True),
    ({"dirty": (2, 3)}, True),  # partly written
    ({"version": 2, "attempt": "a-1111111111ab", "state": "committed"}, False),
    ({"version": 1, "attempt": "a-1111111111ab", "state": "obsolete"}, True),
    # Inside an attempt the refit's coordinator owns the agent: never touched here.
    ({"version": 1, "attempt": "a-1111111111ab", "state": "applying"}, False),
    ({"version": 1, "attempt": "a-1111111111ab", "state": "prepared"}, False),
])
def test_an_idle_agent_off_the_committed_bits_is_behind(status: dict[str, Any],
                                                        expected: bool) -> None:
    assert behind(_status(**status), RECORD) is expected


def test_the_fleet_status_counts_the_versions_its_receivers_serve_newest_first() -> None:
    reports = [{"name": "r0", "version": 3}, {"name": "r1", "version": 2},
               {"name": "r2", "version": 3}, {"name": "r3", "error": "no answer"},
               {"name": "r4", "version": 1, "error": "timed out"}, {"name": "r5"}]
    assert serving_versions(reports) == [{"version": 3, "receivers": 2},
                                         {"version": 2, "receivers": 1}]


class _Agent:
    """An agent client that records the dense loads it is asked for."""

    name, release = "rollout-0", "0.1.0"

    def __init__(self) -> None:
        self.rejoins: list[tuple[Any, ...]] = []

    def status(self) -> AgentStatus:
        return _status(version=0)

    def rejoin(self, *args: Any) -> AgentStatus:
        self.rejoins.append(args)
        return _status()


@pytest.mark.parametrize(("from_store", "expected"), [
    (True, (2, None, "ab" * 16)),  # built from the history the record names, and only it
    (False, (2, "/checkpoints/policy-a/v2")),  # the committed checkpoint, by path
])
def test_a_pod_behind_rejoins_from_the_history_the_record_vouches_for(
        from_store: bool, expected: tuple[Any, ...]) -> None:
    """A pod built from the store (or a peer's copy judged by its history) is told the
    record's history digest, so a store writer cannot swap the history that judges it."""
    record = CommitRecord(committed_version=2, baseline_id="/checkpoints/policy-a/v2",
                          attempt="a-0123456789ab", history_digest="ab" * 16)
    agent = _Agent()
    entry = _report(agent, Receiver(name="rollout-0", url="http://10.0.0.1:8471"),  # type: ignore[arg-type]
                    "2026-01-01T00:00:00Z", record, from_store)
    assert agent.rejoins == [expected]
    assert entry["version"] == 2
