"""The commit record in a RolloutFleet's status: compare-and-set on a real apiserver."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from k8sutil import apply, install_crds

from dcr.protocol.commitstore import CommitStoreError
from dcr.protocol.records import CommitOutcome, CommitRecord
from dcr_operator.commitstore import FleetCommitStore
from dcr_operator.kube import Credentials, KubeClient

pytestmark = pytest.mark.e2e

V0 = CommitRecord(committed_version=0, baseline_id="/ckpt/v0", attempt="")
V1 = CommitRecord(committed_version=1, baseline_id="/ckpt/v1", attempt="a-000000000001")


def fleet(name: str = "fleet") -> dict[str, Any]:
    return {"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": "x"}}, "runtime": "hf",
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
        calls += 1
        if calls == 1:
            kube.merge_patch(store.path + "/status", {"status": {"receiverCount": 7}})
        return out

    kube.get = racing_get  # type: ignore[method-assign]
    assert store.compare_and_set(V0, V1) is CommitOutcome.SUCCESS
    assert calls == 2  # the precondition failed once (409), the record had not moved
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
    offline = FleetCommitStore(KubeClient(lambda: Credentials(server=dead), timeout_s=2),
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


def test_the_apiserver_refuses_a_fleet_with_both_or_neither_store_and_relay(
        store: FleetCommitStore, kube: KubeClient) -> None:
    from dcr_operator.errors import ApiError

    with pytest.raises(ApiError, match="exactly one of store and relay") as e:
        kube.merge_patch(store.path, {"spec": {"relay": {
            "url": "http://relay:8470", "tokenSecretRef": {"name": "t"}}}})
    assert e.value.status == 422
