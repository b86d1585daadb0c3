"""The operator's decisions as pure functions: validation, conditions, phase, receivers."""

from __future__ import annotations

from typing import Any

import pytest

from dcr.protocol.coordinator import AttemptResult
from dcr.protocol.records import CommitRecord
from dcr_operator.api.common import SecretKeyRef
from dcr_operator.api.conditions import RefitReason
from dcr_operator.api.rolloutfleet import (
    LWS_GROUP_KEY,
    LWS_WORKER_INDEX,
    AgentSpec,
    LabelSelector,
    ReplicaGroups,
)
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.reconcile import (
    abandoned,
    attempt_status,
    expired_refits,
    fleet_conditions,
    groups_of,
    phase_of,
    reason_of,
    receivers_of,
    secret_holders,
    selector_query,
    set_condition,
    validate,
)

T0, T1, T2 = "2025-01-01T00:00:00Z", "2025-01-01T00:01:00Z", "2025-01-01T00:02:00Z"


def spec(base: int = 2, target: int = 3, ckpt: str = "/ckpt/v3", **kw: Any) -> WeightRefitSpec:
    return WeightRefitSpec.model_validate({"fleet": "f", "baseVersion": base,
                                           "targetVersion": target,
                                           "source": {"checkpoint": ckpt}, **kw})


def record(v: int, ckpt: str, attempt: str = "a-1") -> CommitRecord:
    return CommitRecord(committed_version=v, baseline_id=ckpt, attempt=attempt)


def test_a_refit_from_the_committed_version_runs() -> None:
    v = validate("r", spec(), "f", record(2, "/ckpt/v2"))
    assert (v.action, v.reason) == ("run", "BaseVersionCommitted")


def test_a_refit_whose_target_is_committed_from_its_checkpoint_finishes() -> None:
    v = validate("r", spec(), "f", record(3, "/ckpt/v3"))
    assert (v.action, v.reason) == ("finish", "AlreadyCommitted")


def test_a_refit_from_a_stale_base_version_is_rejected_with_the_values() -> None:
    v = validate("r", spec(base=1, target=2, ckpt="/ckpt/v2b"), "f", record(3, "/ckpt/v3"))
    assert (v.action, v.reason) == ("reject", "BaseVersionMismatch")
    assert v.message == ("WeightRefit r refits 1 -> 2, but RolloutFleet f has committed "
                         "version 3 (checkpoint /ckpt/v3, attempt a-1); a refit must start "
                         "from the committed version (baseVersion 3).")


def test_a_target_committed_from_another_checkpoint_is_rejected() -> None:
    v = validate("r", spec(), "f", record(3, "/elsewhere/v3"))
    assert (v.action, v.reason) == ("reject", "TargetCommittedElsewhere")
    assert "/elsewhere/v3" in v.message


def test_a_refit_ahead_of_the_record_waits_for_its_base() -> None:
    v = validate("r", spec(base=4, target=5), "f", record(2, "/ckpt/v2"))
    assert (v.action, v.reason) == ("wait", "WaitingForBaseVersion")
    assert "waiting until version 4 is committed" in v.message


def test_a_refit_past_its_deadline_is_rejected_but_a_committed_one_still_finishes() -> None:
    late = spec(deadlineSeconds=30)
    v = validate("r", late, "f", record(2, "/ckpt/v2"), created=T0, at=T1)
    assert (v.action, v.reason) == ("reject", "DeadlineExceeded")
    assert "60 s old" in v.message
    done = validate("r", late, "f", record(3, "/ckpt/v3"), created=T0, at=T1)
    assert done.action == "finish"


def test_last_transition_time_moves_only_when_the_status_changes() -> None:
    c = set_condition([], "Ready", False, "Waiting", "w", at=T0)
    c = set_condition(c, "Ready", False, "StillWaiting", "w2", at=T1)
    assert c == [{"type": "Ready", "status": "False", "reason": "StillWaiting",
                  "message": "w2", "lastTransitionTime": T0}]
    c = set_condition(c, "Ready", True, "Done", at=T2, generation=4)
    assert c[0]["lastTransitionTime"] == T2
    assert c[0]["observedGeneration"] == 4


def test_set_condition_keeps_the_order_and_the_other_conditions() -> None:
    c = set_condition([], "A", True, "X", at=T0)
    c = set_condition(c, "B", True, "X", at=T0)
    c = set_condition(c, "A", False, "Y", at=T1)
    assert [x["type"] for x in c] == ["A", "B"]
    assert c[1]["status"] == "True"


@pytest.mark.parametrize(("true", "phase"), [
    ((), "Pending"), (("Validated",), "Pending"), (("Validated", "Applying"), "Applying"),
    (("Encoding", "Applying"), "Encoding"), (("Applying", "Failed"), "Failed"),
    (("Failed", "Committed"), "Committed"),
])
def test_phase_is_derived_from_the_conditions(true: tuple[str, ...], phase: str) -> None:
    conditions: list[dict[str, Any]] = []
    for t in ("Validated", "Encoding", "Applying", "Committed", "Failed"):
        conditions = set_condition(conditions, t, t in true, "R", at=T0)
    assert phase_of(conditions) == phase


@pytest.mark.parametrize(("set_", "reason"), [
    ((), None),
    ((("Validated", False, "WaitingForBaseVersion"),), "WaitingForBaseVersion"),
    ((("Validated", True, "BaseVersionCommitted"), ("Applying", False, "WaitingForReceivers")),
     "WaitingForReceivers"),
    ((("Validated", True, "BaseVersionCommitted"), ("Encoding", True, "EncoderJobRunning"),
      ("Applying", True, "AttemptRunning")), "EncoderJobRunning"),
    ((("Applying", False, "AttemptRunning"), ("Failed", True, "RetryLimitReached")),
     "RetryLimitReached"),
    ((("Validated", False, "BaseVersionMismatch"), ("Failed", True, "BaseVersionMismatch")),
     "BaseVersionMismatch"),
    ((("Failed", False, "Committed"), ("Committed", True, "Committed")), "Committed"),
])
def test_reason_is_that_of_the_condition_naming_the_phase_or_what_it_waits_for(
        set_: tuple[tuple[str, bool, str], ...], reason: str | None) -> None:
    conditions: list[dict[str, Any]] = []
    for type_, status, why in set_:
        conditions = set_condition(conditions, type_, status, why, at=T0)
    assert reason_of(conditions) == reason


def _pod(name: str, *, phase: str = "Running", ip: str | None = "10.0.0.7",
         annotations: dict[str, str] | None = None, deleting: bool = False,
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "annotations": annotations or {},
                            "labels": labels or {}}
    if deleting:
        meta["deletionTimestamp"] = T0
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_receivers_are_running_pods_addressed_by_pod_ip_only() -> None:
    """Fails on 5b0b0ae: pod "a"'s ``dcr.dev/agent-url`` annotation (which anyone who may
    annotate a selected pod can set) decided where the agent token was sent."""
    agent = AgentSpec(port=9000, token_secret_ref=SecretKeyRef(name="s"))
    pods = [_pod("c"), _pod("a", ip="10.0.0.8",
                            annotations={"dcr.dev/agent-url": "http://attacker:5"}),
            _pod("v6", ip="fd00::7"), _pod("pending", phase="Pending"),
            _pod("gone", deleting=True), _pod("no-ip", ip=None),
            _pod("bad-ip", ip="10.0.0.9/x")]
    got = [(r.name, r.url) for r in receivers_of(pods, agent)]
    assert got == [("a", "http://10.0.0.8:9000"), ("c", "http://10.0.0.7:9000"),
                   ("v6", "http://[fd00::7]:9000")]


def _member(name: str, group: str, index: int, **more: Any) -> dict[str, Any]:
    """A LeaderWorkerSet pod: group ``group``, worker index ``index`` (0: the leader)."""
    return _pod(name, labels={LWS_GROUP_KEY: group, LWS_WORKER_INDEX: str(index)}, **more)


def test_a_group_is_one_receiver_through_its_leader_once_every_pod_runs() -> None:
    """Fails without spec.groups: every pod was a receiver, so the operator drove a
    worker pod's member agent as if it were a replica, and counted pods, not replicas."""
    agent = AgentSpec(port=9000, token_secret_ref=SecretKeyRef(name="s"))
    groups = ReplicaGroups(size=2)
    pods = [
        _member("g0-1", "g0", 1, ip="10.0.0.2"), _member("g0", "g0", 0, ip="10.0.0.1"),
        _member("g1", "g1", 0), _member("g1-1", "g1", 1, phase="Pending"),
        _member("g2", "g2", 0), _member("g2-1", "g2", 1), _member("g2-9", "g2", 1),
        _member("g3-1", "g3", 1), _member("g3-2", "g3", 1),
        _member("g4", "g4", 0, ip=None), _member("g4-1", "g4", 1),
        _member("g5", "g5", 0), _member("g5-1", "g5", 1, deleting=True),
        _pod("loose"),
    ]
    found, incomplete = groups_of(pods, agent, groups)
    assert [(r.name, r.url, r.pods) for r in found] == [
        ("g0", "http://10.0.0.1:9000", ("g0", "g0-1"))]
    assert receivers_of(pods, agent, groups) == found
    why = {g.name: (g.pods, g.reason) for g in incomplete}
    assert why == {
        "g1": (("g1", "g1-1"), "Group g1 (g1, g1-1) has 1 of its 2 pods Running; it takes "
               "part once all are."),
        "g2": (("g2", "g2-1", "g2-9"), "Group g2 (g2, g2-1, g2-9) has 3 pods; "
               "spec.groups.size is 2."),
        "g3-1": (("g3-1", "g3-2"), "Group g3 (g3-1, g3-2) has 0 leader pods "
                 f"({LWS_WORKER_INDEX}=0); a group has exactly one."),
        "g4": (("g4", "g4-1"), "Group g4 (g4, g4-1): its leader pod g4 has no IP address."),
        "g5": (("g5",), "Group g5 (g5) has 1 of its 2 pods Running; it takes part once "
               "all are."),
        "loose": (("loose",), f"Pod loose carries no label {LWS_GROUP_KEY}: it is in no "
                  "group (spec.groups.label)."),
    }


def test_a_pod_claiming_to_lead_a_group_that_has_a_leader_takes_the_group_out() -> None:
    """Any pod matching the selector can carry a group's labels: two leaders are refused,
    never one picked (the operator would send the agent token to whichever it chose)."""
    agent = AgentSpec(port=9000, token_secret_ref=SecretKeyRef(name="s"))
    found, (bad,) = groups_of([_member("g0", "g0", 0), _member("x", "g0", 0)], agent,
                              ReplicaGroups(size=2))
    assert found == []
    assert bad.reason == (f"Group g0 (g0, x) has 2 leader pods ({LWS_WORKER_INDEX}=0); a "
                          "group has exactly one.")


def test_selector_query_spells_labels_and_expressions() -> None:
    sel = LabelSelector.model_validate({
        "matchLabels": {"b": "2", "a": "1"},
        "matchExpressions": [{"key": "tier", "operator": "In", "values": ["x", "y"]},
                             {"key": "gpu", "operator": "Exists"},
                             {"key": "old", "operator": "DoesNotExist"}]})
    assert selector_query(sel) == "a=1,b=2,tier in (x,y),gpu,!old"


def test_attempt_status_splits_outcome_and_reason() -> None:
    r = AttemptResult(attempt="a-1", mode="mixed", receivers=("p0", "p1"),
                      outcome="failed: Agent p1 unreachable", stages={"prepare": 0.12345},
                      payload_bytes=99, rejoined=("p1",))
    out = attempt_status(r, start=T0, end=T1, payloads=3, job="j")
    assert out == {"id": "a-1", "mode": "mixed", "outcome": "Failed", "startTime": T0,
                   "stages": {"prepare": 0.1235}, "payloads": 3, "bytes": 99,
                   "receiverCount": 2, "rejoined": ["p1"], "leftOut": [],
                   "reason": "Agent p1 unreachable", "completionTime": T1, "job": "j"}
    forced = attempt_status(r, start=T0, end=None, payloads=0, job=None, mode="overwrite")
    assert forced["mode"] == "overwrite"
    assert "completionTime" not in forced


def test_attempts_left_running_by_a_previous_operator_become_abandoned() -> None:
    out = abandoned([{"id": "a", "outcome": "Running"}, {"id": "b", "outcome": "Failed"}],
                    at=T1)
    assert out[0]["outcome"] == "Abandoned"
    assert out[0]["completionTime"] == T1
    assert out[1] == {"id": "b", "outcome": "Failed"}


def test_fleet_conditions_follow_the_receivers() -> None:
    rec = record(2, "/c")
    ok = [{"name": "p0", "version": 2}, {"name": "p1", "version": 2}]
    c = fleet_conditions([], record=rec, receivers=ok, active=None, at=T0, generation=1)
    status = {x["type"]: x["status"] for x in c}
    assert status == {"Ready": "True", "Progressing": "False", "Degraded": "False"}
    bad: list[dict[str, Any]] = [{"name": "p0", "version": 2},
                                 {"name": "p1", "error": "refused"}]
    c = fleet_conditions(c, record=rec, receivers=bad, active="r-3", at=T1, generation=1)
    by = {x["type"]: x for x in c}
    assert by["Ready"]["message"] == "1 of 2 receivers do not report version 2: p1."
    assert by["Progressing"]["message"] == "WeightRefit r-3 is running."
    assert by["Degraded"]["status"] == "True"
    assert by["Ready"]["lastTransitionTime"] == T1


def _pod_handed(name: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"containers": [], **spec}}


def test_every_way_a_pod_spec_hands_over_a_secret_is_seen() -> None:
    """Fails on b20bcff (no ``secret_holders``): nothing looked at what pods are handed."""
    def env_from(n: str) -> dict[str, Any]:
        return {"name": "c", "envFrom": [{"configMapRef": {"name": "cm"}},
                                         {"secretRef": {"name": n}}]}

    pods = [
        _pod_handed("agent", containers=[env_from("w")]),
        _pod_handed("init", initContainers=[env_from("w")]),
        _pod_handed("debug", ephemeralContainers=[env_from("w")]),
        _pod_handed("env", containers=[{"name": "c", "env": [
            {"name": "A", "value": "w"},
            {"name": "K", "valueFrom": {"secretKeyRef": {"name": "w", "key": "k"}}}]}]),
        _pod_handed("volume", volumes=[{"name": "v", "secret": {"secretName": "w"}}]),
        _pod_handed("projected", volumes=[{"name": "v", "projected": {"sources": [
            {"configMap": {"name": "w"}}, {"secret": {"name": "w"}}]}}]),
        _pod_handed("reader", containers=[env_from("r")],
                    volumes=[{"name": "v", "configMap": {"name": "w"}}]),
        {"metadata": {"name": "no-spec"}},
    ]
    assert secret_holders(pods, "w") == ["agent", "debug", "env", "init", "projected",
                                         "volume"]
    assert secret_holders(pods, "r") == ["reader"]


def test_receivers_read_only_names_the_pods_handed_the_write_credentials() -> None:
    """Fails on b20bcff (no ReceiversReadOnly condition): a fleet whose rollout pods held the
    owners' write key looked as healthy as one whose pods held a read-only key."""
    rec, ok = record(2, "/c"), [{"name": "p0", "version": 2}]
    c = fleet_conditions([], record=rec, receivers=ok, active=None, at=T0, generation=1)
    assert "ReceiversReadOnly" not in {x["type"] for x in c}  # the fleet names no Secret
    holders = [f"p{i:02}" for i in range(12)]
    c = fleet_conditions(c, record=rec, receivers=ok, active=None, at=T1, generation=1,
                         write_secret="weights-s3", write_holders=holders)
    by = {x["type"]: x for x in c}
    assert by["Ready"]["status"] == "True"
    got = by["ReceiversReadOnly"]
    assert (got["status"], got["reason"]) == ("False", "PodsHoldWriteCredentials")
    assert got["message"].startswith(
        "12 selected pods are handed Secret weights-s3, the store's write credentials "
        "(spec.store.credentialsSecretRef): p00, p01, p02, p03, p04, p05, p06, p07, p08, "
        "p09 and 2 more.")
    c = fleet_conditions(c, record=rec, receivers=ok, active=None, at=T2, generation=1,
                         write_secret="weights-s3")
    got = {x["type"]: x for x in c}["ReceiversReadOnly"]
    assert (got["status"], got["reason"]) == ("True", "NoPodHoldsWriteCredentials")
    assert got["lastTransitionTime"] == T2


def test_a_refit_with_several_owners_runs_whatever_the_fleet_publishes_through() -> None:
    """A relay carries every owner's manifest part: no reason refuses several owners."""
    v = validate("r", spec(encoder={"owners": 4}), "f", record(2, "/ckpt/v2"))
    assert v.action == "run"
    assert not hasattr(RefitReason, "RELAY_CARRIES_ONE_OWNER")


def _refit(name: str, fleet: str, phase: str | None, ended: str | None = None,
           created: str = T0) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase} if phase else {}
    if ended:
        status["completionTime"] = ended
    return {"metadata": {"name": name, "creationTimestamp": created},
            "spec": {"fleet": fleet}, "status": status}


def test_only_finished_refits_past_the_history_limit_or_ttl_expire() -> None:
    """Fails on 711d82d (no history limit): every refit of a run, one per optimizer step,
    stayed forever with its finalizer."""
    refits = [_refit(f"v{i}", "f", "Committed", f"2025-01-01T00:0{i}:00Z") for i in range(6)]
    refits += [_refit("failed", "f", "Failed", "2025-01-01T00:02:30Z"),
               _refit("running", "f", "Applying"), _refit("pending", "f", None),
               _refit("other-fleet", "g", "Committed", "2025-01-01T00:00:00Z"),
               _refit("no-completion", "f", "Failed", None, created="2025-01-01T00:00:30Z")]
    at = "2025-01-01T00:10:00Z"
    assert expired_refits(refits, "f", keep=3, ttl_s=None, at=at) == [
        "failed", "no-completion", "v0", "v1", "v2"]
    assert expired_refits(refits, "f", keep=100, ttl_s=None, at=at) == []
    assert expired_refits(refits, "f", keep=100, ttl_s=6 * 60, at=at) == [
        "failed", "no-completion", "v0", "v1", "v2", "v3"]  # finished before 00:04
    assert expired_refits(refits, "f", keep=0, ttl_s=None, at=at) == [
        "failed", "no-completion", "v0", "v1", "v2", "v3", "v4", "v5"]
