"""A refit's progress as WeightRefit status and Kubernetes Events, as it happens.

:class:`Recorder` is told what happens and merge-patches the status it implies. Writing it is
best effort: a failed write is logged and the next carries everything (the fleet's commit
record, not this status, is the truth). Events mark transitions only.

The status stays small and is written a few times per refit, however many receivers a
fleet has: a stage (an attempt starting, an encoder, an outcome) writes at once, while
receivers' acknowledgements are folded into one write per ``min_interval_s``; receivers
are counted by state and listed only up to :data:`~dcr_operator.reconcile.RECEIVERS_SHOWN`
(failing ones first), attempts count theirs, and messages name a few
(docs/monitoring.md, "Watch it").
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ParamSpec, TypeVar, cast

from dcr.format.payload import Mode
from dcr.protocol.agent_api import AgentApi, AgentError, Call, FlushAck
from dcr.protocol.coordinator import AttemptResult, ReceiverHandle
from dcr.protocol.records import Attempt
from dcr.protocol.states import AttemptOutcome, ReceiverStep
from dcr.protocol.states import AttemptState as S
from dcr_operator.api.common import GROUP, VERSION
from dcr_operator.api.conditions import RefitCondition, RefitReason
from dcr_operator.api.weightrefit import PLURAL as REFIT_PLURAL
from dcr_operator.errors import ApiError, ApiUnreachable
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.metrics import METRICS
from dcr_operator.reconcile import (
    RECEIVERS_SHOWN,
    abandoned,
    agent_failure,
    attempt_status,
    phase_of,
    reason_of,
    set_condition,
    some_names,
)

log = logging.getLogger(__name__)
RUNNING = AttemptOutcome.RUNNING
P = ParamSpec("P")
R = TypeVar("R")

# (object, event type "Normal" | "Warning", reason, message)
Emit = Callable[[Mapping[str, Any], str, str, str], None]


class Recorder:
    """The status of one WeightRefit while the operator works on it; thread-safe."""

    def __init__(self, kube: KubeClient, refit: Mapping[str, Any], *, emit: Emit,
                 clock: Callable[[], str], forced_mode: Mode | None = None,
                 min_interval_s: float = 1.0) -> None:
        self.kube, self.refit, self.emit, self.clock = kube, refit, emit, clock
        self.forced_mode, self.min_interval_s = forced_mode, min_interval_s
        self._written = -float("inf")  # time.monotonic() of the last write
        self._timer: threading.Timer | None = None  # a write folding acknowledgements
        self._refused: set[int] = set()  # HTTP statuses of refused writes already told
        meta = refit["metadata"]
        self.path = api_path(GROUP, VERSION, REFIT_PLURAL, meta["namespace"], meta["name"],
                             "status")
        self.generation = meta.get("generation")
        self.namespace = meta["namespace"]
        self.fleet = str((refit.get("spec") or {}).get("fleet", ""))  # as written: metrics
        st = refit.get("status") or {}
        at = clock()
        self.conditions: list[dict[str, Any]] = [dict(c) for c in st.get("conditions") or []]
        self.attempts: dict[str, dict[str, Any]] = {
            a["id"]: a for a in abandoned(st.get("attempts") or [], at=at)}
        self.receivers: dict[str, dict[str, Any]] = {
            r["name"]: dict(r) for r in st.get("receivers") or []}
        self.extra: dict[str, Any] = {"startTime": st.get("startTime") or at}
        for key in ("committed", "completionTime"):
            if st.get(key):
                self.extra[key] = st[key]
        self.jobs: dict[str, str] = {}
        self.endpoints: dict[str, str] = {}  # attempt -> encoder profile with an endpoint
        self.payloads: dict[str, int] = {}
        self._started: set[str] = set()
        self._lock = threading.RLock()

    # --- what happened ---------------------------------------------------------------

    def set(self, type_: str, status: bool, reason: str, message: str = "", *,
            event: str | None = None, warning: bool = False) -> None:
        """Set a condition; emit ``event`` as a reason when its status changes."""
        with self._lock:
            before = next((c.get("status") for c in self.conditions if c["type"] == type_),
                          None)
            self.conditions = set_condition(self.conditions, type_, status, reason, message,
                                            at=self.clock(), generation=self.generation)
            changed = before != ("True" if status else "False")
        if event and changed:
            self.emit(self.refit, "Warning" if warning else "Normal", event, message)

    def previous_attempts(self) -> int:
        with self._lock:
            return len(self.attempts)

    def attempt_started(self, attempt: Attempt, history: Sequence[AttemptResult]) -> None:
        """Called by every receiver's prepare: the first call records the attempt."""
        mode = self.forced_mode or attempt.mode
        with self._lock:
            if attempt.id in self._started:
                return
            self._started.add(attempt.id)
            self.attempts[attempt.id] = {
                "id": attempt.id, "mode": mode, "outcome": AttemptOutcome.RUNNING,
                "startTime": self.clock(), "receiverCount": len(attempt.receivers)}
        log.info("%s: attempt %s (%s) on receivers %s", self.path, attempt.id, mode,
                 ", ".join(attempt.receivers))
        self.sync(history)
        left_out = next((h.left_out for h in history if h.attempt == attempt.id), ())
        without = (f" Left out, not answering: {some_names(left_out)}; they rejoin the "
                   "committed version later." if left_out else "")
        self.set(RefitCondition.APPLYING, True, RefitReason.ATTEMPT_RUNNING,
                 f"Attempt {attempt.id} ({mode}) of {attempt.transition.base_version} -> "
                 f"{attempt.transition.target_version} on {len(attempt.receivers)} receivers: "
                 f"{some_names(attempt.receivers)}.{without}", event="AttemptStarted")
        self.flush()

    def job_created(self, attempt: Attempt, job: str) -> None:
        with self._lock:
            self.jobs[attempt.id] = job
            if attempt.id in self.attempts:
                self.attempts[attempt.id]["job"] = job
        self.set(RefitCondition.ENCODING, True, RefitReason.ENCODER_JOB_RUNNING,
                 f"Encoder Job {job} publishes attempt {attempt.id} ({attempt.mode}).",
                 event="EncoderJobCreated")
        self.flush()

    def job_finished(self, attempt: Attempt, job: str, failure: str | None) -> None:
        if failure is None:
            self.set(RefitCondition.ENCODING, False, RefitReason.ENCODER_JOB_SUCCEEDED,
                     f"Encoder Job {job} published attempt {attempt.id}.")
        else:
            self.set(RefitCondition.ENCODING, False, RefitReason.ENCODER_JOB_FAILED,
                     f"Encoder Job {job} of attempt {attempt.id} failed: {failure}.",
                     event=RefitReason.ENCODER_JOB_FAILED, warning=True)
        self.flush()

    def endpoint_started(self, attempt: Attempt, profile: str) -> None:
        """The attempt publishes through the warm encoders of ``profile`` (no Job)."""
        with self._lock:
            self.endpoints[attempt.id] = profile
            if attempt.id in self.attempts:
                self.attempts[attempt.id]["endpoint"] = profile
        self.set(RefitCondition.ENCODING, True, RefitReason.ENCODER_ENDPOINT_RUNNING,
                 f"The warm encoders of profile {profile} publish attempt {attempt.id} "
                 f"({attempt.mode}).", event="EncoderEndpointCalled")
        self.flush()

    def endpoint_finished(self, attempt: Attempt, profile: str, failure: str | None) -> None:
        if failure is None:
            self.set(RefitCondition.ENCODING, False, RefitReason.ENCODER_ENDPOINT_SUCCEEDED,
                     f"The warm encoders of profile {profile} published attempt "
                     f"{attempt.id}.")
        else:
            self.set(RefitCondition.ENCODING, False, RefitReason.ENCODER_ENDPOINT_FAILED,
                     f"A warm encoder of profile {profile} failed attempt {attempt.id}: "
                     f"{failure}", event=RefitReason.ENCODER_ENDPOINT_FAILED, warning=True)
        self.flush()

    def receiver(self, name: str, **fields: Any) -> None:
        with self._lock:
            entry = self.receivers.setdefault(name, {"name": name})
            for key, value in fields.items():
                if value is None:
                    entry.pop(key, None)
                else:
                    entry[key] = value

    def flushed(self, name: str, attempt: str, ack: FlushAck) -> None:
        """Receiver ``name`` flushed ``attempt`` (the id we sent, not one it answered)."""
        with self._lock:
            self.payloads[attempt] = max(self.payloads.get(attempt, 0), ack.payloads)
        self.receiver(name, attempt=attempt, state=S.FLUSHED.value, payloads=ack.payloads,
                      bytes=ack.bytes, applySeconds=round(ack.apply_s, 4),
                      lastAck=self.clock(), error=None)
        self.flush(soon=True)

    def sync(self, history: Sequence[AttemptResult]) -> None:
        """Fold the coordinator's attempts (outcomes, stages, bytes) into the status."""
        failed = []
        with self._lock:
            for result in history:
                old = self.attempts.get(result.attempt, {})
                end = old.get("completionTime")
                if result.outcome != "running" and end is None:
                    end = self.clock()
                new = self.attempts[result.attempt] = attempt_status(
                    result, start=old.get("startTime") or self.clock(), end=end,
                    payloads=self.payloads.get(result.attempt, 0),
                    job=self.jobs.get(result.attempt, old.get("job")),
                    mode=self.forced_mode,
                    endpoint=self.endpoints.get(result.attempt, old.get("endpoint")))
                if new["outcome"] != RUNNING and old.get("outcome") in (None, RUNNING):
                    METRICS.attempt_ended(result, namespace=self.namespace, fleet=self.fleet,
                                          mode=str(new["mode"]), outcome=str(new["outcome"]))
                    if new["outcome"] in (AttemptOutcome.FAILED, AttemptOutcome.CONFLICT):
                        failed.append(new)
        for a in failed:
            self.emit(self.refit, "Warning", "AttemptFailed",
                      f"Attempt {a['id']} ({a['mode']}) {a['outcome'].lower()}: "
                      f"{a.get('reason', '')}")

    def committed_by(self, attempt: str) -> None:
        """The commit record names ``attempt``: it committed, though a previous operator,
        stopped between its compare-and-set and writing the outcome, left it Running
        (and so Abandoned when this one started)."""
        with self._lock:
            a = self.attempts.get(attempt)
            if a is not None and a.get("outcome") != AttemptOutcome.COMMITTED:
                a.pop("reason", None)
                a["outcome"] = AttemptOutcome.COMMITTED

    def finish(self, **fields: Any) -> None:
        with self._lock:
            self.extra.update(fields)

    # --- the status ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._lock:
            attempts = list(self.attempts.values())
            receivers = sorted(self.receivers.values(),
                               key=lambda r: (r.get("error") is None, r["name"]))
            states = Counter(str(r.get("state", "")) for r in receivers)
            return {
                "observedGeneration": self.generation,
                "phase": phase_of(self.conditions),
                "reason": reason_of(self.conditions),
                "conditions": [dict(c) for c in self.conditions],
                "attempts": [dict(a) for a in attempts],
                "attemptCount": len(attempts),
                "bytes": sum(int(a.get("bytes", 0)) for a in attempts),
                "receivers": [dict(r) for r in receivers[:RECEIVERS_SHOWN]],
                "receiverCount": len(receivers),
                "receiverStates": [{"state": k, "count": n} for k, n in sorted(states.items())],
                **self.extra,
            }

    def flush(self, *, soon: bool = False) -> None:
        """Write the status now; with ``soon`` (a receiver's acknowledgement), at most
        ``min_interval_s`` after the last write, one write carrying every update since."""
        with self._lock:
            if soon:
                wait_s = self._written + self.min_interval_s - time.monotonic()
                if wait_s > 0:
                    if self._timer is None:
                        self._timer = threading.Timer(wait_s, self._write_folded)
                        self._timer.daemon = True
                        self._timer.start()
                    return
            self._write()

    def _write_folded(self) -> None:
        with self._lock:
            if self._timer is not None:  # else a write since carried these updates
                self._write()

    def _write(self) -> None:
        """One merge patch of the whole status (under the lock: writes never reorder)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._written = time.monotonic()
        body = {"status": {k: v for k, v in self.status().items() if v is not None}}
        try:
            self.kube.merge_patch(self.path, body)
        except ApiUnreachable as e:
            log.warning("could not write the status of %s: %s", self.path, e)
        except ApiError as e:
            log.error("the API server refused the status of %s (HTTP %d): %s", self.path,
                      e.status, e)
            if e.status not in self._refused:  # say so where users look, once per kind
                self._refused.add(e.status)
                self.emit(self.refit, "Warning", "StatusNotWritten",
                          f"The API server refused this refit's status with HTTP "
                          f"{e.status} ({len(json.dumps(body))} bytes); the operator's log says "
                          "why, and the fleet's commit record stays the truth.")


@dataclass(frozen=True, kw_only=True)
class Step:
    """How one agent call shows in its receiver's entry of the WeightRefit status."""

    label: str  # a failure shows as state "<label> failed" with the error
    before: Mapping[str, Any] = field(default_factory=dict)  # fields set before the call
    after: Mapping[str, Any] = field(default_factory=dict)  # fields set once it returned
    starts_attempt: bool = False  # tell the Recorder first; record the attempt's id after
    ack: bool = False  # the answer is a FlushAck: record its payloads, bytes and time
    event: tuple[str, str] | None = None  # (reason, message over name and the arguments)


# Keyed by the rows of dcr.protocol.agent_api.AgentApi; a call not listed here (status,
# the gates, inspection) shows only when it fails, under its own name.
FROM_STORE = "what it built from the store's history"  # a rejoin named no checkpoint
STEPS: dict[str, Step] = {
    "prepare": Step(label="prepare", starts_attempt=True, after={
        "state": S.PREPARED.value, "error": None, "payloads": 0, "bytes": 0}),
    "open_apply": Step(label="open_apply", after={"state": S.APPLYING.value}),
    "wait_staged": Step(label="wait_staged", after={"state": S.STAGED.value}),
    "flush": Step(label="flush", ack=True),
    "committed": Step(label="commit", after={"state": S.COMMITTED.value}),
    "stop_and_wait": Step(label="stop", after={"state": ReceiverStep.STOPPED}),
    "rejoin": Step(label="rejoin", before={"state": ReceiverStep.REJOINING},
                   after={"state": ReceiverStep.REJOINED, "error": None},
                   event=("ReceiverRejoined", "Receiver {name} restored version {0} by a "
                          "dense load of {1}.")),
}


class TrackedReceiver(AgentApi):
    """A ``ReceiverHandle`` that reports every step and error of one agent to a Recorder.

    Every row of the agent API is a method (from :class:`AgentApi`); :data:`STEPS` says
    what each one writes. A forced mode replaces the mode of every attempt passed on.
    A failed call is recorded, and raised on to the coordinator (whose attempt reasons
    become status too), in the words of :func:`~dcr_operator.reconcile.agent_failure`.
    """

    def __init__(self, inner: ReceiverHandle, recorder: Recorder,
                 on_attempt: Callable[[Attempt], None], *,
                 forced_mode: Mode | None = None) -> None:
        self.inner, self.recorder, self.on_attempt = inner, recorder, on_attempt
        self.forced_mode = forced_mode
        self.name = inner.name

    def __repr__(self) -> str:
        return f"TrackedReceiver({self.inner!r})"

    def _mode(self, arg: object) -> object:
        if self.forced_mode and isinstance(arg, Attempt):
            return replace(arg, mode=self.forced_mode)
        return arg

    def _invoke(self, call: Call[P, Any, R], *args: P.args, **kwargs: P.kwargs) -> R:
        step = STEPS.get(call.name) or Step(label=call.name)
        if step.starts_attempt:
            self.on_attempt(cast(Attempt, args[0]))
        if step.before:
            self.recorder.receiver(self.name, **step.before)
        fn = getattr(self.inner, call.name)
        try:
            out: R = fn(*map(self._mode, args), **{k: self._mode(v) for k, v in kwargs.items()})
        except Exception as e:
            said = agent_failure(self.name, call, e)
            self.recorder.receiver(self.name, state=ReceiverStep.failed(step.label),
                                   error=said[:1024])
            if said == str(e):
                raise
            log.info("receiver %s: %s failed: %r", self.name, call.name, e)
            raise AgentError(said, getattr(e, "status", None), getattr(e, "kind", "")) from e
        if step.after:
            extra = {"attempt": cast(Attempt, args[0]).id} if step.starts_attempt else {}
            self.recorder.receiver(self.name, **extra, **step.after)
        if step.ack:
            self.recorder.flushed(self.name, cast(Attempt, args[0]).id, cast(FlushAck, out))
        if step.event is not None:
            reason, message = step.event
            shown = [FROM_STORE if a is None else a for a in args]  # rejoin from the store
            self.recorder.emit(self.recorder.refit, "Normal", reason,
                               message.format(*shown, name=self.name))
        return out
