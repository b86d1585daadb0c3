"""The protocol core: attempt states, transitions, and the compare-and-set commit record."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from dcr.errors import ConfigError
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.records import Attempt, CommitOutcome, CommitRecord, Transition
from dcr.protocol.state import FINAL, IllegalTransition, advance
from dcr.protocol.states import AttemptState

S = AttemptState
V0 = CommitRecord(committed_version=0, baseline_id="b0", attempt="")


def walk(*states: AttemptState) -> AttemptState:
    cur = states[0]
    for nxt in states[1:]:
        cur = advance("a-test", cur, nxt)
    return cur


def test_asynchronous_rl_stages_while_serving_then_closes_the_gate() -> None:
    assert walk(S.PREPARED, S.STREAMING, S.STAGED, S.GATE_CLOSED, S.APPLYING, S.FLUSHED,
                S.COMMITTED) is S.COMMITTED


def test_synchronous_rl_closes_the_gate_first() -> None:
    assert walk(S.PREPARED, S.GATE_CLOSED, S.STREAMING, S.STAGED, S.APPLYING, S.FLUSHED,
                S.COMMITTED) is S.COMMITTED


@pytest.mark.parametrize("state", sorted(set(S) - FINAL, key=lambda s: s.value))
def test_any_unfinished_attempt_can_become_obsolete(state: AttemptState) -> None:
    assert advance("a-test", state, S.OBSOLETE) is S.OBSOLETE


@pytest.mark.parametrize(("frm", "to"), [
    (S.PREPARED, S.APPLYING), (S.STREAMING, S.COMMITTED), (S.APPLYING, S.COMMITTED),
    (S.COMMITTED, S.OBSOLETE), (S.OBSOLETE, S.PREPARED), (S.FLUSHED, S.APPLYING),
])
def test_skipping_or_leaving_a_final_state_is_refused_naming_both(
    frm: AttemptState, to: AttemptState
) -> None:
    with pytest.raises(IllegalTransition, match=f"from {frm.value} to {to.value}"):
        advance("a-test", frm, to)


def test_transitions_and_attempts_are_validated() -> None:
    with pytest.raises(ConfigError, match="3 -> 3"):
        Transition(base_version=3, target_version=3)
    t = Transition(base_version=3, target_version=4)
    with pytest.raises(ConfigError, match="no required receivers"):
        Attempt(transition=t, mode="mixed", receivers=(), deadline=time.time() + 1)
    with pytest.raises(ConfigError, match="twice"):
        Attempt(transition=t, mode="mixed", receivers=("r0", "r0"), deadline=time.time() + 1)
    a, b = (Attempt(transition=t, mode="overwrite", receivers=("r0",), deadline=0.0)
            for _ in range(2))
    assert a.id != b.id
    assert a.expired


def test_compare_and_set_commits_once_and_then_conflicts(tmp_path: Path) -> None:
    store = SqliteCommitStore(tmp_path / "commit.db", V0)
    v1 = CommitRecord(committed_version=1, baseline_id="b1", attempt="a-1")
    assert store.compare_and_set(V0, v1) is CommitOutcome.SUCCESS
    assert store.compare_and_set(V0, v1) is CommitOutcome.CONFLICT  # stale expectation
    assert store.read() == v1
    reopened = SqliteCommitStore(tmp_path / "commit.db", V0)  # initial ignored when present
    assert reopened.read() == v1


def _contend(path: str, attempt: str, start: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    store = SqliteCommitStore(Path(path), V0)
    while time.time() < start:
        pass
    new = CommitRecord(committed_version=1, baseline_id="b1", attempt=attempt)
    out.put((attempt, store.compare_and_set(V0, new).value))


def test_concurrent_coordinators_in_separate_processes_have_exactly_one_winner(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "commit.db")
    SqliteCommitStore(Path(path), V0)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start = time.time() + 2.0
    procs = [ctx.Process(target=_contend, args=(path, f"a-{i}", start, out)) for i in range(4)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    winners = [a for a, outcome in results.items() if outcome == "success"]
    assert len(winners) == 1
    assert sorted(results.values()) == ["conflict"] * 3 + ["success"]
    assert SqliteCommitStore(Path(path), V0).read().attempt == winners[0]
