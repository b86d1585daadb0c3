"""WeightRefit status and Events as a refit runs, recorded without a cluster.

The Kubernetes client is faked at our own seam (it records the merge patches); the
receivers are faked as ``ReceiverHandle``s.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import pytest

from dcr.protocol.agent_api import AgentApi, AgentError, FlushAck
from dcr.protocol.coordinator import AttemptResult
from dcr.protocol.records import Attempt, CommitRecord, Transition
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.errors import ApiUnreachable
from dcr_operator.progress import STEPS, Recorder, TrackedReceiver
from dcr_operator.refit import RefitRun
from dcr_operator.settings import OperatorSettings
from status import ScaleReceiver  # bench/status.py: the benchmark's stand-in

REFIT = {"metadata": {"name": "r", "namespace": "ns", "generation": 1},
         "status": {"attempts": [{"id": "a-old", "outcome": "Running", "mode": "mixed"}]}}


class FakeKube:
    def __init__(self, fail: bool = False) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail

    def merge_patch(self, path: str, body: dict[str, Any]) -> Any:
        if self.fail:
            raise ApiUnreachable("no answer")
        self.patches.append((path, body))
        return body


class FakeReceiver:
    name = "p0"

    def __init__(self) -> None:
        self.modes: list[str] = []

    def prepare(self, attempt: Attempt) -> None:
        self.modes.append(attempt.mode)

    def flush(self, attempt: Attempt) -> FlushAck:
        self.modes.append(attempt.mode)
        return FlushAck(attempt=attempt.id, payloads=3, bytes=100, apply_s=0.5, wait_s=0.1)

    def open_apply(self, attempt: Attempt) -> None:
        raise RuntimeError("agent p0 went away")

    def rejoin(self, version: int, checkpoint: str) -> None:
        self.modes.append(f"dense {version}")


def recorder(kube: FakeKube, events: list[tuple[str, str, str]], **kw: Any) -> Recorder:
    return Recorder(kube, REFIT, emit=lambda _obj, t, r, m: events.append((t, r, m)),  # type: ignore[arg-type]
                    clock=lambda: "2025-01-01T00:00:00Z", **kw)


def attempt() -> Attempt:
    return Attempt(transition=Transition(base_version=1, target_version=2), mode="mixed",
                   receivers=("p0",), deadline=time.time() + 60, id="a-new")


def test_a_resumed_refit_abandons_the_old_attempt_and_records_the_new_one_once() -> None:
    kube, events = FakeKube(), []  # type: ignore[var-annotated]
    rec = recorder(kube, events)
    a = attempt()
    history = [AttemptResult(attempt=a.id, mode="mixed", receivers=("p0",))]
    rx = TrackedReceiver(FakeReceiver(), rec, lambda x: rec.attempt_started(x, history))  # type: ignore[arg-type]
    rx.prepare(a)
    rx.prepare(a)  # a second receiver's prepare: no second start
    assert [e[1] for e in events] == ["AttemptStarted"]
    ack = rx.flush(a)
    history[0].outcome, history[0].payload_bytes = "committed", ack.bytes
    rec.sync(history)
    status = rec.status()
    assert [(x["id"], x["outcome"]) for x in status["attempts"]] == [
        ("a-old", "Abandoned"), ("a-new", "Committed")]
    assert status["attempts"][1]["payloads"] == 3
    assert status["receivers"] == [{"name": "p0", "attempt": "a-new", "state": "flushed",
                                    "payloads": 3, "bytes": 100, "applySeconds": 0.5,
                                    "lastAck": "2025-01-01T00:00:00Z"}]
    assert (status["attemptCount"], status["bytes"], status["phase"]) == (2, 100, "Applying")
    assert kube.patches[-1][0] == "/apis/dcr.dev/v1alpha1/namespaces/ns/weightrefits/r/status"


def test_forced_overwrite_reaches_every_call_and_the_status() -> None:
    kube, events = FakeKube(), []  # type: ignore[var-annotated]
    rec = recorder(kube, events, forced_mode="overwrite")
    inner = FakeReceiver()
    rx = TrackedReceiver(inner, rec, lambda x: rec.attempt_started(x, []),  # type: ignore[arg-type]
                         forced_mode="overwrite")
    rx.prepare(attempt())
    rx.flush(attempt())
    assert inner.modes == ["overwrite", "overwrite"]
    assert rec.status()["attempts"][1]["mode"] == "overwrite"


def test_a_receiver_error_is_recorded_and_raised() -> None:
    rec = recorder(FakeKube(), [])
    rx = TrackedReceiver(FakeReceiver(), rec, lambda x: None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="went away"):
        rx.open_apply(attempt())
    (entry,) = rec.status()["receivers"]
    assert (entry["state"], entry["error"]) == ("open_apply failed", "agent p0 went away")


class HostileReceiver(FakeReceiver):
    """An agent whose refusals and answers carry text of its own choosing."""

    def open_apply(self, attempt: Attempt) -> None:
        raise AgentError("Agent p0 (POST /v1/apply): S3CR3T body text", 500,
                         "<script>alert(1)</script>")

    def close_gate(self) -> None:
        raise AgentError("Agent p0 (POST /v1/gate/close): S3CR3T", 409, "AgentConflict")

    def flush(self, attempt: Attempt) -> FlushAck:
        return FlushAck(attempt="../S3CR3T", payloads=3, bytes=100, apply_s=0.5, wait_s=0.1)


def test_refit_status_and_the_coordinator_get_our_sentence_not_the_agents() -> None:
    """Fails on 5b0b0ae: an agent's error body (and the attempt id it answered a flush
    with) went into the WeightRefit's status, and into attempt reasons and Events."""
    rec = recorder(FakeKube(), [])
    rx = TrackedReceiver(HostileReceiver(), rec, lambda x: None)  # type: ignore[arg-type]
    with pytest.raises(AgentError) as refused:
        rx.open_apply(attempt())
    said = "Agent p0 (POST /v1/apply) was refused with HTTP 500."
    assert (str(refused.value), refused.value.status) == (said, 500)
    assert rec.status()["receivers"][0]["error"] == said
    with pytest.raises(AgentError, match=r"^Agent p0 \(POST /v1/gate/close\) was refused "
                       r"with HTTP 409 \(AgentConflict\)\.$"):
        rx.close_gate()
    rx.flush(attempt())
    assert "S3CR3T" not in repr(rec.status())
    assert rec.status()["receivers"][0]["attempt"] == attempt().id


def test_every_progress_step_names_a_call_of_the_agent_api() -> None:
    assert set(STEPS) <= {c.name for c in AgentApi.calls()}


def test_a_rejoin_is_recorded_before_and_after_and_announced() -> None:
    events: list[tuple[str, str, str]] = []
    rec = recorder(FakeKube(), events)
    rx = TrackedReceiver(FakeReceiver(), rec, lambda x: None)  # type: ignore[arg-type]
    rx.rejoin(1, "/ckpt/v1")
    (entry,) = rec.status()["receivers"]
    assert entry == {"name": "p0", "state": "rejoined"}
    assert events == [("Normal", "ReceiverRejoined",
                       "Receiver p0 restored version 1 by a dense load of /ckpt/v1.")]
    rx.rejoin(2, None)  # a store fleet's receivers name no checkpoint
    assert events[-1] == ("Normal", "ReceiverRejoined", "Receiver p0 restored version 2 by "
                          "a dense load of what it built from the store's history.")


def test_events_only_on_transitions_and_a_failed_status_write_is_not_fatal() -> None:
    events: list[tuple[str, str, str]] = []
    rec = recorder(FakeKube(fail=True), events)
    rec.set("Committed", False, "NotYet", event="X")
    rec.set("Committed", False, "StillNot", event="X")
    rec.set("Committed", True, "Committed", "done", event="Committed")
    rec.flush()  # logged, not raised
    assert [e[1] for e in events] == ["X", "Committed"]
    assert rec.status()["phase"] == "Committed"


def test_each_status_write_carries_the_reason_beside_the_phase() -> None:
    """The REASON printer column reads ``status.reason``: the Failed condition's reason once
    the refit failed, and what it waits for before that."""
    kube, events = FakeKube(), []  # type: ignore[var-annotated]
    rec = recorder(kube, events)
    rec.set("Validated", False, "WaitingForBaseVersion", "waits", event="Waiting")
    rec.flush()
    rec.set("Failed", True, "DeadlineExceeded", "too late", event="RefitFailed")
    rec.flush()
    assert [(b["status"]["phase"], b["status"]["reason"]) for _, b in kube.patches] == [
        ("Pending", "WaitingForBaseVersion"), ("Failed", "DeadlineExceeded")]


def test_a_thousand_receivers_and_32_failed_attempts_keep_the_status_small_and_rare(
        ) -> None:
    """Fails on 1802db4, where every acknowledgement wrote the whole status (1,000
    receivers: 1,000 writes of O(1,000) bytes per attempt) and each attempt listed every
    receiver's name, so 32 failed attempts passed etcd's 1.5 MiB. Now acknowledgements fold
    into one write per interval, attempts count their receivers, the list holds the
    failing receivers first and at most 100, and every write stays under 256 KiB."""
    kube, events = FakeKube(), []  # type: ignore[var-annotated]
    rec = recorder(kube, events, min_interval_s=0.2)
    names = tuple(f"rollout-{i:04d}" for i in range(1000))
    history: list[AttemptResult] = []
    started = time.monotonic()
    for k in range(32):
        a = Attempt(transition=Transition(base_version=1, target_version=2),
                    mode="mixed" if k == 0 else "overwrite", receivers=names,
                    deadline=time.time() + 60, id=f"a-{k:012x}")
        history.append(AttemptResult(attempt=a.id, mode=a.mode, receivers=names))
        for i, name in enumerate(names):
            rx = TrackedReceiver(ScaleReceiver(name, refuse=i % 100 == 7), rec,  # type: ignore[arg-type]
                                 lambda x: rec.attempt_started(x, history))
            rx.prepare(a)
            with contextlib.suppress(AgentError):
                rx.flush(a)
        history[-1].outcome = "failed: " + "; ".join(f"{n} refused" for n in names[7::100])
        rec.sync(history)
        rec.flush()
    elapsed = time.monotonic() - started
    rec.flush()
    writes = [body for _, body in kube.patches]
    assert len(writes) <= 32 * 3 + 2 + elapsed / 0.2, len(writes)
    assert max(len(json.dumps(b)) for b in writes) < 256 * 1024
    status = writes[-1]["status"]
    assert status["receiverCount"] == 1000
    assert {s["state"]: s["count"] for s in status["receiverStates"]} == {
        "flushed": 990, "flush failed": 10}
    listed = status["receivers"]
    assert len(listed) == 100
    assert [r["name"] for r in listed[:10]] == list(names[7::100])  # the failing ones first
    assert all("error" in r for r in listed[:10])
    assert all(a["receiverCount"] == 1000 for a in status["attempts"][1:])
    assert len(status["attempts"]) == 33  # the resumed refit's abandoned one, and 32
    applying = next(c for c in status["conditions"] if c["type"] == "Applying")
    assert applying["message"].endswith("rollout-0009 and 990 more.")


def test_an_attempt_committed_before_the_operator_restarted_is_reported_committed() -> None:
    """The operator stopped between its compare-and-set and writing the attempt's outcome:
    the next one starts with the attempt Running (Abandoned), finds the record naming it,
    and the refit's status says that attempt committed, as the record does."""
    kube, events = FakeKube(), []  # type: ignore[var-annotated]
    rec = recorder(kube, events)
    assert rec.status()["attempts"][0]["outcome"] == "Abandoned"
    run = RefitRun(kube, REFIT, settings=OperatorSettings(encoder_image="img:1"),  # type: ignore[arg-type]
                   emit=lambda _obj, t, r, m: events.append((t, r, m)),
                   clock=lambda: "2025-01-01T00:00:00Z")
    spec = WeightRefitSpec.model_validate({"fleet": "f", "baseVersion": 1, "targetVersion": 2,
                                           "source": {"checkpoint": "/ckpt/v2"}})
    record = CommitRecord(committed_version=2, baseline_id="/ckpt/v2", attempt="a-old")
    assert run._committed(rec, spec, record, {"metadata": {"name": "f"}}) == "Committed"
    written = kube.patches[-1][1]["status"]
    assert [(a["id"], a["outcome"], a.get("reason")) for a in written["attempts"]] == [
        ("a-old", "Committed", None)]
    assert written["committed"]["attempt"] == "a-old"
