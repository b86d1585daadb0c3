"""A RolloutFleet's receivers: found from its pods, reached through their agents.

Each is reached at ``<agent.scheme>://<podIP>:<agent.port>`` and nowhere else, and a Secret
the fleet names is used only if it carries the label of that use (:data:`SECRET_USES`)
(docs/operations.md, "Add the agent to rollout pods"). :func:`refresh` writes the fleet's
receivers and conditions.
"""

from __future__ import annotations

import base64
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dcr.errors import ConfigError
from dcr.http.tokens import check_token
from dcr.protocol.agent_api import AgentApi, AgentClient, AgentStatus, Call
from dcr.protocol.records import CommitRecord
from dcr.protocol.state import FINAL
from dcr_operator.api.common import GROUP, VERSION, SecretKeyRef
from dcr_operator.api.rolloutfleet import PLURAL as FLEET_PLURAL
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.api.weightrefit import PLURAL as REFIT_PLURAL
from dcr_operator.errors import ApiError, InvalidResource, NotFound
from dcr_operator.fleetrecord import record_of
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.metrics import METRICS
from dcr_operator.reconcile import (
    RECEIVERS_SHOWN,
    Receiver,
    agent_failure,
    agent_report,
    expired_refits,
    fleet_conditions,
    groups_of,
    is_final,
    parse_time,
    receivers_of,
    secret_holders,
    selector_query,
)

log = logging.getLogger(__name__)


def fleet_path(namespace: str, name: str, sub: str = "") -> str:
    return api_path(GROUP, VERSION, FLEET_PLURAL, namespace, name, sub)


def selected_pods(kube: KubeClient, namespace: str, spec: RolloutFleetSpec
                  ) -> list[dict[str, Any]]:
    pods = kube.get(api_path("", "v1", "pods", namespace),
                    labelSelector=selector_query(spec.selector))
    return list(pods.get("items", []))


def discover(kube: KubeClient, namespace: str, spec: RolloutFleetSpec) -> list[Receiver]:
    """The fleet's receivers now: its Running pods, or its complete groups."""
    return receivers_of(selected_pods(kube, namespace, spec), spec.agent, spec.groups)


def write_secret(spec: RolloutFleetSpec) -> str | None:
    """The Secret the fleet names as the store's (write) credentials, if any."""
    ref = spec.store.credentials_secret_ref if spec.store is not None else None
    return ref.name if ref is not None else None


@dataclass(frozen=True, kw_only=True)
class SecretUse:
    """One use of a Secret a fleet names: the field that names it, the label it needs."""

    field: str  # where the fleet names it, for messages
    label: str  # "<label>: true" on the Secret opts it in to this use


AGENT_TOKEN = SecretUse(field="spec.agent.tokenSecretRef", label=f"{GROUP}/agent-token")
RELAY_TOKEN = SecretUse(field="spec.relay.tokenSecretRef", label=f"{GROUP}/relay-token")
RELAY_CA = SecretUse(field="spec.relay.caSecretRef", label=f"{GROUP}/relay-ca")
STORE_CREDENTIALS = SecretUse(field="spec.store.credentialsSecretRef",
                              label=f"{GROUP}/store-credentials")
ENCODER_TOKEN = SecretUse(field="spec.encoderProfiles[].endpoint.tokenSecretRef",
                          label=f"{GROUP}/encoder-token")
ENCODER_CLUSTER = SecretUse(field="spec.encoderProfiles[].cluster.kubeconfigSecretRef",
                            label=f"{GROUP}/encoder-cluster")
SECRET_USES = (AGENT_TOKEN, RELAY_TOKEN, RELAY_CA, STORE_CREDENTIALS, ENCODER_TOKEN,
               ENCODER_CLUSTER)


def read_secret(kube: KubeClient, namespace: str, name: str, use: SecretUse
                ) -> dict[str, str]:
    """The data of Secret ``name``, if it opted in to ``use``; else InvalidResource."""
    where = f"Secret {namespace}/{name} ({use.field})"
    try:
        secret = kube.get(api_path("", "v1", "secrets", namespace, name))
    except NotFound:
        raise InvalidResource(f"{where} does not exist.") from None
    except ApiError as e:
        if e.status != 403:
            raise
        raise InvalidResource(f"{where}: the operator may not read Secrets in namespace "
                              f"{namespace} (bind the chart's workloads ClusterRole there: "
                              "Helm rbac.workloadNamespaces).") from None
    labels = (secret.get("metadata") or {}).get("labels") or {}
    if labels.get(use.label) != "true":
        raise InvalidResource(f"{where} is not labelled {use.label}=true: the operator uses "
                              "a Secret only for what its label opts it in to "
                              "(docs/operations.md).")
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def bearer_token(kube: KubeClient, namespace: str, ref: SecretKeyRef, use: SecretUse,
                 what: str) -> str:
    """The checked bearer token in key ``ref.key`` of a Secret that opted in to ``use``."""
    data = read_secret(kube, namespace, ref.name, use)
    if ref.key not in data:
        raise InvalidResource(f"Secret {namespace}/{ref.name} has no key {ref.key!r} "
                              f"({use.field}.key).")
    try:  # the peers refuse a weak token; refuse it here before sending it anywhere
        return check_token(data[ref.key].strip(),
                           f"{what} in Secret {namespace}/{ref.name} key {ref.key!r}")
    except ConfigError as e:
        raise InvalidResource(str(e)) from None


def agent_token(kube: KubeClient, namespace: str, spec: RolloutFleetSpec) -> str:
    return bearer_token(kube, namespace, spec.agent.token_secret_ref, AGENT_TOKEN,
                        "agent token")


def encoder_token(kube: KubeClient, namespace: str, ref: SecretKeyRef) -> str:
    """The warm encoders' token of an encoder profile's endpoint."""
    return bearer_token(kube, namespace, ref, ENCODER_TOKEN, "encoder token")


def store_credentials(kube: KubeClient, namespace: str, spec: RolloutFleetSpec
                      ) -> dict[str, str] | None:
    """The store's credentials Secret, if the fleet names one (for the finalizer)."""
    name = write_secret(spec)
    return read_secret(kube, namespace, name, STORE_CREDENTIALS) if name else None


def check_job_secrets(kube: KubeClient, namespace: str, spec: RolloutFleetSpec) -> None:
    """InvalidResource unless the Secrets encoder Jobs get (by reference) opted in."""
    store_credentials(kube, namespace, spec)
    if spec.relay is not None:
        read_secret(kube, namespace, spec.relay.token_secret_ref.name, RELAY_TOKEN)
        if spec.relay.ca_secret_ref is not None:
            read_secret(kube, namespace, spec.relay.ca_secret_ref.name, RELAY_CA)


AGENT_CALLS = 64  # agents the operator calls at once (status polls, profiles)
STATUS_TIMEOUT_S = 5.0  # a status poll's wait: an unreachable agent costs this, not 30 s


def clients(kube: KubeClient, namespace: str, spec: RolloutFleetSpec,
            receivers: list[Receiver], *, timeout_s: float | None = None
            ) -> list[AgentClient]:
    """Clients of the receivers' agents, with the fleet's timeout (or a shorter one)."""
    token = agent_token(kube, namespace, spec)
    wait_s = min(spec.agent.timeout_seconds, timeout_s or spec.agent.timeout_seconds)
    try:
        return [AgentClient(r.name, r.url, token, timeout_s=wait_s) for r in receivers]
    except ConfigError as e:  # an http:// agent while the operator speaks TLS (tls.enabled)
        raise InvalidResource(f"{e} Set spec.agent.scheme: https.") from None


def behind(st: AgentStatus, record: CommitRecord) -> bool:
    """Whether an agent outside any attempt holds other bits than the committed version's:
    a pod that started from an older checkpoint (a replacement, a scale-up) or one whose
    weights are unknown or partly written."""
    idle = st.attempt is None or st.state in {s.value for s in FINAL}
    return idle and (st.dirty is not None or st.version != record.committed_version)


def _entry(receiver: Receiver) -> dict[str, Any]:
    """A receiver's status entry before its agent is asked: its name, address and pods."""
    entry: dict[str, Any] = {"name": receiver.name, "url": receiver.url}
    if receiver.pods:
        entry["pods"] = list(receiver.pods)
    return entry


def _report(client: AgentClient, receiver: Receiver, at: str, catch_up: CommitRecord | None,
            from_store: bool) -> dict[str, Any]:
    """One receiver's status entry; with ``catch_up`` (no refit running on the fleet), an
    agent that is :func:`behind` is first brought to the committed version by a dense
    load, as a refit's admission would: built from the store's history (``from_store``:
    the one the record's digest names, so a peer's copy or a delta is judged by it), else
    of the committed checkpoint."""
    entry = _entry(receiver)
    call: Call[..., Any, AgentStatus] = AgentApi.status
    try:
        st = client.status()
        if catch_up is not None and behind(st, catch_up):
            log.info("%s holds %s (dirty %s): dense refit to the committed version %d",
                     client.name, st.version, st.dirty, catch_up.committed_version)
            call = AgentApi.rejoin
            st = (client.rejoin(catch_up.committed_version, None,  # the history it names
                                catch_up.history_digest or None) if from_store
                  else client.rejoin(catch_up.committed_version, catch_up.baseline_id))
    except Exception as e:  # any failure: the receiver is reported unreachable
        entry["error"] = agent_failure(client.name, call, e)[:1024]
        return entry
    entry.update(agent_report(st), lastSeen=at, release=client.release or None)
    return {k: v for k, v in entry.items() if v is not None}


def serving_versions(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, int]]:
    """``[{version, receivers}]``, newest first, over the receivers that answered."""
    counts = Counter(r["version"] for r in reports if r.get("version") is not None
                     and not r.get("error"))
    return [{"version": v, "receivers": n} for v, n in sorted(counts.items(), reverse=True)]


def refresh(kube: KubeClient, fleet: Mapping[str, Any], *, clock: Callable[[], str],
            active: str | None, acks: Mapping[str, str] | None = None,
            fresh: bool = False) -> dict[str, Any]:
    """Poll the fleet's agents and write its status (not the commit record); the status.

    ``active`` is the WeightRefit running on the fleet (None: none); with none running,
    an agent behind the committed version rejoins it now rather than at the next refit,
    so a replaced or added pod serves the committed weights. ``acks`` are flush
    acknowledgment times to record as ``lastAck``. The record and status are read afresh
    unless ``fresh`` says ``fleet`` was read just now (a poll's own read): an older copy
    (kopf's body, a refit's from its start) could name a version since superseded, and
    catch-up would load it.
    """
    meta = fleet["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = RolloutFleetSpec.model_validate(fleet["spec"])
    current = fleet if fresh else kube.get(fleet_path(namespace, name))
    status = current.get("status") or {}
    at = clock()
    pods = selected_pods(kube, namespace, spec)
    found, incomplete = (groups_of(pods, spec.agent, spec.groups) if spec.groups
                         else (receivers_of(pods, spec.agent), []))
    no_agents = "no agent token"
    try:
        agents = clients(kube, namespace, spec, found, timeout_s=STATUS_TIMEOUT_S)
    except InvalidResource as e:
        log.warning("fleet %s/%s: %s", namespace, name, e)
        agents, no_agents = [], f"No agent token: {e}"
    previous = {r["name"]: r for r in status.get("receivers") or []}
    record = record_of(current)
    catch_up = record if active is None and record.baseline_id else None
    if agents:
        with ThreadPoolExecutor(min(AGENT_CALLS, len(agents))) as pool:
            reports = list(pool.map(
                lambda p: _report(p[0], p[1], at, catch_up, spec.store is not None),
                zip(agents, found, strict=True)))
    else:
        reports = [{**_entry(r), "error": no_agents} for r in found]
    reports += [{"name": g.name, "pods": list(g.pods), "error": g.reason} for g in incomplete]
    for r in reports:
        ack = (acks or {}).get(r["name"]) or previous.get(r["name"], {}).get("lastAck")
        if ack:
            r["lastAck"] = ack
    secret = write_secret(spec)

    def ready(r: Mapping[str, Any]) -> bool:
        return r.get("version") == record.committed_version and not r.get("error")

    shown = sorted(reports, key=lambda r: (ready(r), r["name"]))  # those behind first
    ready_count = sum(map(ready, reports))
    committed_at = (status.get("commit") or {}).get("committedAt") or meta.get(
        "creationTimestamp")
    METRICS.fleet_polled(namespace=namespace, fleet=name, version=record.committed_version,
                         committed_at=parse_time(committed_at).timestamp() if committed_at
                         else None, receivers=len(reports), behind=len(reports) - ready_count)
    patch: dict[str, Any] = {
        "observedGeneration": meta.get("generation"),
        "receivers": shown[:RECEIVERS_SHOWN],
        "receiverCount": len(reports),
        "podCount": sum(len(r.get("pods") or [r]) for r in reports),
        "readyReceivers": ready_count,
        "servingVersions": serving_versions(reports),
        "activeRefit": active,
        "conditions": fleet_conditions(
            status.get("conditions") or [], record=record, receivers=reports, active=active,
            at=at, generation=meta.get("generation"), write_secret=secret,
            write_holders=secret_holders(pods, secret) if secret else ()),
    }
    # A merge patch without resourceVersion: it never touches status.commit, so it cannot
    # undo a commit that lands in between.
    kube.merge_patch(fleet_path(namespace, name, "status"), {"status": patch})
    return patch


def prune_refits(kube: KubeClient, fleet: Mapping[str, Any], *, at: str) -> list[str]:
    """Delete the fleet's finished WeightRefits its history limits let go (their finalizer
    cleans the store); the names deleted."""
    meta = fleet["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = RolloutFleetSpec.model_validate(fleet["spec"])
    path = api_path(GROUP, VERSION, REFIT_PLURAL, namespace)
    refits = kube.get(path).get("items", [])
    METRICS.fleet_refits(namespace=namespace, fleet=name, unfinished=sum(
        1 for r in refits if (r.get("spec") or {}).get("fleet") == name
        and not is_final((r.get("status") or {}).get("phase"))))
    gone = expired_refits(refits, name, keep=spec.refit_history_limit,
                          ttl_s=spec.refit_ttl_seconds_after_finished, at=at)
    for refit in gone:
        try:
            kube.delete(f"{path}/{refit}")
        except NotFound:
            continue
        log.info("fleet %s/%s: deleted finished WeightRefit %s (refitHistoryLimit %d, "
                 "refitTtlSecondsAfterFinished %s)", namespace, name, refit,
                 spec.refit_history_limit, spec.refit_ttl_seconds_after_finished)
    return gone


def set_active(kube: KubeClient, namespace: str, name: str, refit: str | None) -> None:
    try:
        kube.merge_patch(fleet_path(namespace, name, "status"),
                         {"status": {"activeRefit": refit}})
    except ApiError as e:
        log.warning("fleet %s/%s: cannot set activeRefit=%s: %s", namespace, name, refit, e)
