"""spec.catchUp.peers against a real kube-apiserver: the fleet's peer token Secret and
peers' Service (dcr_operator.peers), what status.peers names, and what the CRD refuses."""

from __future__ import annotations

import base64
import logging
from typing import Any

import pytest
from k8sutil import apply, install_crds

from dcr.http.tokens import check_token
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.commitstore import FleetCommitStore
from dcr_operator.errors import ApiError, InvalidResource
from dcr_operator.handlers import _refresh_fleet
from dcr_operator.kube import KubeClient
from dcr_operator.peers import publish_peers, service_name, token_secret_name

pytestmark = pytest.mark.e2e


def fleet(name: str = "fleet", *, peers: bool = True, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "agent": {"tokenSecretRef": {"name": "tok"}, "port": 8471},
                     "store": {"uri": "file:///tmp/store"}, "catchUp": {"peers": peers},
                     "initial": {"version": 0, "checkpoint": "/ckpt/v0"}, **spec}}


def _get(kube: KubeClient, namespace: str, kind: str, name: str) -> dict[str, Any]:
    got: dict[str, Any] = kube.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
    return got


def _fleet(kube: KubeClient, namespace: str, name: str = "fleet") -> dict[str, Any]:
    got: dict[str, Any] = kube.get(
        f"/apis/dcr.dev/v1alpha1/namespaces/{namespace}/rolloutfleets/{name}")
    return got


def _token(kube: KubeClient, namespace: str, name: str = "fleet") -> str:
    secret = _get(kube, namespace, "secrets", token_secret_name(name))
    return base64.b64decode(secret["data"]["token"]).decode()


def test_a_fleet_with_peers_gets_its_token_secret_and_service_and_status_names_them(
        kube: KubeClient, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    """The operator's fleet poll makes ``<fleet>-peer-token`` (owned by the fleet, a strong
    random token under key ``token``, never in status or the log) and the headless
    ``<fleet>-peers`` over the fleet's Ready pods at the agents' port; status.peers says
    what pods mount and name as donors. Without peers neither exists."""
    caplog.set_level(logging.DEBUG)
    install_crds(kube)
    apply(kube, [fleet(), fleet("plain", peers=False)], namespace)
    for name in ("fleet", "plain"):
        FleetCommitStore(kube, namespace, name).initialize()
    _refresh_fleet(kube, _fleet(kube, namespace))
    _refresh_fleet(kube, _fleet(kube, namespace, "plain"))

    body = _fleet(kube, namespace)
    assert body["status"]["peers"] == {"service": "fleet-peers", "tokenSecret":
                                       "fleet-peer-token", "donor": "http://fleet-peers:8471"}
    secret = _get(kube, namespace, "secrets", "fleet-peer-token")
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("RolloutFleet", body["metadata"]["uid"])
    assert secret["metadata"]["labels"]["dcr.dev/peer-token"] == "true"
    token = _token(kube, namespace)
    assert check_token(token, "peer token") == token
    assert len(token) == 64
    assert token not in str(body)
    assert token not in caplog.text

    svc = _get(kube, namespace, "services", "fleet-peers")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"app": "fleet"}
    assert svc["spec"].get("publishNotReadyAddresses") in (None, False)  # Ready pods only
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(8471, 8471)]
    assert svc["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]

    assert "peers" not in (_fleet(kube, namespace, "plain").get("status") or {})
    for kind, name in (("secrets", "plain-peer-token"), ("services", "plain-peers")):
        with pytest.raises(ApiError, match="404"):
            _get(kube, namespace, kind, name)


def test_the_peer_token_is_made_once_and_the_service_follows_the_agent_port(
        kube: KubeClient, namespace: str) -> None:
    """Pods hold the token: a later poll never rotates it; a changed agent port or
    selector is put right on the Service."""
    install_crds(kube)
    apply(kube, [fleet()], namespace)
    publish_peers(kube, _fleet(kube, namespace))
    token = _token(kube, namespace)
    path = f"/apis/dcr.dev/v1alpha1/namespaces/{namespace}/rolloutfleets/fleet"
    kube.merge_patch(path, {"spec": {"agent": {"port": 9000},
                                     "selector": {"matchLabels": {"app": "fleet", "v": "2"}}}})
    shown = publish_peers(kube, _fleet(kube, namespace))
    assert shown is not None
    assert shown.donor == "http://fleet-peers:9000"
    assert _token(kube, namespace) == token
    svc = _get(kube, namespace, "services", "fleet-peers")
    assert [p["port"] for p in svc["spec"]["ports"]] == [9000]
    assert svc["spec"]["selector"] == {"app": "fleet", "v": "2"}


def test_a_token_secret_or_service_the_fleet_does_not_own_is_left_alone(
        kube: KubeClient, namespace: str) -> None:
    """A Secret named ``<fleet>-peer-token`` that someone else made is refused, not used
    (the fleet's pods would present its value to peers), and left as it is."""
    install_crds(kube)
    apply(kube, [fleet(), {"apiVersion": "v1", "kind": "Secret",
                           "metadata": {"name": "fleet-peer-token"},
                           "stringData": {"token": "x" * 40}}], namespace)
    with pytest.raises(InvalidResource, match=r"Secret .*fleet-peer-token is not RolloutFleet"):
        publish_peers(kube, _fleet(kube, namespace))
    assert _token(kube, namespace) == "x" * 40
    apply(kube, [fleet("other"), {"apiVersion": "v1", "kind": "Service",
                                  "metadata": {"name": "other-peers"},
                                  "spec": {"selector": {"app": "else"},
                                           "ports": [{"port": 80}]}}], namespace)
    with pytest.raises(InvalidResource, match=r"Service .*other-peers is not RolloutFleet"):
        publish_peers(kube, _fleet(kube, namespace, "other"))
    assert _get(kube, namespace, "services", "other-peers")["spec"]["selector"] == {
        "app": "else"}


@pytest.mark.parametrize("spec", [
    {"store": None, "relay": {"url": "http://relay:8470", "tokenSecretRef": {"name": "r"}}},
    {"selector": {"matchLabels": {"app": "fleet"}, "matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["a"]}]}},
])
def test_the_apiserver_refuses_peers_without_a_store_or_with_selector_expressions(
        kube: KubeClient, namespace: str, spec: dict[str, Any]) -> None:
    """No history to judge a peer's copy, or a selector the Service cannot express (pods it
    selects beyond the fleet's would be sent the peer token): refused at admission, and
    by the operator's own model."""
    install_crds(kube)
    obj = fleet()
    obj["spec"].update(spec)
    obj["spec"] = {k: v for k, v in obj["spec"].items() if v is not None}
    with pytest.raises(ApiError, match=r"catchUp\.peers needs store"):
        apply(kube, [obj], namespace)
    with pytest.raises(ValueError, match=r"catchUp\.peers needs store"):
        RolloutFleetSpec.model_validate(obj["spec"])


def test_service_names_are_dns_labels_for_any_fleet_name() -> None:
    assert service_name("policy.a") == "policy-a-peers"
    assert service_name("7b") == "p-7b-peers"
    long = service_name("f" * 253)
    assert len(long) <= 63
    assert long[0].isalpha()
