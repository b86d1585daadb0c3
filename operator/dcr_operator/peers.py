"""What a fleet's pods need to catch up from each other (``spec.catchUp.peers``).

Two objects in the fleet's namespace, owned by the RolloutFleet (deleted with it):

- ``<fleet>-peer-token``, a Secret whose key ``token`` is the fleet's peer read token,
  made here from :func:`secrets.token_hex` once and never rewritten or logged (a poll
  reads it only to see that it exists and is the fleet's; pods mount it as a file for
  ``--peer-token-file``; the operator itself never calls a donor). A Secret of that name
  the fleet does not own is left alone and reported.
- ``<fleet>-peers``, a headless Service over the selected pods at ``agent.port``, Ready
  ones only: a pod catching up is not Ready (its ``/readyz`` answers 503 while behind), so
  it is never its own donor. Pods name donors through it: the Service name alone (any
  Ready pod), or, for a StatefulSet whose ``serviceName`` it is, each ordinal's stable
  name (``<pod>.<fleet>-peers``) asked in order.

Choices, and why: the Service, not a list the operator keeps, because the donor is only
an optimisation over the store a pod reads anyway and the history judges every copy, so
cluster DNS is enough (a stale name costs one refused connection) and no pod, flag or wire
format changes when pods come and go. ``status.peers`` names both, never the token.
docs/catch-up.md, "From a peer"; docs/security-receivers.md, "Peers".
"""

from __future__ import annotations

import base64
import logging
import re
import secrets
from collections.abc import Mapping
from typing import Any

from dcr_operator.api.rolloutfleet import AgentSpec, PeersStatus, RolloutFleetSpec
from dcr_operator.errors import Conflict, InvalidResource, NotFound
from dcr_operator.fleet import fleet_path
from dcr_operator.jobs import short_name
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.sites import owner_reference

log = logging.getLogger(__name__)
TOKEN_KEY = "token"  # the Secret's key pods mount
TOKEN_BYTES = 32  # random bytes of a peer token (64 hex characters)
PEER_TOKEN_LABEL = "dcr.dev/peer-token"  # marks the Secret as a fleet's peer read token
FLEET_LABEL = "dcr.dev/fleet"
MANAGED = {"app.kubernetes.io/managed-by": "dcr-operator"}
PORT_NAME = "dcr-peer"
_NOT_LABEL = re.compile(r"[^a-z0-9-]")


def token_secret_name(fleet: str) -> str:
    """The Secret holding RolloutFleet ``fleet``'s peer read token (a DNS subdomain)."""
    return short_name(f"{fleet}-peer-token", 253)


def service_name(fleet: str) -> str:
    """The peers' Service of ``fleet``: a DNS-1035 label (a fleet's name may hold dots or
    start with a digit; a Service's may not)."""
    label = _NOT_LABEL.sub("-", f"{fleet}-peers")
    return short_name(label if label[0].isalpha() else f"p-{label}", 63)


def donor_url(fleet: str, agent: AgentSpec) -> str:
    """A ``--donor`` URL that names any Ready pod of ``fleet`` (in the pod's namespace)."""
    return f"{agent.scheme}://{service_name(fleet)}:{agent.port}"


def service_spec(spec: RolloutFleetSpec) -> dict[str, Any]:
    """The peers' Service's spec: headless, the fleet's labels, its agents' port, Ready
    pods only."""
    assert spec.selector.match_labels, "the CRD refuses catchUp.peers without matchLabels"
    return {"clusterIP": "None", "publishNotReadyAddresses": False,
            "selector": dict(spec.selector.match_labels),
            "ports": [{"name": PORT_NAME, "port": spec.agent.port,
                       "targetPort": spec.agent.port, "protocol": "TCP"}]}


def _owned(obj: Mapping[str, Any], fleet: Mapping[str, Any]) -> bool:
    owners = obj["metadata"].get("ownerReferences") or []
    return fleet["metadata"]["uid"] in [o.get("uid") for o in owners]


def _meta(name: str, fleet: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    meta = fleet["metadata"]
    return {"name": name, "namespace": meta["namespace"],
            "labels": {**MANAGED, FLEET_LABEL: meta["name"][:63], **labels},
            "ownerReferences": [owner_reference(fleet)]}


def ensure_token(kube: KubeClient, fleet: Mapping[str, Any]) -> str:
    """Create ``<fleet>-peer-token`` unless it exists; its name. The token is made here
    and goes only into the Secret (one read per poll once it exists). :class:`InvalidResource`
    if one of that name is not the fleet's."""
    namespace, name = fleet["metadata"]["namespace"], fleet["metadata"]["name"]
    secret = token_secret_name(name)
    path = api_path("", "v1", "secrets", namespace)
    for _ in range(2):  # a create that lost a race reads the winner's
        try:
            there: dict[str, Any] = kube.get(f"{path}/{secret}")
        except NotFound:
            token = base64.b64encode(secrets.token_hex(TOKEN_BYTES).encode()).decode()
            try:
                kube.create(path, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                   "metadata": _meta(secret, fleet, {PEER_TOKEN_LABEL: "true"}),
                                   "data": {TOKEN_KEY: token}})
            except Conflict:
                continue
            log.info("Secret %s/%s: the peer read token of RolloutFleet %s (made)",
                     namespace, secret, name)
            return secret
        if not _owned(there, fleet):
            raise InvalidResource(f"Secret {namespace}/{secret} is not RolloutFleet {name}'s "
                                  "(no ownerReference to it): the operator leaves it alone "
                                  "and its pods would present it to peers; delete it to have "
                                  "the fleet's peer token made there.")
        return secret  # kept as it is: pods hold it
    raise Conflict(f"Secret {namespace}/{secret} was made and gone again while the peer "
                   "token was made.", 409)


def ensure_service(kube: KubeClient, fleet: Mapping[str, Any], spec: RolloutFleetSpec) -> str:
    """Create ``<fleet>-peers`` or put its selector and port right; its name.
    :class:`InvalidResource` if one of that name is not the fleet's."""
    namespace, name = fleet["metadata"]["namespace"], fleet["metadata"]["name"]
    svc = service_name(name)
    path = api_path("", "v1", "services", namespace)
    want = service_spec(spec)
    try:
        there: dict[str, Any] = kube.get(f"{path}/{svc}")
    except NotFound:
        kube.create(path, {"apiVersion": "v1", "kind": "Service",
                           "metadata": _meta(svc, fleet, {}), "spec": want})
        log.info("Service %s/%s: the peers of RolloutFleet %s (made)", namespace, svc, name)
        return svc
    if not _owned(there, fleet):
        raise InvalidResource(f"Service {namespace}/{svc} is not RolloutFleet {name}'s (no "
                              "ownerReference to it): the operator leaves it alone; delete it "
                              "to have the fleet's peers' Service made there.")
    have = there.get("spec") or {}
    if any(have.get(k) != want[k] for k in ("selector", "publishNotReadyAddresses")) or [
            (p.get("port"), p.get("targetPort")) for p in have.get("ports") or []] != [
            (spec.agent.port, spec.agent.port)]:
        kube.merge_patch(f"{path}/{svc}", {
            "metadata": {"resourceVersion": there["metadata"]["resourceVersion"]},
            "spec": {k: want[k] for k in ("selector", "publishNotReadyAddresses", "ports")}})
        log.info("Service %s/%s: selector and port of RolloutFleet %s put right", namespace,
                 svc, name)
    return svc


def publish_peers(kube: KubeClient, fleet: Mapping[str, Any]) -> PeersStatus | None:
    """With ``spec.catchUp.peers``, make the fleet's peer token Secret and Service exist as
    they should and name them in ``status.peers``; what it names (None without peers,
    which leaves anything made before in place until the fleet is deleted)."""
    spec = RolloutFleetSpec.model_validate(fleet["spec"])
    if not spec.catch_up.peers:
        return None
    namespace, name = fleet["metadata"]["namespace"], fleet["metadata"]["name"]
    shown = PeersStatus(token_secret=ensure_token(kube, fleet),
                        service=ensure_service(kube, fleet, spec),
                        donor=donor_url(name, spec.agent))
    patch = shown.model_dump(by_alias=True)
    if (fleet.get("status") or {}).get("peers") != patch:
        kube.merge_patch(fleet_path(namespace, name, "status"), {"status": {"peers": patch}})
    return shown
