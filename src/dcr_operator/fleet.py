"""A RolloutFleet's receivers: found from its pods, reached through their agents.

Receivers are the pods the fleet's selector matches that are Running and not being
deleted (:func:`dcr_operator.reconcile.receivers_of`). The agent URL is the pod's
``dcr.dev/agent-url`` annotation when set, else ``<agent.scheme>://<podIP>:<agent.port>``:
the port is the normal case (the agent is a sidecar listening on the pod IP); the
annotation is for agents reachable elsewhere (a node-local proxy, a different network,
and the tests, whose pods are API objects standing for local agent processes). The
bearer token comes from the Secret key ``agent.tokenSecretRef``.

:func:`refresh` asks every receiver's agent for its status and writes
``status.receivers``, the counts and the Ready / Progressing / Degraded conditions.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dcr.protocol.agent_api import AgentClient
from dcr_operator.commitstore import record_of
from dcr_operator.crds import FLEET_PLURAL, GROUP, VERSION, RolloutFleetSpec, SecretKeyRef
from dcr_operator.errors import ApiError, InvalidResource, NotFound
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.reconcile import Receiver, fleet_conditions, receivers_of, selector_query

log = logging.getLogger(__name__)


def fleet_path(namespace: str, name: str, sub: str = "") -> str:
    return api_path(GROUP, VERSION, FLEET_PLURAL, namespace, name, sub)


def discover(kube: KubeClient, namespace: str, spec: RolloutFleetSpec) -> list[Receiver]:
    pods = kube.get(api_path("", "v1", "pods", namespace),
                    labelSelector=selector_query(spec.selector))
    return receivers_of(pods.get("items", []), spec.agent)


def secret_value(kube: KubeClient, namespace: str, ref: SecretKeyRef) -> str:
    try:
        secret = kube.get(api_path("", "v1", "secrets", namespace, ref.name))
    except NotFound:
        raise InvalidResource(f"Secret {namespace}/{ref.name} (agent.tokenSecretRef) does "
                              "not exist.") from None
    raw = (secret.get("data") or {}).get(ref.key)
    if raw is None:
        raise InvalidResource(f"Secret {namespace}/{ref.name} has no key {ref.key!r} "
                              "(agent.tokenSecretRef.key).")
    return base64.b64decode(raw).decode().strip()


def secret_data(kube: KubeClient, namespace: str, name: str) -> dict[str, str]:
    secret = kube.get(api_path("", "v1", "secrets", namespace, name))
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def clients(kube: KubeClient, namespace: str, spec: RolloutFleetSpec,
            receivers: list[Receiver]) -> list[AgentClient]:
    token = secret_value(kube, namespace, spec.agent.token_secret_ref)
    return [AgentClient(r.name, r.url, token, timeout_s=spec.agent.timeout_seconds)
            for r in receivers]


def _report(client: AgentClient, url: str, at: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": client.name, "url": url}
    try:
        st = client.status()
    except Exception as e:  # any failure: the receiver is reported unreachable
        entry["error"] = str(e)[:1024]
        return entry
    entry.update(version=st.version, state=st.state, attempt=st.attempt, lastSeen=at)
    if st.error:
        entry["error"] = st.error[:1024]
    return {k: v for k, v in entry.items() if v is not None}


def refresh(kube: KubeClient, fleet: Mapping[str, Any], *, clock: Callable[[], str],
            active: str | None, acks: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Poll the fleet's agents and write its status (not the commit record); the status.

    ``active`` is the WeightRefit running on the fleet (None: none). ``acks`` are flush
    acknowledgment times to record as ``lastAck``.
    """
    meta = fleet["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    spec = RolloutFleetSpec.model_validate(fleet["spec"])
    current = kube.get(fleet_path(namespace, name))
    status = current.get("status") or {}
    at = clock()
    found = discover(kube, namespace, spec)
    try:
        agents = clients(kube, namespace, spec, found)
    except InvalidResource as e:
        log.warning("fleet %s/%s: %s", namespace, name, e)
        agents = []
    previous = {r["name"]: r for r in status.get("receivers") or []}
    if agents:
        with ThreadPoolExecutor(min(16, len(agents))) as pool:
            reports = list(pool.map(lambda p: _report(p[0], p[1].url, at),
                                    zip(agents, found, strict=True)))
    else:
        reports = [{"name": r.name, "url": r.url, "error": "no agent token"} for r in found]
    for r in reports:
        ack = (acks or {}).get(r["name"]) or previous.get(r["name"], {}).get("lastAck")
        if ack:
            r["lastAck"] = ack
    record = record_of(current)
    patch: dict[str, Any] = {
        "observedGeneration": meta.get("generation"),
        "receivers": reports,
        "receiverCount": len(reports),
        "readyReceivers": sum(1 for r in reports
                              if r.get("version") == record.committed_version
                              and not r.get("error")),
        "activeRefit": active,
        "conditions": fleet_conditions(status.get("conditions") or [], record=record,
                                       receivers=reports, active=active, at=at,
                                       generation=meta.get("generation")),
    }
    # A merge patch without resourceVersion: it never touches status.commit, so it cannot
    # undo a commit that lands in between.
    kube.merge_patch(fleet_path(namespace, name, "status"), {"status": patch})
    return patch


def set_active(kube: KubeClient, namespace: str, name: str, refit: str | None) -> None:
    try:
        kube.merge_patch(fleet_path(namespace, name, "status"),
                         {"status": {"activeRefit": refit}})
    except ApiError as e:
        log.warning("fleet %s/%s: cannot set activeRefit=%s: %s", namespace, name, refit, e)
