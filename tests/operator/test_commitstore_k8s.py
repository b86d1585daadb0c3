"""The commit record in a RolloutFleet's status: compare-and-set on a real apiserver; and
what the CRDs' schemas and CEL rules make that apiserver refuse."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import pytest
from k8sutil import apply, install_crds
from kubernetes.client import Configuration

from dcr.format.commitfile import COMMIT_FILE_KEY
from dcr.protocol.commitstore import CommitStoreError
from dcr.protocol.records import CommitOutcome, CommitRecord
from dcr_operator.commitmap import publish_commit
from dcr_operator.commitstore import FleetCommitStore
from dcr_operator.errors import InvalidResource
from dcr_operator.kube import KubeClient

pytestmark = pytest.mark.e2e

V0 = CommitRecord(committed_version=0, baseline_id="/ckpt/v0", attempt="")
V1 = CommitRecord(committed_version=1, baseline_id="/ckpt/v1", attempt="a-000000000001")


def fleet(name: str = "fleet") -> dict[str, Any]:
    return {"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": "x"}},
                     "agent": {"tokenSecretRef": {"name": "tok"}},
                     "store": {"uri": "file:///tmp/store"},
                     "initial": {"version": 0, "checkpoint": "/ckpt/v0"}}}


@pytest.fixture
def store(kube: KubeClient, namespace: str) -> FleetCommitStore:
    install_crds(kube)
    apply(kube, [fleet()], namespace)
    return FleetCommitStore(kube, namespace, "fleet", refit="r1")


def test_a_new_fleet_reads_its_initial_record_and_initialize_writes_it(
        store: FleetCommitStore, kube: KubeClient) -> None:
    assert store.read() == V0
    assert "status" not in kube.get(store.path)
    assert store.initialize() == V0
    assert kube.get(store.path)["status"]["commit"] == {
        "committedVersion": 0, "baselineId": "/ckpt/v0", "attempt": ""}
    assert store.initialize() == V0  # idempotent


def test_compare_and_set_moves_the_record_once(store: FleetCommitStore,
                                               kube: KubeClient) -> None:
    assert store.compare_and_set(V0, V1) is CommitOutcome.SUCCESS
    assert store.read() == V1
    commit = kube.get(store.path)["status"]["commit"]
    assert commit["refit"] == "r1"
    assert commit["committedAt"].endswith("Z")
    other = CommitRecord(committed_version=1, baseline_id="/other", attempt="a-000000000002")
    assert store.compare_and_set(V0, other) is CommitOutcome.CONFLICT
    assert store.read() == V1


def test_an_unrelated_status_write_in_between_is_not_a_conflict(
        store: FleetCommitStore, kube: KubeClient) -> None:
    real_get = kube.get
    calls = 0

    def racing_get(path: str, **query: str) -> Any:
        """Another writer patches the fleet's receivers right after each of our reads."""
        nonlocal calls
        out = real_get(path, **query)
        calls += path == store.path
        if calls == 1:
            kube.merge_patch(store.path + "/status", {"status": {"receiverCount": 7}})
        return out

    kube.get = racing_get  # type: ignore[method-assign]
    assert store.compare_and_set(V0, V1) is CommitOutcome.SUCCESS
    # the precondition failed once (409), the record had not moved; then the record is
    # read twice more as it is published to the pods (before and after the write)
    assert calls == 4
    kube.get = real_get  # type: ignore[method-assign]
    status = kube.get(store.path)["status"]
    assert (status["receiverCount"], status["commit"]["attempt"]) == (7, V1.attempt)


def test_a_record_moved_between_read_and_write_is_a_conflict(
        store: FleetCommitStore, kube: KubeClient) -> None:
    rival = FleetCommitStore(kube, store.namespace, store.name, refit="rival")
    real_get = kube.get
    raced = False

    def racing_get(path: str, **query: str) -> Any:
        nonlocal raced
        out = real_get(path, **query)
        if not raced:
            raced = True
            assert rival.compare_and_set(V0, V1) is CommitOutcome.SUCCESS
        return out

    kube.get = racing_get  # type: ignore[method-assign]
    mine = CommitRecord(committed_version=1, baseline_id="/mine", attempt="a-000000000003")
    assert store.compare_and_set(V0, mine) is CommitOutcome.CONFLICT
    kube.get = real_get  # type: ignore[method-assign]
    assert store.read() == V1
    assert kube.get(store.path)["status"]["commit"]["refit"] == "rival"


def test_no_apiserver_is_unknown_and_a_missing_fleet_is_failed(
        store: FleetCommitStore, kube: KubeClient, namespace: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"https://127.0.0.1:{s.getsockname()[1]}"
    offline = FleetCommitStore(KubeClient(lambda: Configuration(host=dead), timeout_s=2),
                               namespace, "fleet")
    assert offline.compare_and_set(V0, V1) is CommitOutcome.UNKNOWN
    with pytest.raises(CommitStoreError, match="Cannot read the commit record"):
        offline.read()
    gone = FleetCommitStore(kube, namespace, "no-such-fleet")
    assert gone.compare_and_set(V0, V1) is CommitOutcome.FAILED


def test_the_crd_refuses_changing_the_initial_version(store: FleetCommitStore,
                                                      kube: KubeClient) -> None:
    from dcr_operator.errors import ApiError

    with pytest.raises(ApiError, match="initial is immutable") as e:
        kube.merge_patch(store.path, {"spec": {"initial": {"checkpoint": "/other"}}})
    assert e.value.status == 422


def test_the_apiserver_refuses_a_fleet_with_neither_store_nor_relay(
        store: FleetCommitStore, kube: KubeClient) -> None:
    from dcr_operator.errors import ApiError

    with pytest.raises(ApiError, match="set store, relay, or both") as e:
        kube.merge_patch(store.path, {"spec": {"store": None}})
    assert e.value.status == 422


def test_a_fleet_name_with_a_fragment_reaches_no_other_fleet(store: FleetCommitStore) -> None:
    """Fails on 5b0b0ae: urllib dropped ``#x/status`` from ``.../rolloutfleets/fleet#x/
    status``, so the commit went to RolloutFleet ``fleet`` itself, whose main resource
    ignores ``status``, and the compare-and-set reported SUCCESS with nothing written."""
    hashed = FleetCommitStore(store.kube, store.namespace, "fleet#x", refit="r1")
    assert hashed.path.endswith("/rolloutfleets/fleet%23x")
    assert hashed.compare_and_set(V0, V1) is CommitOutcome.FAILED  # no such fleet
    assert store.read() == V0


def test_a_compare_and_set_answered_without_the_record_written_is_unknown(
        store: FleetCommitStore, kube: KubeClient) -> None:
    """Fails on 5b0b0ae: any 200 counted as SUCCESS, also one from a patch that reached
    the fleet's main resource (which ignores ``status``) instead of its status."""
    real = kube.merge_patch

    def main_resource(path: str, body: Any) -> Any:
        return real(path.removesuffix("/status"), body)

    kube.merge_patch = main_resource  # type: ignore[method-assign]
    assert store.compare_and_set(V0, V1) is CommitOutcome.UNKNOWN
    kube.merge_patch = real  # type: ignore[method-assign]
    assert store.read() == V0


def test_api_paths_quote_names_as_single_segments() -> None:
    """Fails on 5b0b0ae: names went into paths as they were."""
    from dcr_operator.errors import InvalidResource
    from dcr_operator.kube import api_path

    assert api_path("dcr.dev", "v1alpha1", "rolloutfleets", "ns", "a#b", "status") == (
        "/apis/dcr.dev/v1alpha1/namespaces/ns/rolloutfleets/a%23b/status")
    assert api_path("", "v1", "secrets", "n/s", "a/b?c") == (
        "/api/v1/namespaces/n%2Fs/secrets/a%2Fb%3Fc")
    with pytest.raises(InvalidResource, match=r"'\.\.' is not an object name"):
        api_path("", "v1", "secrets", "ns", "..")


def _create(kube: KubeClient, namespace: str, obj: dict[str, Any], **query: str) -> Any:
    from k8sutil import path_of

    return kube.request("POST", path_of(obj, namespace), obj, query=query or None)


def _refit(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
            "metadata": {"name": "r"},
            "spec": {"fleet": "fleet", "baseVersion": 0, "targetVersion": 1,
                     "source": {"checkpoint": "/ckpt/v1"}, **spec}}


@pytest.mark.parametrize(("obj", "field"), [
    (_refit(fleet="fleet#x"), "spec.fleet"),
    (_refit(fleet="../fleet"), "spec.fleet"),
    (_refit(encoder={"profile": "Big/One"}), "spec.encoder.profile"),
    ({**fleet("f2"), "spec": {**fleet()["spec"], "agent": {"tokenSecretRef": {
        "name": "tok/../x"}}}}, "spec.agent.tokenSecretRef.name"),
    ({**fleet("f3"), "spec": {**fleet()["spec"], "encoderProfiles": [
        {"name": "p", "serviceAccountName": "a#b"}]}}, "spec.encoderProfiles[0]"),
])
def test_the_apiserver_refuses_object_names_that_are_not_rfc_1123(
        store: FleetCommitStore, kube: KubeClient, namespace: str, obj: dict[str, Any],
        field: str) -> None:
    """Fails on 5b0b0ae: the CRDs took any string as the name of another object."""
    from dcr_operator.errors import ApiError

    with pytest.raises(ApiError, match=re.escape(field)) as e:
        _create(kube, namespace, obj)
    assert e.value.status == 422


@pytest.mark.parametrize("selector", [
    {"matchLabels": {}}, {}, {"matchExpressions": []},
    {"matchLabels": {}, "matchExpressions": [{"key": "old", "operator": "DoesNotExist"}]},
    {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["x"]}]},
])
def test_the_apiserver_refuses_a_selector_that_selects_every_pod(
        store: FleetCommitStore, kube: KubeClient, namespace: str,
        selector: dict[str, Any]) -> None:
    """Fails on 5b0b0ae: ``matchLabels: {}`` (and expressions that only exclude) passed
    the CEL rule, and the fleet made every pod of the namespace a receiver."""
    from dcr_operator.errors import ApiError

    obj = {**fleet("everything"), "spec": {**fleet()["spec"], "selector": selector}}
    with pytest.raises(ApiError, match="selector needs a matchLabels entry") as e:
        _create(kube, namespace, obj)
    assert e.value.status == 422


def test_the_apiserver_keeps_no_pod_shaping_field_of_a_weightrefit(
        store: FleetCommitStore, kube: KubeClient, namespace: str) -> None:
    """Fails on 5b0b0ae: ``spec.encoder.image`` (and serviceAccountName, tolerations,
    nodeSelector) were stored and copied into the encoder Job."""
    from dcr_operator.errors import ApiError

    shaping = {"image": "attacker/miner:1", "serviceAccountName": "admin",
               "tolerations": [{"operator": "Exists"}], "nodeSelector": {"a": "b"}}
    with pytest.raises(ApiError, match=r'unknown field "spec\.encoder\.image"') as e:
        _create(kube, namespace, _refit(encoder=shaping), fieldValidation="Strict")
    assert e.value.status == 400
    created = _create(kube, namespace, _refit(encoder=shaping))  # pruned, as any unknown
    assert created["spec"]["encoder"] == {"owners": 1, "profile": "default"}


def _published(kube: KubeClient, namespace: str) -> dict[str, Any]:
    cm = kube.get(f"/api/v1/namespaces/{namespace}/configmaps/fleet-commit")
    published: dict[str, Any] = json.loads(cm["data"][COMMIT_FILE_KEY])
    return published


def test_the_fleets_commit_configmap_appears_with_the_record_and_follows_each_commit(
        store: FleetCommitStore, kube: KubeClient, namespace: str) -> None:
    """The operator publishes the record to the fleet's pods in ``<fleet>-commit`` (owned by
    the fleet; pods mount it and pass ``--commit-file``) as it writes ``status.commit``; a
    poll puts a ConfigMap edited by hand right again, and one the fleet does not own is
    left alone."""
    store.initialize()
    assert _published(kube, namespace) == {"format": "dcr-commit", "format_version": 1,
                                           "committed_version": 0, "history_digest": None}
    one = CommitRecord(committed_version=1, baseline_id="/ckpt/v1", attempt="a-000000000001",
                       history_digest="ab" * 16)
    assert store.compare_and_set(V0, one) is CommitOutcome.SUCCESS
    assert _published(kube, namespace) == {"format": "dcr-commit", "format_version": 1,
                                           "committed_version": 1, "history_digest": "ab" * 16}
    cm = kube.get(f"/api/v1/namespaces/{namespace}/configmaps/fleet-commit")
    (owner,) = cm["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("RolloutFleet",
                                             kube.get(store.path)["metadata"]["uid"])
    assert publish_commit(kube, namespace, "fleet") is False  # nothing to change

    kube.merge_patch(f"/api/v1/namespaces/{namespace}/configmaps/fleet-commit",
                     {"data": {COMMIT_FILE_KEY: '{"committed_version": 9}'}})
    assert publish_commit(kube, namespace, "fleet") is True
    assert _published(kube, namespace)["history_digest"] == "ab" * 16

    apply(kube, [fleet("other"), {"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": {"name": "other-commit"}, "data": {"x": "y"}}],
          namespace)
    other = FleetCommitStore(kube, namespace, "other")
    assert other.initialize() == V0  # the commit is recorded all the same
    with pytest.raises(InvalidResource, match="is not RolloutFleet other's"):
        publish_commit(kube, namespace, "other")
    assert kube.get(f"/api/v1/namespaces/{namespace}/configmaps/other-commit")["data"] == {
        "x": "y"}
