"""The fault campaign's checker (bench/faultcheck.py) catches every violation kind.

Each test starts from a hand-built log of a clean campaign (two commits, a fleet that
settles) that the checker passes, and breaks one thing the way a bug would: a checker
that cannot fail proves nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from faultcheck import KINDS, check

FP = {0: {"w": "a0"}, 1: {"w": "a1"}, 2: {"w": "a2"}}
AGENTS = ("agent-0", "agent-1")


def _rec(v: int) -> dict[str, Any]:
    return {"version": v, "attempt": f"a-{v}" if v else "", "baseline": f"v{v}"}


def _agent(t: float, rnd: int, name: str, v: int, **kw: Any) -> dict[str, Any]:
    return {"t": t, "party": "harness", "kind": "agent", "round": rnd, "agent": name,
            "pod_kind": "hf", "version": v, "dirty": None, "unknown": None,
            "fingerprint": FP[v], **kw}


def clean_log() -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = [
        {"t": 0.0, "party": "harness", "kind": "record", **_rec(0)}]
    log += [{"t": 0.1, "party": "harness", "kind": "reference", "version": v,
             "pod_kind": "hf", "fingerprint": FP[v]} for v in FP]
    for v, t in ((1, 10.0), (2, 20.0)):
        log += [
            {"t": t, "party": "coordinator", "kind": "cas", "expected": _rec(v - 1),
             "new": _rec(v), "outcome": "success", "receivers": list(AGENTS)},
            {"t": t + 1, "party": "harness", "kind": "faults_stopped", "step": v,
             "bound_s": 60.0, "agents": list(AGENTS)},
            {"t": t + 1.5, "party": "harness", "kind": "record", **_rec(v)},
            *[_agent(t + 2, v, a, v) for a in AGENTS],
        ]
    for v in (1, 2):
        tensors = {"w": f"sum{v}"}
        log += [{"t": 30.0 + v, "party": "harness", "kind": "materialized", "version": v,
                 "tensors": tensors},
                {"t": 30.0 + v, "party": "harness", "kind": "checkpoint", "version": v,
                 "tensors": dict(tensors)}]
    return log


def kinds(log: list[dict[str, Any]]) -> set[str]:
    return {v.kind for v in check(sorted(log, key=lambda e: e["t"])).violations}


def test_a_clean_campaign_passes_and_its_recovery_is_measured() -> None:
    rep = check(clean_log())
    assert rep.violations == []
    assert rep.recovery_s == [1.0, 1.0]


def _cas(log: list[dict[str, Any]], v: int) -> dict[str, Any]:
    return next(e for e in log if e["kind"] == "cas" and e["new"]["version"] == v)


def test_a_commit_that_skips_a_version_is_caught() -> None:
    log = clean_log()
    _cas(log, 2)["new"] = _rec(3)
    log.append({"t": 21.6, "party": "harness", "kind": "record", **_rec(3)})
    assert "cas_step" in kinds(log)


def test_a_record_read_going_backwards_is_caught() -> None:
    log = clean_log()
    log.append({"t": 25.0, "party": "harness", "kind": "record", **_rec(1)})
    assert kinds(log) == {"record_backwards"}


def test_a_record_no_compare_and_set_wrote_is_caught() -> None:
    log = clean_log()
    next(e for e in log if e["kind"] == "record" and e["version"] == 2)["attempt"] = "a-x"
    assert "record_unexplained" in kinds(log)


def test_a_counted_receiver_seen_at_the_old_version_is_caught() -> None:
    log = clean_log()
    late = next(e for e in log if e["kind"] == "agent" and e["agent"] == "agent-1"
                and e["version"] == 2)
    late.update(version=1, fingerprint=FP[1])
    log += [_agent(23.0, 9, a, 2) for a in AGENTS]  # it converges later: only the count is wrong
    assert kinds(log) == {"counted_not_holding"}


def test_an_agent_claiming_a_version_without_its_bits_is_caught() -> None:
    log = clean_log()
    next(e for e in log if e["kind"] == "agent" and e["version"] == 1)["fingerprint"] = FP[0]
    assert {"wrong_bits", "counted_not_holding"} <= kinds(log)


def test_a_dirty_agent_is_not_held_to_any_version() -> None:
    log = clean_log()
    log.append(_agent(22.5, 8, "agent-0", 2, dirty=[1, 2], fingerprint=FP[0]))
    assert kinds(log) == set()


def test_a_completion_from_an_uncommitted_version_is_caught() -> None:
    log = clean_log()
    answer = {"t": 15.0, "party": "client", "kind": "completion", "pod": "serve-0",
              "pod_kind": "hf", "tokens": [1, 2], "logprobs": [-0.1, -0.2],
              "versions": [{"version": "0", "start": 0, "end": 1},
                           {"version": "1", "start": 1, "end": 2}]}
    assert kinds([*log, answer]) == set()  # a switch at a token, both committed
    answer["versions"] = [{"version": "3", "start": 0, "end": 2}]
    assert kinds([*log, answer]) == {"completion_uncommitted"}


def test_completions_of_one_version_answering_differently_are_caught() -> None:
    def answer(t: float, pod: str, logprobs: list[float]) -> dict[str, Any]:
        return {"t": t, "party": "client", "kind": "completion", "pod": pod,
                "pod_kind": "hf", "tokens": [7, 7], "logprobs": logprobs,
                "versions": [{"version": "2", "start": 0, "end": 2}]}

    log = [*clean_log(), answer(25.0, "serve-0", [-0.5, -0.25]),
           answer(26.0, "serve-1", [-0.5, -0.25])]
    assert kinds(log) == set()
    assert kinds([*log, answer(27.0, "serve-1", [-0.5, -0.375])]) == {"completion_mixed"}


@pytest.mark.parametrize("broken", ["missing", "error", "bits"])
def test_a_committed_version_not_buildable_from_the_store_is_caught(broken: str) -> None:
    log = clean_log()
    built = next(e for e in log if e["kind"] == "materialized" and e["version"] == 2)
    if broken == "missing":
        log.remove(built)
    elif broken == "error":
        built.update(error="NotVouched: version 2", tensors={})
    else:
        built["tensors"] = {"w": "other"}
    assert kinds(log) == {"not_buildable"}


def test_a_fleet_that_does_not_reach_the_newest_version_in_time_is_caught() -> None:
    log = clean_log()
    for e in log:
        if e["kind"] == "agent" and e["agent"] == "agent-0" and e["version"] == 2:
            e.update(version=None, unknown="restarted", fingerprint=None)
    assert kinds(log) == {"not_converged"}
    slow = copy.deepcopy(clean_log())
    for e in slow:
        if e["kind"] == "agent" and e["version"] == 2:
            e["t"] = 200.0  # converged, but after the 60 s bound
    assert kinds(slow) == {"not_converged"}


def test_every_violation_kind_has_a_test_here() -> None:
    names = {n for n in globals() if n.startswith("test_")}
    caught = {"cas_step": "skips", "record_backwards": "backwards",
              "record_unexplained": "no_compare", "counted_not_holding": "counted",
              "wrong_bits": "without_its_bits", "not_buildable": "buildable",
              "not_converged": "does_not_reach", "completion_uncommitted": "uncommitted",
              "completion_mixed": "answering_differently"}
    assert caught.keys() == KINDS.keys()
    for word in caught.values():
        assert any(word in n for n in names), word
