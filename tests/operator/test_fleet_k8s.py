"""A fleet's receivers and Secrets on a real apiserver, with hostile agents on loopback.

Pods are API objects whose ``status.podIP`` is a distinct loopback address (127.0.0.2,
.3, ...: Linux routes 127.0.0.0/8 to ``lo``); the "agents" are stubs listening there on
the fleet's agent port (:mod:`stubs`). The operator's own functions (``refresh``,
``clients``, ``check_job_secrets``) run against them with the admin client.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from k8sutil import apply, install_crds
from stubs import Stub, stubs

from dcr import __version__
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.errors import InvalidResource
from dcr_operator.fleet import clients, discover, prune_refits, refresh
from dcr_operator.kube import KubeClient
from dcr_operator.reconcile import now

pytestmark = pytest.mark.e2e

TOKEN = "fleet-test-agent-token-0123456789"
SECRET = "S3CR3T-FROM-THE-ENDPOINT"
STATUS = {"name": "x", "version": 0, "dirty": None, "unknown": None, "attempt": None,
          "state": None, "error": None, "gate_open": True, "payloads_staged": 0,
          "payloads_applied": 0, "bytes_staged": 0}


def _secret(name: str, *uses: str, key: str = "token", value: str = TOKEN) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "labels": {f"dcr.dev/{u}": "true" for u in uses}},
            "data": {key: base64.b64encode(value.encode()).decode()}}


def _fleet(port: int, token_secret: str, **more: Any) -> dict[str, Any]:
    return {"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": "fleet"},
            "spec": {"selector": {"matchLabels": {"app": "r"}},
                     "agent": {"port": port, "tokenSecretRef": {"name": token_secret}},
                     "initial": {"version": 0, "checkpoint": "/ckpt/v0"},
                     **(more or {"store": {"uri": "file:///tmp/store"}})}}


def _pods(kube: KubeClient, namespace: str, ips: dict[str, str],
          annotations: dict[str, dict[str, str]] | None = None,
          env_from: dict[str, str] | None = None) -> None:
    """Running pods ``name -> podIP``, as a kubelet would report them; ``env_from`` hands
    a pod's agent a Secret by name."""
    for name, ip in ips.items():
        agent: dict[str, Any] = {"name": "agent", "image": "dcr:test"}
        if name in (env_from or {}):
            agent["envFrom"] = [{"secretRef": {"name": (env_from or {})[name]}}]
        apply(kube, [{"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": name, "labels": {"app": "r"},
                                   "annotations": (annotations or {}).get(name, {})},
                      "spec": {"containers": [agent]}}],
              namespace)
        kube.merge_patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})


def _answers(stub: Stub, status: dict[str, Any] = STATUS, **headers: str) -> None:
    stub.answer = (200, {"Content-Type": "application/json", **headers},
                   json.dumps(status).encode())


def test_fleet_status_says_what_happened_in_our_words_never_an_agents(
        kube: KubeClient, namespace: str) -> None:
    """Fails on 5b0b0ae: the error body of an agent was copied into
    ``status.receivers[].error``, and the ``dcr.dev/agent-url`` annotation of a pod sent
    the token to another address."""
    install_crds(kube)
    apply(kube, [_secret("agent-token", "agent-token")], namespace)
    with stubs("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5") as (
            refusing, redirecting, lying, elsewhere):
        refusing.answer = (500, {"Content-Type": "application/json"}, json.dumps(
            {"error": SECRET, "kind": "<img src=x onerror=alert(1)>"}).encode())
        redirecting.answer = (302, {"Location": f"{elsewhere.url}/v1/status"}, b"")
        _answers(lying, {**STATUS, "error": SECRET, "state": SECRET,
                         "attempt": f"../{SECRET}", "version": 3})
        _answers(elsewhere)
        _pods(kube, namespace, {"refusing": "127.0.0.2", "redirecting": "127.0.0.3",
                                "lying": "127.0.0.4"},
              annotations={"redirecting": {"dcr.dev/agent-url": elsewhere.url}})
        (fleet,) = apply(kube, [_fleet(refusing.port, "agent-token")], namespace)
        refresh(kube, fleet, clock=now, active=None)
        status = kube.get(f"/apis/dcr.dev/v1alpha1/namespaces/{namespace}/rolloutfleets/"
                          "fleet")["status"]
        assert SECRET not in json.dumps(status)
        got = {r["name"]: r for r in status["receivers"]}
        port = refusing.port
        assert got["refusing"] == {
            "name": "refusing", "url": f"http://127.0.0.2:{port}",
            "error": "Agent refusing (GET /v1/status) was refused with HTTP 500."}
        assert got["redirecting"] == {
            "name": "redirecting", "url": f"http://127.0.0.3:{port}",
            "error": "Agent redirecting (GET /v1/status) answered HTTP 302, a redirect, "
                     "which is never followed."}
        assert got["lying"]["version"] == 3
        assert "state" not in got["lying"]
        assert "attempt" not in got["lying"]
        assert got["lying"]["error"] == ("The agent reports that attempt (unnamed) failed "
                                         "(its GET /v1/status and log say why).")
        assert elsewhere.seen == []
        assert redirecting.tokens() == [f"Bearer {TOKEN}"]


def test_fleet_status_names_each_agents_release_and_the_api_version_it_cannot_read(
        kube: KubeClient, namespace: str) -> None:
    """An agent of another release within the skew shows its release; one that speaks an
    agent API version the operator does not read shows our sentence naming both versions,
    never a header's bytes."""
    install_crds(kube)
    apply(kube, [_secret("agent-token", "agent-token")], namespace)
    with stubs("127.0.0.2", "127.0.0.3", "127.0.0.4") as (newer, ahead, odd):
        _answers(newer, **{"DCR-Agent-API": "1", "DCR-Release": "0.2.0"})
        _answers(ahead, **{"DCR-Agent-API": "2", "DCR-Release": "0.3.0"})
        _answers(odd, **{"DCR-Agent-API": "1", "DCR-Release": f"<{SECRET}>"})
        _pods(kube, namespace, {"newer": "127.0.0.2", "ahead": "127.0.0.3",
                                "odd": "127.0.0.4"})
        (fleet,) = apply(kube, [_fleet(newer.port, "agent-token")], namespace)
        refresh(kube, fleet, clock=now, active=None)
        status = kube.get(f"/apis/dcr.dev/v1alpha1/namespaces/{namespace}/rolloutfleets/"
                          "fleet")["status"]
    got = {r["name"]: r for r in status["receivers"]}
    assert (got["newer"]["version"], got["newer"]["release"]) == (0, "0.2.0")
    assert "release" not in got["odd"]  # not a release: nothing of it in status
    assert SECRET not in json.dumps(status)
    assert got["ahead"]["error"] == (
        "Agent ahead's answer (GET /v1/status) has agent API version 2, but this DCR "
        f"{__version__} reads agent API version 1: upgrade the older side within the "
        'supported skew (docs/upgrades.md, "Skew").')
    assert "version" not in got["ahead"]


def test_the_fleet_says_which_pods_are_handed_the_stores_write_credentials(
        kube: KubeClient, namespace: str) -> None:
    """Fails on b20bcff: a fleet whose rollout pods held the owners' write key (with which
    whoever controls a pod can choose the weights) showed no sign of it."""
    install_crds(kube)
    apply(kube, [_secret("agent-token", "agent-token")], namespace)
    store = {"store": {"uri": "s3://b/p", "endpoint": "http://127.0.0.1:9",
                       "credentialsSecretRef": {"name": "weights-s3"}}}
    with stubs("127.0.0.2", "127.0.0.3") as (writer, reader):
        _answers(writer)
        _answers(reader)
        _pods(kube, namespace, {"writer": "127.0.0.2", "reader": "127.0.0.3"},
              env_from={"writer": "weights-s3", "reader": "weights-s3-read"})
        (fleet,) = apply(kube, [_fleet(writer.port, "agent-token", **store)], namespace)
        refresh(kube, fleet, clock=now, active=None)
        path = f"/apis/dcr.dev/v1alpha1/namespaces/{namespace}/rolloutfleets/fleet"
        got = {c["type"]: c for c in kube.get(path)["status"]["conditions"]}
        assert (got["ReceiversReadOnly"]["status"],
                got["ReceiversReadOnly"]["reason"]) == ("False", "PodsHoldWriteCredentials")
        assert "1 selected pod is handed Secret weights-s3" in got["ReceiversReadOnly"][
            "message"]
        assert ": writer." in got["ReceiversReadOnly"]["message"]
        kube.delete(f"/api/v1/namespaces/{namespace}/pods/writer")
        refresh(kube, kube.get(path), clock=now, active=None)
        got = {c["type"]: c for c in kube.get(path)["status"]["conditions"]}
        assert got["ReceiversReadOnly"]["status"] == "True"


def test_a_secret_is_used_only_for_what_its_label_opts_it_in_to(
        kube: KubeClient, namespace: str) -> None:
    """Fails on 5b0b0ae: the operator read whichever Secret a fleet named and sent its
    key to every selected pod as the agent token."""
    install_crds(kube)
    apply(kube, [_secret("db-password", value=SECRET),
                 _secret("relay-only", "relay-token", value=SECRET),
                 _secret("agent-token", "agent-token")], namespace)
    with stubs("127.0.0.2") as (agent,):
        _answers(agent)
        _pods(kube, namespace, {"r0": "127.0.0.2"})
        for name in ("db-password", "relay-only"):
            spec = RolloutFleetSpec.model_validate(_fleet(agent.port, name)["spec"])
            with pytest.raises(InvalidResource, match=(
                    f"Secret {namespace}/{name} \\(spec.agent.tokenSecretRef\\) is not "
                    "labelled dcr.dev/agent-token=true")):
                clients(kube, namespace, spec, discover(kube, namespace, spec))
        (fleet,) = apply(kube, [_fleet(agent.port, "db-password")], namespace)
        refresh(kube, fleet, clock=now, active=None)
        (entry,) = kube.get(f"/apis/dcr.dev/v1alpha1/namespaces/{namespace}/rolloutfleets/"
                            "fleet")["status"]["receivers"]
        assert entry["error"].startswith("No agent token: Secret ")
        assert "is not labelled dcr.dev/agent-token=true" in entry["error"]
        assert agent.seen == []
        spec = RolloutFleetSpec.model_validate(_fleet(agent.port, "agent-token")["spec"])
        (client,) = clients(kube, namespace, spec, discover(kube, namespace, spec))
        assert client.status().version == 0
        assert agent.tokens() == [f"Bearer {TOKEN}"]


def test_the_secrets_encoder_jobs_and_the_finalizer_use_must_opt_in_too(
        kube: KubeClient, namespace: str) -> None:
    """Fails on 5b0b0ae (no check existed): an encoder Job got any Secret the fleet named
    (``envFrom``, ``secretKeyRef``), and the finalizer sent the credentials Secret's
    keys to the fleet's S3 endpoint."""
    from dcr_operator.fleet import check_job_secrets, store_credentials

    install_crds(kube)
    apply(kube, [_secret("creds", key="AWS_ACCESS_KEY_ID"),
                 _secret("creds-ok", "store-credentials", key="AWS_ACCESS_KEY_ID"),
                 _secret("relay", "agent-token"), _secret("relay-ok", "relay-token")],
          namespace)
    s3 = {"uri": "s3://b/p", "endpoint": "http://127.0.0.1:9", "credentialsSecretRef": {}}
    cases = [
        ({"store": {**s3, "credentialsSecretRef": {"name": "creds"}}}, "creds",
         "spec.store.credentialsSecretRef", "store-credentials"),
        ({"relay": {"url": "http://relay:8470", "tokenSecretRef": {"name": "relay"}}},
         "relay", "spec.relay.tokenSecretRef", "relay-token"),
    ]
    for where, name, field, label in cases:
        spec = RolloutFleetSpec.model_validate(_fleet(1, "t", **where)["spec"])
        with pytest.raises(InvalidResource, match=(
                f"Secret {namespace}/{name} \\({field}\\) is not labelled dcr.dev/{label}")):
            check_job_secrets(kube, namespace, spec)
    with pytest.raises(InvalidResource, match=r"is not labelled dcr\.dev/store-credentials"):
        store_credentials(kube, namespace, RolloutFleetSpec.model_validate(
            _fleet(1, "t", **cases[0][0])["spec"]))
    ok = RolloutFleetSpec.model_validate(_fleet(1, "t", store={
        **s3, "credentialsSecretRef": {"name": "creds-ok"}})["spec"])
    check_job_secrets(kube, namespace, ok)
    assert store_credentials(kube, namespace, ok) == {"AWS_ACCESS_KEY_ID": TOKEN}
    check_job_secrets(kube, namespace, RolloutFleetSpec.model_validate(_fleet(1, "t", relay={
        "url": "http://relay:8470", "tokenSecretRef": {"name": "relay-ok"}})["spec"]))


def test_a_weak_or_placeholder_agent_token_is_refused_before_any_agent_is_called(
        kube: KubeClient, namespace: str) -> None:
    """Fails before the operator checked the token it reads: a labelled Secret holding
    the chart's `change-me` example (or a short token) was sent to every selected pod."""
    install_crds(kube)
    apply(kube, [_secret("placeholder", "agent-token", value="change-me-to-a-long-random-token"),
                 _secret("short", "agent-token", value="tiny")], namespace)
    with stubs("127.0.0.2") as (agent,):
        _answers(agent)
        _pods(kube, namespace, {"r0": "127.0.0.2"})
        for name in ("placeholder", "short"):
            spec = RolloutFleetSpec.model_validate(_fleet(agent.port, name)["spec"])
            with pytest.raises(InvalidResource, match=f"Secret {namespace}/{name}") as e:
                clients(kube, namespace, spec, discover(kube, namespace, spec))
            assert "change-me-to" not in str(e.value)
            assert "tiny" not in str(e.value)
        assert agent.seen == []


def test_a_fleet_keeps_only_its_newest_finished_refits(kube: KubeClient,
                                                       namespace: str) -> None:
    """Fails on 711d82d: a run that refits every step left every WeightRefit behind.
    On the real apiserver: the fleet keeps its refitHistoryLimit newest finished refits,
    and never a running one or another fleet's."""
    install_crds(kube)
    (fleet,) = apply(kube, [_fleet(9, "agent-token", refitHistoryLimit=2,
                                   store={"uri": "file:///tmp/store"})], namespace)
    base = "/apis/dcr.dev/v1alpha1/namespaces/" + namespace + "/weightrefits"
    phases = {"v1": "Committed", "v2": "Failed", "v3": "Committed", "v4": "Committed",
              "v5": None, "other": "Committed"}
    for i, (name, phase) in enumerate(phases.items()):
        apply(kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
                      "metadata": {"name": name},
                      "spec": {"fleet": "elsewhere" if name == "other" else "fleet",
                               "baseVersion": i, "targetVersion": i + 1,
                               "source": {"checkpoint": f"/ckpt/v{i + 1}"}}}], namespace)
        if phase:
            kube.merge_patch(f"{base}/{name}/status", {"status": {
                "phase": phase, "completionTime": f"2026-01-01T00:0{i}:00Z"}})
    assert prune_refits(kube, fleet, at=now()) == ["v1", "v2"]
    left = sorted(r["metadata"]["name"] for r in kube.get(base)["items"])
    assert left == ["other", "v3", "v4", "v5"]
    assert prune_refits(kube, fleet, at=now()) == []


def _counting(kube: KubeClient, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every request ``kube`` makes from now on, as (method, path)."""
    seen: list[tuple[str, str]] = []
    request = kube.request

    def counted(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        seen.append((method, path))
        return request(method, path, *args, **kwargs)

    monkeypatch.setattr(kube, "request", counted)
    return seen


def test_a_fleet_poll_reads_the_fleet_once_and_its_commit_configmap_once(
        kube: KubeClient, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on a6417f9: each poll read the fleet three times (the poll, the status
    refresh, the commit's publisher), counted here through the API client."""
    from dcr_operator.commitstore import FleetCommitStore
    from dcr_operator.handlers import _poll_fleet

    install_crds(kube)
    apply(kube, [_secret("agent-token", "agent-token")], namespace)
    with stubs("127.0.0.2") as (agent,):
        _answers(agent)
        _pods(kube, namespace, {"r0": "127.0.0.2"})
        apply(kube, [_fleet(agent.port, "agent-token")], namespace)
        FleetCommitStore(kube, namespace, "fleet").initialize()  # and its ConfigMap
        seen = _counting(kube, monkeypatch)
        _poll_fleet(kube, namespace, "fleet")
    fleet = f"/apis/dcr.dev/v1alpha1/namespaces/{namespace}/rolloutfleets/fleet"
    cm = f"/api/v1/namespaces/{namespace}/configmaps/fleet-commit"
    assert seen.count(("GET", fleet)) == 1
    assert seen.count(("GET", cm)) == 1
    assert [m for m, p in seen if p == cm] == ["GET"]  # nothing to write
    status = kube.get(fleet)["status"]
    assert (status["receiverCount"], status["readyReceivers"]) == (1, 1)


def test_a_poll_holding_an_older_copy_of_the_fleet_never_publishes_an_older_record(
        kube: KubeClient, namespace: str) -> None:
    """The publisher trusts a caller's copy of the fleet only to see that nothing needs
    writing: a copy read before a commit leaves the newer record in place, and a ConfigMap
    that needs writing gets the record read afresh."""
    from dcr.format.commitfile import COMMIT_FILE_KEY
    from dcr.protocol.records import CommitOutcome, CommitRecord
    from dcr_operator.commitmap import publish_commit
    from dcr_operator.commitstore import FleetCommitStore

    install_crds(kube)
    apply(kube, [_fleet(9, "agent-token")], namespace)
    store = FleetCommitStore(kube, namespace, "fleet")
    v0 = store.initialize()
    older = kube.get(store.path)  # a poll's copy, read before the commit
    v1 = CommitRecord(committed_version=1, baseline_id="/ckpt/v1", attempt="a-000000000001")
    assert store.compare_and_set(v0, v1) is CommitOutcome.SUCCESS  # publishes v1
    cm = f"/api/v1/namespaces/{namespace}/configmaps/fleet-commit"

    def published() -> int:
        return int(json.loads(kube.get(cm)["data"][COMMIT_FILE_KEY])["committed_version"])

    assert published() == 1
    assert publish_commit(kube, namespace, "fleet", fleet=older) is False
    assert published() == 1
    kube.merge_patch(cm, {"data": {COMMIT_FILE_KEY: '{"committed_version": 9}'}})  # by hand
    assert publish_commit(kube, namespace, "fleet", fleet=older) is True
    assert published() == 1
