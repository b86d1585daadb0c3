"""What the agent knows of its engine's weights (``dcr.receiver.weights``), driven directly:
no threads, no engine. The agent's locking and HTTP surface are tested in
``tests/integration/test_receiver_service.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcr.format.names import new_attempt_id
from dcr.protocol.agent_api import AttemptSpec
from dcr.receiver.journal import Journal
from dcr.receiver.weights import Weights


class Refused(Exception):
    pass


def spec(base: int, target: int, mode: str = "mixed") -> AttemptSpec:
    return AttemptSpec(attempt=new_attempt_id(), base_version=base, target_version=target,
                       mode=mode, deadline=0.0)


def test_a_new_agent_holds_the_version_it_was_started_at() -> None:
    w = Weights("a", 3, None, Refused)
    assert (w.held, w.servable) == (3, True)
    w.admit(spec(3, 4))
    with pytest.raises(Refused, match=r"holds version 3; attempt .* is for base 2"):
        w.admit(spec(2, 3))


def test_half_written_weights_admit_only_an_overwrite_of_the_same_transition() -> None:
    w = Weights("a", 3, None, Refused)
    w.writing(spec(3, 4))
    assert (w.held, w.dirty, w.servable) == (None, (3, 4), False)
    w.admit(spec(3, 4, "overwrite"))
    for other in (spec(3, 4, "mixed"), spec(4, 5, "overwrite")):
        with pytest.raises(Refused, match="a mix of 3 and 4"):
            w.admit(other)


def test_a_restart_with_unsettled_writes_leaves_the_version_unknown(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    w = Weights("a", 3, journal, Refused)
    w.seen("engine-1")
    w.writing(spec(3, 4))
    w.save("a-1", "applying")
    again = Weights("a", 3, journal, Refused)
    assert (again.held, again.dirty, again.servable) == (None, None, False)
    assert again.instance == "engine-1"
    with pytest.raises(Refused, match=r"version unknown .*restarted while attempt a-1"):
        again.admit(spec(3, 4, "overwrite"))


def test_a_clean_journal_restores_its_version_over_the_start_flag(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.json")
    w = Weights("a", 0, journal, Refused)
    w.committed(5, {})
    w.save("a-2", "committed")
    assert Weights("a", 0, journal, Refused).held == 5


def test_a_new_engine_instance_makes_the_weights_unknown() -> None:
    w = Weights("a", 2, None, Refused)
    assert w.seen("engine-1") is None  # the first id is adopted
    assert w.seen("engine-1") is None
    reason = w.seen("engine-2")
    assert reason is not None
    assert "the engine restarted" in reason
    assert (w.held, w.unknown, w.instance) == (None, reason, "engine-2")


def test_dense_loads_are_checked_against_the_targets_a_commit_vouched_for() -> None:
    w = Weights("a", 1, None, Refused)
    w.writing(spec(1, 2))
    w.committed(2, {"w": "fp2"})
    assert (w.held, w.expected(2), w.expected(1)) == (2, {"w": "fp2"}, None)
    w.loading(2)
    assert (w.held, w.servable) == (None, False)
    w.loaded(2)
    assert (w.held, w.servable) == (2, True)


def test_foreign_bits_matter_only_once_the_attempt_has_written() -> None:
    w = Weights("a", 1, None, Refused)
    assert not w.foreign("found a foreign payload")
    assert (w.held, w.servable) == (1, True)
    w.writing(spec(1, 2))
    assert w.foreign("found a foreign payload")
    assert (w.held, w.unknown) == (None, "found a foreign payload")
