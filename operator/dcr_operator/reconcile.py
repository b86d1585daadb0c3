"""The operator's decisions as pure functions: testable without a cluster.

* :func:`validate`: may this WeightRefit run against the fleet's commit record now, and if
  not, why (a condition reason and a sentence with the values)?
* :func:`set_condition`, :func:`phase_of`, :func:`reason_of`: condition bookkeeping; the
  printer's phase and reason.
* :func:`receivers_of`: the selected pods that are Running, addressed only by pod IP;
  with ``spec.groups``, one receiver per complete group, through its leader
  (:func:`groups_of`).
* :func:`secret_holders`: the selected pods handed a given Secret (the store's write key).
* :func:`agent_failure`, :func:`agent_report`: status about an agent in our own words,
  never text the agent sent.
* :func:`attempt_status`, :func:`fleet_conditions`: attempts and fleet conditions as status.
* :func:`expired_refits`: the finished WeightRefits a fleet's history limits let go.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from dcr.errors import HttpError
from dcr.format.names import ATTEMPT_RE
from dcr.protocol.agent_api import AgentStatus, Call
from dcr.protocol.coordinator import AttemptResult
from dcr.protocol.records import CommitRecord
from dcr.protocol.states import FINAL_PHASES, AttemptOutcome, AttemptState, Phase
from dcr_operator.api.conditions import FleetCondition, FleetReason, RefitCondition, RefitReason
from dcr_operator.api.rolloutfleet import AgentSpec, LabelSelector, ReplicaGroups
from dcr_operator.api.weightrefit import WeightRefitSpec


def now() -> str:
    """The current time as the API server writes it (RFC 3339, UTC, seconds)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


# --- conditions -----------------------------------------------------------------------


def condition(conditions: Iterable[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: Iterable[Mapping[str, Any]], type_: str) -> bool:
    c = condition(conditions, type_)
    return c is not None and c.get("status") == "True"


def set_condition(conditions: Sequence[Mapping[str, Any]], type_: str, status: bool | str,
                  reason: str, message: str = "", *, at: str,
                  generation: int | None = None) -> list[dict[str, Any]]:
    """A copy of ``conditions`` with ``type_`` set; its transition time moves only on change."""
    value = status if isinstance(status, str) else ("True" if status else "False")
    out = [dict(c) for c in conditions if c.get("type") != type_]
    old = condition(conditions, type_)
    new: dict[str, Any] = {"type": type_, "status": value, "reason": reason, "message": message,
                           "lastTransitionTime": at}
    if old is not None and old.get("status") == value and old.get("lastTransitionTime"):
        new["lastTransitionTime"] = old["lastTransitionTime"]
    if generation is not None:
        new["observedGeneration"] = generation
    index = next((i for i, c in enumerate(conditions) if c.get("type") == type_), len(out))
    out.insert(index, new)
    return out


# The order decides: the first true condition names the phase. Receivers apply while the
# encoders still publish, so the phase reads Encoding until the encoder Job is done.
_PHASES: tuple[tuple[str, Phase], ...] = (
    (RefitCondition.COMMITTED, Phase.COMMITTED), (RefitCondition.FAILED, Phase.FAILED),
    (RefitCondition.ENCODING, Phase.ENCODING), (RefitCondition.APPLYING, Phase.APPLYING),
)


def phase_of(conditions: Iterable[Mapping[str, Any]]) -> Phase:
    """The WeightRefit phase its conditions imply (Pending until one of them is true)."""
    conditions = list(conditions)
    return next((phase for type_, phase in _PHASES if is_true(conditions, type_)),
                Phase.PENDING)


# While Pending, the reason of the first of these conditions that is set says what the
# refit waits for (receivers, or its base version, fleet or encoder profile).
_WAITING: tuple[str, ...] = (RefitCondition.APPLYING, RefitCondition.VALIDATED)


def reason_of(conditions: Iterable[Mapping[str, Any]]) -> str | None:
    """The reason the REASON printer column shows: that of the condition naming the phase
    (Failed's when the refit failed), or while Pending that of what it waits for."""
    conditions = list(conditions)
    by_type = {c.get("type"): c for c in conditions}
    named = next((type_ for type_, _ in _PHASES if is_true(conditions, type_)), None)
    order = (named,) if named is not None else _WAITING
    return next((str(by_type[t]["reason"]) for t in order
                 if t in by_type and by_type[t].get("reason")), None)


def is_final(phase: str | None) -> bool:
    return phase in FINAL_PHASES


# --- validation -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What to do with a WeightRefit now: run it, finish a commit, wait, or reject it."""

    action: Literal["run", "finish", "wait", "reject"]
    reason: str
    message: str


def validate(name: str, spec: WeightRefitSpec, fleet: str, record: CommitRecord, *,
             created: str | None = None, at: str | None = None) -> Verdict:
    """Check a WeightRefit against the fleet's commit record (and its deadline)."""
    target, base = spec.target_version, spec.base_version
    held = (f"RolloutFleet {fleet} has committed version {record.committed_version} "
            f"(checkpoint {record.baseline_id}"
            + (f", attempt {record.attempt})" if record.attempt else ")"))
    if record.committed_version == target and record.baseline_id == spec.source.checkpoint:
        return Verdict(action="finish", reason=RefitReason.ALREADY_COMMITTED,
                       message=f"{held}: this refit's target is committed.")
    if created is not None and spec.deadline_seconds is not None and at is not None:
        age = (parse_time(at) - parse_time(created)).total_seconds()
        if age > spec.deadline_seconds:
            return Verdict(action="reject", reason=RefitReason.DEADLINE_EXCEEDED,
                           message=f"WeightRefit {name} is {age:.0f} s old, past its deadline "
                                   f"of {spec.deadline_seconds} s; no attempt starts.")
    if record.committed_version == base:
        return Verdict(action="run", reason=RefitReason.BASE_VERSION_COMMITTED,
                       message=f"{held}: refitting {base} -> {target} from "
                               f"{spec.source.checkpoint}.")
    if record.committed_version < base:
        return Verdict(action="wait", reason=RefitReason.WAITING_FOR_BASE_VERSION,
                       message=f"WeightRefit {name} refits {base} -> {target}, but {held}; "
                               f"waiting until version {base} is committed.")
    if record.committed_version == target:
        return Verdict(action="reject", reason=RefitReason.TARGET_COMMITTED_ELSEWHERE,
                       message=f"WeightRefit {name} refits {base} -> {target} from "
                               f"{spec.source.checkpoint}, but {held}: version {target} was "
                               "committed from another checkpoint.")
    return Verdict(action="reject", reason=RefitReason.BASE_VERSION_MISMATCH,
                   message=f"WeightRefit {name} refits {base} -> {target}, but {held}; a "
                           f"refit must start from the committed version "
                           f"(baseVersion {record.committed_version}).")


# --- receivers ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Receiver:
    name: str  # the pod's name (a group's: its leader pod's)
    url: str
    pods: tuple[str, ...] = ()  # a group's pods, its leader first; () for a single pod


@dataclass(frozen=True)
class Incomplete:
    """A group that cannot take part now: named by its leader (else its first pod), with
    its pods and a sentence saying why."""

    name: str
    pods: tuple[str, ...]
    reason: str


def selector_query(selector: LabelSelector) -> str:
    """A label selector in the ``labelSelector`` query syntax."""
    parts = [f"{k}={v}" for k, v in sorted((selector.match_labels or {}).items())]
    for e in selector.match_expressions or []:
        values = ",".join(e.values or [])
        parts.append({"In": f"{e.key} in ({values})", "NotIn": f"{e.key} notin ({values})",
                      "Exists": e.key, "DoesNotExist": f"!{e.key}"}[e.operator])
    return ",".join(parts)


def agent_url(pod_ip: object, agent: AgentSpec) -> str | None:
    """``<scheme>://<podIP>:<port>``; None unless ``pod_ip`` is an IP address."""
    try:
        ip = ipaddress.ip_address(str(pod_ip))
    except ValueError:
        return None
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"{agent.scheme}://{host}:{agent.port}"


def _live(pod: Mapping[str, Any]) -> bool:
    return not (pod.get("metadata") or {}).get("deletionTimestamp")


def _running(pod: Mapping[str, Any]) -> bool:
    return _live(pod) and (pod.get("status") or {}).get("phase") == "Running"


def receivers_of(pods: Iterable[Mapping[str, Any]], agent: AgentSpec,
                 groups: ReplicaGroups | None = None) -> list[Receiver]:
    """Every Running, not terminating pod with an IP as a receiver, sorted by name; with
    ``groups``, one receiver per complete group (:func:`groups_of`)."""
    if groups is not None:
        return groups_of(pods, agent, groups)[0]
    out = []
    for pod in pods:
        url = agent_url((pod.get("status") or {}).get("podIP"), agent)
        if _running(pod) and url:
            out.append(Receiver(name=pod["metadata"]["name"], url=url))
    return sorted(out, key=lambda r: r.name)


def groups_of(pods: Iterable[Mapping[str, Any]], agent: AgentSpec, groups: ReplicaGroups
              ) -> tuple[list[Receiver], list[Incomplete]]:
    """The selected pods as groups (by their ``groups.label`` value): a group is a receiver,
    reached at its leader's IP, while it has exactly ``groups.size`` pods that are not
    terminating, all Running, one of them its leader. Every other group, and every pod
    without the label, is :class:`Incomplete`, saying why. Both sorted by name.

    Any pod matching the selector can carry a group's label: a group with more pods or
    more leaders than it should have is refused, never guessed at.
    """
    members: dict[str, list[Mapping[str, Any]]] = {}
    incomplete: list[Incomplete] = []
    for pod in filter(_live, pods):
        name = pod["metadata"]["name"]
        key = ((pod["metadata"].get("labels")) or {}).get(groups.label)
        if key is None:
            incomplete.append(Incomplete(name=name, pods=(name,), reason=(
                f"Pod {name} carries no label {groups.label}: it is in no group "
                "(spec.groups.label).")))
        else:
            members.setdefault(key, []).append(pod)
    out: list[Receiver] = []
    for key, group in members.items():
        leaders = [p for p in group if (p["metadata"].get("labels") or {}).get(
            groups.leader_label) == groups.leader_value]
        ordered = sorted(group, key=lambda p: (p not in leaders, p["metadata"]["name"]))
        names = tuple(p["metadata"]["name"] for p in ordered)
        running = sum(map(_running, group))
        url = agent_url((ordered[0].get("status") or {}).get("podIP"), agent)
        where = f"Group {key} ({', '.join(names)})"
        if len(leaders) != 1:
            reason = (f"{where} has {len(leaders)} leader pods ({groups.leader_label}="
                      f"{groups.leader_value}); a group has exactly one.")
        elif len(group) > groups.size:
            reason = f"{where} has {len(group)} pods; spec.groups.size is {groups.size}."
        elif running < groups.size:
            reason = (f"{where} has {running} of its {groups.size} pods Running; it takes "
                      "part once all are.")
        elif url is None:
            reason = f"{where}: its leader pod {names[0]} has no IP address."
        else:
            out.append(Receiver(name=names[0], url=url, pods=names))
            continue
        incomplete.append(Incomplete(name=names[0], pods=names, reason=reason))
    return (sorted(out, key=lambda r: r.name), sorted(incomplete, key=lambda g: g.name))


NAMES_SHOWN = 10  # pod names in a condition or Event message; a count says how many in all
RECEIVERS_SHOWN = 100  # receivers listed in a status; counts cover the rest


def some_names(names: Sequence[str]) -> str:
    """``a, b, c`` or, past :data:`NAMES_SHOWN`, the first ones ``and N more``: a message
    stays short however many receivers a fleet has."""
    shown = ", ".join(names[:NAMES_SHOWN])
    more = len(names) - NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def _secrets_of(spec: Mapping[str, Any]) -> set[str]:
    """Every Secret a pod spec hands to its containers: ``envFrom``, an ``env`` value, a
    secret volume, a projected volume's secret source."""
    refs: list[Any] = []
    for key in _CONTAINER_LISTS:
        for c in spec.get(key) or []:
            refs += [(f.get("secretRef") or {}).get("name") for f in c.get("envFrom") or []]
            refs += [((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
                     for e in c.get("env") or []]
    for v in spec.get("volumes") or []:
        refs.append((v.get("secret") or {}).get("secretName"))
        refs += [(s.get("secret") or {}).get("name")
                 for s in (v.get("projected") or {}).get("sources") or []]
    return {r for r in refs if isinstance(r, str)}


def secret_holders(pods: Iterable[Mapping[str, Any]], secret: str) -> list[str]:
    """The pods (any phase) whose spec hands Secret ``secret`` to a container, by name."""
    return sorted(p["metadata"]["name"] for p in pods
                  if secret in _secrets_of(p.get("spec") or {}))


_KIND = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")  # an error kind worth showing: a class name
_STATES = frozenset(s.value for s in AttemptState)


def agent_failure(name: str, call: Call[..., Any, Any], e: BaseException) -> str:
    """What status and Events say about a failed agent call (:func:`remote_failure`)."""
    return remote_failure(f"Agent {name} ({call.method} {call.path})", e)


def remote_failure(what: str, e: BaseException) -> str:
    """What status and Events say about a failed call to a peer (an agent, a warm
    encoder): a sentence of our own.

    An error body or a malformed answer is whatever answers at the peer's address chose
    to send, and status is read by many more people than the logs: only the call, the
    HTTP status and a well-formed error kind are shown. An :class:`HttpError` without a
    status (no answer) is the client's own sentence (the URL we built, our side's
    reason); anything else raised in process is shown as it is.
    """
    status = e.status if isinstance(e, HttpError) else None
    if status is not None:
        if 300 <= status < 400:
            return f"{what} answered HTTP {status}, a redirect, which is never followed."
        kind = getattr(e, "kind", "")
        shown = f" ({kind})" if isinstance(kind, str) and _KIND.fullmatch(kind) else ""
        return f"{what} was refused with HTTP {status}{shown}."
    if isinstance(e, ValidationError):
        return f"{what} answered with a body that is not a valid answer to that call."
    return str(e)


def agent_report(st: AgentStatus) -> dict[str, Any]:
    """An agent's ``/v1/status`` as fleet status: numbers, and words only from our lists."""
    attempt = st.attempt if st.attempt and ATTEMPT_RE.fullmatch(st.attempt) else None
    out: dict[str, Any] = {"version": st.version, "attempt": attempt,
                           "state": st.state if st.state in _STATES else None}
    if st.error:
        out["error"] = (f"The agent reports that attempt {attempt or '(unnamed)'} failed "
                        "(its GET /v1/status and log say why).")
    return out


# --- status ---------------------------------------------------------------------------

# The first word of a coordinator's AttemptResult.outcome; any other shows as Failed.
OUTCOMES = {"running": AttemptOutcome.RUNNING, "committed": AttemptOutcome.COMMITTED,
            "failed": AttemptOutcome.FAILED, "conflict": AttemptOutcome.CONFLICT}


def attempt_status(result: AttemptResult, *, start: str, end: str | None, payloads: int,
                   job: str | None, mode: str | None = None,
                   endpoint: str | None = None) -> dict[str, Any]:
    """One coordinator attempt as a WeightRefit ``status.attempts`` entry."""
    word, _, reason = result.outcome.partition(": ")
    out: dict[str, Any] = {
        "id": result.attempt, "mode": mode or result.mode,
        "outcome": OUTCOMES.get(word, AttemptOutcome.FAILED), "startTime": start,
        "stages": {k: round(v, 4) for k, v in result.stages.items()},
        "payloads": payloads, "bytes": result.payload_bytes,
        "receiverCount": len(result.receivers),
        "rejoined": list(result.rejoined[:RECEIVERS_SHOWN]),
        "leftOut": list(result.left_out[:RECEIVERS_SHOWN]),
    }
    if reason:
        out["reason"] = reason[:2048]
    if end is not None:
        out["completionTime"] = end
    if job is not None:
        out["job"] = job
    if endpoint is not None:
        out["endpoint"] = endpoint
    return out


def abandoned(attempts: Iterable[Mapping[str, Any]], *, at: str) -> list[dict[str, Any]]:
    """Attempts a previous operator left Running: obsolete now (the protocol retries)."""
    out = []
    for a in attempts:
        a = dict(a)
        if a.get("outcome") == AttemptOutcome.RUNNING:
            a.update(outcome=AttemptOutcome.ABANDONED, completionTime=at,
                     reason="the operator restarted during this attempt")
        out.append(a)
    return out


def fleet_conditions(conditions: Sequence[Mapping[str, Any]], *, record: CommitRecord,
                     receivers: Sequence[Mapping[str, Any]], active: str | None, at: str,
                     generation: int | None, write_secret: str | None = None,
                     write_holders: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Ready (every receiver reports the committed version), Progressing, Degraded, and
    ReceiversReadOnly where the fleet names the store's ``write_secret``: False while
    ``write_holders`` (selected pods) are handed it."""
    v = record.committed_version
    behind = sorted(r["name"] for r in receivers if r.get("version") != v or r.get("error"))
    count = len(receivers)
    out: list[dict[str, Any]] = [dict(c) for c in conditions]
    if not count:
        out = set_condition(out, FleetCondition.READY, False, FleetReason.NO_RECEIVERS,
                            "The selector matches no Running pod.", at=at, generation=generation)
    elif behind:
        out = set_condition(out, FleetCondition.READY, False, FleetReason.RECEIVERS_BEHIND,
                            f"{len(behind)} of {count} receivers do not report version {v}: "
                            f"{some_names(behind)}.", at=at, generation=generation)
    else:
        out = set_condition(out, FleetCondition.READY, True, FleetReason.ALL_RECEIVERS_COMMITTED,
                            f"All {count} receivers report version {v}.", at=at,
                            generation=generation)
    out = set_condition(out, FleetCondition.PROGRESSING, active is not None,
                        FleetReason.REFIT_RUNNING if active else FleetReason.IDLE,
                        f"WeightRefit {active} is running." if active else "No refit is running.",
                        at=at, generation=generation)
    unreachable = sorted(r["name"] for r in receivers if r.get("error"))
    out = set_condition(out, FleetCondition.DEGRADED, bool(unreachable),
                        (FleetReason.RECEIVERS_UNREACHABLE if unreachable
                         else FleetReason.ALL_RECEIVERS_REACHABLE),
                        (f"Receivers whose agent does not answer, or whose group is incomplete: "
                         f"{some_names(unreachable)}." if unreachable
                         else "Every receiver's agent answers."), at=at, generation=generation)
    if write_secret is not None:
        out = _read_only(out, write_secret, write_holders, at=at, generation=generation)
    return out


def _read_only(conditions: Sequence[Mapping[str, Any]], secret: str, holders: Sequence[str],
               *, at: str, generation: int | None) -> list[dict[str, Any]]:
    if not holders:
        return set_condition(
            conditions, FleetCondition.RECEIVERS_READ_ONLY, True,
            FleetReason.NO_POD_HOLDS_WRITE_CREDENTIALS,
            f"No selected pod is handed Secret {secret}, the store's write credentials.",
            at=at, generation=generation)
    return set_condition(
        conditions, FleetCondition.RECEIVERS_READ_ONLY, False,
        FleetReason.PODS_HOLD_WRITE_CREDENTIALS,
        f"{len(holders)} selected {'pods are' if len(holders) > 1 else 'pod is'} handed "
        f"Secret {secret}, the store's write credentials (spec.store.credentialsSecretRef): "
        f"{some_names(holders)}. Whoever controls one can choose the weights; give rollout "
        "pods a read-only key (docs/operations.md, \"A read-only key for receivers\").",
        at=at, generation=generation)


# --- refit history ---------------------------------------------------------------------


def expired_refits(refits: Iterable[Mapping[str, Any]], fleet: str, *, keep: int,
                   ttl_s: int | None, at: str) -> list[str]:
    """Names of ``fleet``'s finished WeightRefits to delete: all but the newest ``keep``
    (by completionTime, else creation), and any finished more than ``ttl_s`` before ``at``.
    A refit still running is never among them."""
    finished = []
    for r in refits:
        st, meta = r.get("status") or {}, r.get("metadata") or {}
        if (r.get("spec") or {}).get("fleet") != fleet or not is_final(st.get("phase")):
            continue
        ended = st.get("completionTime") or meta.get("creationTimestamp") or at
        finished.append((parse_time(ended), str(meta.get("name", ""))))
    finished.sort(reverse=True)  # newest first
    limit = parse_time(at) - dt.timedelta(seconds=ttl_s) if ttl_s is not None else None
    return sorted(name for i, (ended, name) in enumerate(finished)
                  if i >= keep or (limit is not None and ended < limit))
