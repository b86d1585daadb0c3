"""A RolloutFleet of replicas that span pods (``spec.groups``), driven by the real operator.

Setup (once for the module), on the session's control plane: the chart's RBAC in a fresh
namespace, the operator as a subprocess under it, encoder Jobs run by the stand-in
kubelet. Group ``g0`` is one replica of two pods (:class:`replica_group.TwoPodReplica`:
the leader's ``dcr serve`` holds TP rank 0 and reaches the worker's, rank 1; the worker's
agent is a member); its Pod objects carry a LeaderWorkerSet's labels and the processes'
loopback addresses. Group ``g1`` has a leader Pod whose worker never leaves Pending.

The tests run in order: the fleet counts groups and shows their pods; v1 commits through
``g0``'s leader alone, bit-exact on both ranks; the worker pod's restart makes the group's
weights unknown and the fleet poll brings the whole group back to v1 from the store.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from controlplane import ControlPlane
from k8sutil import admin_client, apply, eventually
from kubelet import FakeKubelet
from operatorproc import Operator, chart_namespace
from replica_group import TwoPodReplica, export_llama_versions
from stubs import free_port_on
from transformers import LlamaConfig

from dcr_operator.api.rolloutfleet import LWS_GROUP_KEY, LWS_WORKER_INDEX
from dcr_operator.kube import KubeClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

FLEET = "groups"
TOKEN = "groups-agent-token-0123456789abcdef"
LLAMA = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False)
HOSTS = ("127.0.0.20", "127.0.0.21")  # g0's leader and worker pods
LONE_LEADER = "127.0.0.22"  # g1's leader: nothing listens there


@dataclass
class GroupFleet:
    kube: KubeClient
    ns: str
    versions: Path
    replica: TwoPodReplica
    operator: Operator
    kubelet: FakeKubelet

    def path(self, plural: str, name: str = "") -> str:
        return f"/apis/dcr.dev/v1alpha1/namespaces/{self.ns}/{plural}" + (
            f"/{name}" if name else "")

    def status(self) -> dict[str, Any]:
        return dict(self.kube.get(self.path("rolloutfleets", FLEET)).get("status") or {})

    def receivers(self) -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in self.status().get("receivers") or []}

    def refit(self, name: str, base: int, target: int) -> dict[str, Any]:
        apply(self.kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
                           "metadata": {"name": name},
                           "spec": {"fleet": FLEET, "baseVersion": base,
                                    "targetVersion": target,
                                    "source": {"checkpoint": str(self.versions / f"v{target}")}}
                           }], self.ns)
        try:
            eventually(lambda: self._phase(name) in ("Committed", "Failed"), timeout_s=240,
                       what=f"WeightRefit {name} finished")
        finally:
            obj = self.kube.get(self.path("weightrefits", name))
        assert obj["status"]["phase"] == "Committed", (
            f"status: {obj['status']}\nkubelet: {self.kubelet.errors}\n"
            f"operator log:\n{self.operator.tail()}")
        return dict(obj)

    def _phase(self, name: str) -> str | None:
        got = self.kube.get(self.path("weightrefits", name)).get("status") or {}
        return got.get("phase")


def _pod(name: str, group: str, index: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "rollout", LWS_GROUP_KEY: group,
                                                  LWS_WORKER_INDEX: str(index)}},
            "spec": {"containers": [{"name": "agent", "image": "dcr:test"}]}}


@pytest.fixture(scope="module")
def fleet(control_plane: ControlPlane, helm: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[GroupFleet]:
    if not control_plane.has_controller_manager:
        pytest.skip("no kube-controller-manager: encoder Jobs would never get pods")
    cp, kube, tmp = control_plane, admin_client(control_plane), tmp_path_factory.mktemp("groups")
    versions = tmp / "versions"
    export_llama_versions(versions, LLAMA)
    ns = f"groups-{int(time.time())}"
    kubeconfig = chart_namespace(cp, helm, ns, "dcr-groups", tmp)
    port = free_port_on(*HOSTS, LONE_LEADER)
    (tmp / "store").mkdir()
    replica = TwoPodReplica(tmp / "pods", versions, tmp / "store", TOKEN, hosts=HOSTS,
                            agent_port=port)
    apply(kube, [{"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": "agent-token", "labels": {"dcr.dev/agent-token": "true"}},
                  "data": {"token": base64.b64encode(TOKEN.encode()).decode()}}], ns)
    running = {"rollout-0": HOSTS[0], "rollout-0-1": HOSTS[1], "rollout-1": LONE_LEADER}
    apply(kube, [_pod("rollout-0", "g0", 0), _pod("rollout-0-1", "g0", 1),
                 _pod("rollout-1", "g1", 0), _pod("rollout-1-1", "g1", 1)], ns)
    for name, ip in running.items():
        kube.merge_patch(f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}]}})
    operator = Operator("groups", ns, kubeconfig, tmp / "operator.log", priority=100)
    with FakeKubelet(kube, ns, "dcr.dev/component in (encoder,snapshot)", tmp) as kubelet:
        operator.start()
        try:
            apply(kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
                          "metadata": {"name": FLEET},
                          "spec": {"selector": {"matchLabels": {"app": "rollout"}},
                                   "groups": {"size": 2},
                                   "agent": {"port": port,
                                             "tokenSecretRef": {"name": "agent-token"}},
                                   "store": {"uri": (tmp / "store").as_uri()},
                                   "initial": {"version": 0,
                                               "checkpoint": str(versions / "v0")},
                                   "commitPolicy": {"attemptTimeoutSeconds": 120}}}], ns)
            yield GroupFleet(kube=kube, ns=ns, versions=versions, replica=replica,
                             operator=operator, kubelet=kubelet)
        finally:
            operator.stop()
            replica.close()
            cp.request("DELETE", f"/api/v1/namespaces/{ns}")


def test_the_fleet_counts_groups_and_shows_each_groups_pods(fleet: GroupFleet) -> None:
    """Fails without spec.groups: the worker pods were receivers of their own (the
    operator called a member agent as if it drove an engine) and the fleet counted four
    receivers where it has two replicas."""
    eventually(lambda: fleet.status().get("readyReceivers") == 1, timeout_s=120,
               what="the fleet's first poll")
    st = fleet.status()
    assert (st["receiverCount"], st["podCount"]) == (2, 4)
    got = fleet.receivers()
    assert got.keys() == {"rollout-0", "rollout-1"}
    assert (got["rollout-0"]["pods"], got["rollout-0"]["version"]) == (
        ["rollout-0", "rollout-0-1"], 0)
    assert got["rollout-0"]["url"] == f"http://{HOSTS[0]}:{fleet.replica.agent_port}"
    assert got["rollout-1"] == {
        "name": "rollout-1", "pods": ["rollout-1", "rollout-1-1"],
        "error": "Group g1 (rollout-1, rollout-1-1) has 1 of its 2 pods Running; it takes "
                 "part once all are."}
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["message"].endswith(": rollout-1.")) == ("True", True)


def test_a_refit_drives_a_group_through_its_leader_and_is_bit_exact_on_every_rank(
        fleet: GroupFleet) -> None:
    """One receiver per complete group: the attempt names g0's leader only, its member
    staged the attempt in the worker pod, and both ranks hold v1 bit for bit. g1 (a worker
    Pending) is not counted, so the default minReceivers (90% of one) does not wait for it."""
    refit = fleet.refit("groups-v1", 0, 1)
    (attempt,) = refit["status"]["attempts"]
    assert (attempt["receiverCount"], attempt.get("leftOut", [])) == (1, [])
    assert [r["name"] for r in refit["status"]["receivers"]] == ["rollout-0"]
    fleet.replica.assert_holds(1)
    log = fleet.replica.member.log_path.read_text()
    assert f"staging attempt {attempt['id']}" in log


def test_a_worker_pods_restart_makes_the_group_rejoin_v1_from_the_store(
        fleet: GroupFleet) -> None:
    """The worker pod's rank restarts with v0: the leader's agent sees a new instance (its
    weights unknown), the fleet poll rejoins the group to the committed v1 from the
    store's history, each pod building it under its own root, and both ranks hold v1."""
    before = fleet.replica.instance()
    fleet.replica.restart_worker()
    eventually(lambda: fleet.replica.instance() != before
               and fleet.receivers()["rollout-0"].get("version") == 1
               and not fleet.receivers()["rollout-0"].get("error"),
               timeout_s=240, what="the group rejoined v1 after its worker pod restarted")
    fleet.replica.assert_holds(1)
    built = [p.name for p in fleet.replica.root("worker").iterdir() if p.name != "v0"]
    assert built, "the member built v1 under the worker pod's own root"
