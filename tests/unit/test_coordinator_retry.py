"""The coordinator's pacing between attempts: a fault of the store that lasts a while.

The parties are fakes at the coordinator's own seams (``ReceiverHandle``, ``OwnerHandle``,
a SQLite commit record); the pause between attempts is injected (``wait``), so these tests
count waits, never time them. An owner whose store refuses every publish until the fault
has lasted some seconds stands for a store or link that is down for that long.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dcr.errors import ConfigError
from dcr.protocol.agent_api import AgentStatus, FlushAck
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import (
    Coordinator,
    CoordinatorSettings,
    RefitAborted,
    RefitFailed,
)
from dcr.protocol.records import Attempt, CommitRecord
from dcr.protocol.states import AttemptState

V0 = CommitRecord(committed_version=0, baseline_id="ckpt-0", attempt="")


@dataclass
class Receiver:
    """Takes part in every attempt; holds ``version`` and ``attempt`` as an agent would."""

    name: str = "r0"
    version: int = 0
    attempt: str | None = None
    state: str | None = None

    def _status(self) -> AgentStatus:
        return AgentStatus(name=self.name, version=self.version, dirty=None, unknown=None,
                           attempt=self.attempt, state=self.state, error=None, gate_open=True,
                           payloads_staged=0, payloads_applied=0, bytes_staged=0)

    def status(self) -> AgentStatus:
        return self._status()

    def prepare(self, attempt: Attempt) -> AgentStatus:
        self.attempt, self.state = attempt.id, AttemptState.PREPARED.value
        return self._status()

    def close_gate(self) -> AgentStatus:
        return self._status()

    def open_apply(self, attempt: Attempt) -> AgentStatus:
        return self._status()

    def wait_staged(self, attempt: Attempt) -> AgentStatus:
        return self._status()

    def flush(self, attempt: Attempt) -> FlushAck:
        self.state = AttemptState.FLUSHED.value
        return FlushAck(attempt=attempt.id, payloads=0, bytes=0, apply_s=0.0, wait_s=0.0)

    def committed(self, attempt: str, history_digest: str | None = None) -> AgentStatus:
        self.version, self.state = self.version + 1, AttemptState.COMMITTED.value
        return self._status()

    def stop_and_wait(self, attempt: str) -> AgentStatus:
        self.state = AttemptState.OBSOLETE.value
        return self._status()

    def open_gate(self) -> AgentStatus:
        return self._status()

    def rejoin(self, version: int, checkpoint: str | None = None,
               history_digest: str | None = None) -> AgentStatus:
        self.version = version
        return self._status()


@dataclass
class Outage:
    """A store that refuses writes until ``lasts_s`` seconds have passed on a fake clock
    that only the coordinator's waits move."""

    lasts_s: float
    now_s: float = 0.0
    waits: list[float] = field(default_factory=list)

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now_s += seconds
        return False


@dataclass
class Owner:
    outage: Outage
    published: list[str] = field(default_factory=list)

    def publish(self, attempt: Attempt) -> None:
        self.published.append(attempt.id)
        if self.outage.now_s < self.outage.lasts_s:
            raise OSError(f"store unreachable at t={self.outage.now_s:.1f} s")

    def advance_baseline(self, record: CommitRecord) -> None:
        pass


def coordinator(tmp_path: Path, outage: Outage, *, wait: bool = True,
                **settings: float) -> tuple[Coordinator, Owner]:
    owner = Owner(outage)
    c = Coordinator(SqliteCommitStore(tmp_path / "commit.db", V0), [owner], [Receiver()],
                    settings=CoordinatorSettings(**settings),  # type: ignore[arg-type]
                    wait=outage.wait if wait else None, rng=random.Random(7))
    return c, owner


def test_a_store_fault_of_a_few_seconds_is_outlasted_not_burnt_through(tmp_path: Path) -> None:
    """Fails on a coordinator that retries at once: all four attempts meet the same
    three-second outage and the refit fails."""
    outage = Outage(lasts_s=3.0)
    c, owner = coordinator(tmp_path, outage)
    try:
        record = c.refit(1, "ckpt-1")
    finally:
        c.close()
    assert record.committed_version == 1
    assert [h.outcome for h in c.history][-1] == "committed"
    assert len(owner.published) == 3  # waits of 1.5-2 s, then 3-4 s: the third commits
    assert len(outage.waits) == len(owner.published) - 1


def test_waits_double_up_to_the_cap_each_jittered_down_by_at_most_a_quarter(
        tmp_path: Path) -> None:
    outage = Outage(lasts_s=float("inf"))
    c, _ = coordinator(tmp_path, outage, max_attempts=6, retry_wait_s=2.0,
                       retry_wait_max_s=10.0)
    with pytest.raises(RefitFailed, match="failed 6 attempts"):
        c.refit(1, "ckpt-1")
    c.close()
    steps = [2.0, 4.0, 8.0, 10.0, 10.0]  # one wait between each two attempts, none after
    assert len(outage.waits) == len(steps)
    for got, step in zip(outage.waits, steps, strict=True):
        assert 0.75 * step <= got <= step


def test_no_wait_when_retry_wait_is_zero(tmp_path: Path) -> None:
    outage = Outage(lasts_s=float("inf"))
    c, _ = coordinator(tmp_path, outage, max_attempts=3, retry_wait_s=0.0)
    with pytest.raises(RefitFailed):
        c.refit(1, "ckpt-1")
    c.close()
    assert outage.waits == []


def test_an_abort_during_the_wait_ends_it_and_starts_no_further_attempt(
        tmp_path: Path) -> None:
    """The default wait is the abort event's: an operator's stop (or its deadline, which
    stops the refit) ends an hour-long wait at once."""
    outage = Outage(lasts_s=float("inf"))
    c, owner = coordinator(tmp_path, outage, wait=False, retry_wait_s=3600.0,
                           retry_wait_max_s=3600.0)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            c.refit(1, "ckpt-1")
        except BaseException as e:
            failed.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    while not c.history or c.history[0].outcome == "running":
        t.join(0.01)  # until the first attempt has failed and the wait began
    c.abort.set()
    t.join(60.0)  # generous: a wait not cut short would last an hour
    c.close()
    assert not t.is_alive()
    assert [type(e) for e in failed] == [RefitAborted]
    assert len(owner.published) == 1


@pytest.mark.parametrize(("first", "cap"), [(-1.0, 30.0), (5.0, 2.0)])
def test_wait_settings_out_of_range_are_refused_naming_the_values(first: float,
                                                                  cap: float) -> None:
    with pytest.raises(ConfigError, match=f"retry_wait_s is {first} and retry_wait_max_s "
                                          f"{cap}"):
        CoordinatorSettings(retry_wait_s=first, retry_wait_max_s=cap)
