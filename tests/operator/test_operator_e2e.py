"""The operator end to end on a real control plane, with real agents and encoders.

Setup (once for the module): etcd, kube-apiserver and kube-controller-manager (the Job
controller and garbage collector) on loopback; the CRDs and the chart's ServiceAccount,
Role, RoleBinding and KopfPeering from ``helm template``; the operator as a subprocess
(``python -m dcr_operator``) authenticated with that ServiceAccount's bound token, so
every call it makes goes through the chart's RBAC. A standby operator of lower priority
waits behind it (kopf peering). Three rollout pods are each a ``dcr serve`` reference
server holding a small Llama model through transformers and a ``dcr agent`` sidecar
driving it, sharing a staging directory; each pod's two processes are on its own
loopback address (127.0.0.2, .3, .4), the agent on the fleet's agent port; three Pod
objects stand for them, each with that address as its ``status.podIP`` (the only
address the operator calls). Encoder
Jobs are created by the operator, their pods by the real Job controller, and run here by
a stand-in kubelet (:mod:`kubelet`). A trainer takes real AdamW steps and exports a
checkpoint per version.

The tests then run in order, each on the state the previous one left:
v1 commits through a two-owner indexed Job; v2 survives an agent killed mid-refit; v3
survives the working operator being killed mid-attempt (the standby takes over and
retries in overwrite mode while the dead attempt's encoder still writes); a refit from a
stale base version is rejected; ``kubectl get`` shows the printer columns; deleting a
refit cleans its payloads from the store; v4 commits through a warm encoder (``dcr
encoder`` on loopback, named by a fleet encoder profile's endpoint) with no Job, asked
for and waited on by ``dcr.client`` as a training loop would; v5
commits through Jobs in a second control plane (the training cluster), which the
operator reaches only through a kubeconfig Secret; v6 leaves a dead agent out; v8 waits for
v7; v9 and v10 are published by the example loop's two FSDP2 training ranks
(``python -m dcr.loop``), serving their own shards and asking for each refit with
``dcr.client``, with no checkpoint written.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from clusters import CLUSTER_TRAINER
from controlplane import ControlPlane
from k8sutil import REPO, admin_client, apply, eventually, path_of
from kubelet import FakeKubelet
from kubernetes.client import ApiClient, Configuration
from operatorproc import Operator, chart_namespace
from promtext import matching, value
from stubs import free_port_on

from dcr.client import Progress
from dcr.client import refit as client_refit
from dcr.errors import DcrError
from dcr.format.history import HISTORY_KEY, History
from dcr.refit.launch import AgentProcess, EncoderProcess, ServeProcess
from dcr.refit.trainer import Trainer, reference_fingerprint
from dcr_operator.jobs import job_name
from dcr_operator.kube import KubeClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

FLEET = "rollout"
TOKEN = "e2e-agent-token-0123456789abcdef"
AGENTS = 3
TRAINER = CLUSTER_TRAINER


@dataclass
class Scenario:
    cp: ControlPlane
    kube: KubeClient
    ns: str
    tmp: Path
    store: Path
    trainer: Trainer
    agents: list[AgentProcess]
    servers: list[ServeProcess]
    kubelet: FakeKubelet
    primary: Operator
    standby: Operator
    ckpts: dict[int, Path] = field(default_factory=dict)

    def path(self, plural: str, name: str = "", group: str = "dcr.dev/v1alpha1") -> str:
        root = "/api/v1" if group == "v1" else f"/apis/{group}"
        return f"{root}/namespaces/{self.ns}/{plural}" + (f"/{name}" if name else "")

    def refit(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.kube.get(self.path("weightrefits", name))
        return obj

    def fleet(self) -> dict[str, Any]:
        obj: dict[str, Any] = self.kube.get(self.path("rolloutfleets", FLEET))
        return obj

    def new_version(self, v: int) -> Path:
        self.trainer.step()
        self.ckpts[v] = self.trainer.export(self.tmp / "ckpts" / f"v{v}")
        return self.ckpts[v]

    def create_refit(self, name: str, base: int, target: int, **encoder: Any) -> None:
        apply(self.kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
                           "metadata": {"name": name},
                           "spec": {"fleet": FLEET, "baseVersion": base,
                                    "targetVersion": target,
                                    "source": {"checkpoint": str(self.ckpts[target])},
                                    "encoder": encoder}}], self.ns)

    def wait_phase(self, name: str, phase: str, timeout_s: float = 240) -> dict[str, Any]:
        try:
            got = eventually(lambda: (self.refit(name).get("status") or {}).get("phase")
                             in (phase, "Committed", "Failed"),
                             timeout_s=timeout_s, what=f"WeightRefit {name} {phase}")
            assert self.refit(name)["status"]["phase"] == phase, got
        except AssertionError as e:
            pods = "\n".join(f"{k}: {v[-2000:]}" for k, v in self.kubelet.logs.items())
            raise AssertionError(f"{e}\nstatus: {self.refit(name).get('status')}\n"
                                 f"kubelet errors: {self.kubelet.errors}\npods:\n{pods}\n"
                                 f"operator log:\n{self.primary.tail()}\n"
                                 f"standby log:\n{self.standby.tail()}") from None
        return self.refit(name)

    def events(self, name: str) -> list[tuple[str, str, str]]:
        items = self.kube.get(self.path("events", group="v1"))["items"]
        return [(e["type"], e["reason"], e.get("message", "")) for e in items
                if e["involvedObject"]["name"] == name]

    def exact(self, v: int) -> bool:
        want = reference_fingerprint(self.ckpts[v])
        return all(a.client().fingerprint() == want for a in self.agents)


def _conditions(obj: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in obj["status"]["conditions"]}


def _pod(i: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"rollout-{i}", "labels": {"app": "rollout"}},
            "spec": {"containers": [{"name": "agent", "image": "dcr:test"}]}}


@pytest.fixture(scope="module")
def scenario(control_plane: ControlPlane, helm: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Scenario]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    if not control_plane.has_controller_manager:
        pytest.skip("no kube-controller-manager: encoder Jobs would never get pods")
    cp, kube, tmp = control_plane, admin_client(control_plane), tmp_path_factory.mktemp("e2e")
    ns = f"e2e-{int(time.time())}"
    # The chart, rendered for this namespace: CRDs, then RBAC, ServiceAccount, peering.
    kubeconfig = chart_namespace(cp, helm, ns, "dcr-e2e", tmp)

    trainer = Trainer(TRAINER)
    sc_ckpts = {0: trainer.export(tmp / "ckpts" / "v0")}
    store = tmp / "store"
    hosts = [f"127.0.0.{i + 2}" for i in range(AGENTS)]  # each pod's IP
    port = free_port_on(*hosts)  # the fleet's agent port
    staging = [tmp / "pods" / str(i) / "staging" for i in range(AGENTS)]
    # Each pod's own volume holds the starting model only; rejoins build from the store.
    weights = [tmp / "pods" / str(i) / "weights" for i in range(AGENTS)]
    for w in weights:
        shutil.copytree(sc_ckpts[0], w / "v0")
    servers = [ServeProcess(name=f"serve-{i}", workdir=tmp / "pods" / str(i) / "serve",
                            host=hosts[i], port=_other_port(hosts[i], port),
                            args=["--runtime", "hf", "--model", str(weights[i] / "v0"),
                                  "--checkpoint-root", str(weights[i]),
                                  "--staging-dir", str(staging[i]), "--weight-version", "0"])
               for i in range(AGENTS)]
    agents = [AgentProcess(name=f"rollout-{i}", state_dir=tmp / "agents" / str(i), token=TOKEN,
                           host=hosts[i], port=port,
                           args=["--store", store.as_uri(), "--engine-url", servers[i].url,
                                 "--staging-dir", str(staging[i]),
                                 "--canonical", str(weights[i] / "v0")])
              for i in range(AGENTS)]
    for d in staging:
        d.mkdir(parents=True)
    for proc in [*servers, *agents]:
        proc.start()
    for proc in [*servers, *agents]:
        proc.wait_ready()
    for a in agents:
        a.client().profile()  # returns once the agent has met and prewarmed its server
    apply(kube, [{"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": "agent-token", "labels": {"dcr.dev/agent-token": "true"}},
                  "data": {"token": base64.b64encode(TOKEN.encode()).decode()}}], ns)
    for i, a in enumerate(agents):
        apply(kube, [_pod(i)], ns)
        kube.merge_patch(f"/api/v1/namespaces/{ns}/pods/rollout-{i}/status", {"status": {
            "phase": "Running", "podIP": a.host, "podIPs": [{"ip": a.host}],
            "conditions": [{"type": "Ready", "status": "True"}]}})
    primary = Operator("primary", ns, kubeconfig, tmp / "operator-primary.log", priority=100)
    standby = Operator("standby", ns, kubeconfig, tmp / "operator-standby.log", priority=50)
    with FakeKubelet(kube, ns, "dcr.dev/component in (encoder,snapshot)", tmp) as kubelet:
        primary.start()
        time.sleep(1.0)  # the primary registers first; the standby then pauses behind it
        standby.start()
        apply(kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
                      "metadata": {"name": FLEET},
                      "spec": {"selector": {"matchLabels": {"app": "rollout"}},
                               "agent": {"port": port,
                                         "tokenSecretRef": {"name": "agent-token"}},
                               "store": {"uri": store.as_uri()},
                               "initial": {"version": 0, "checkpoint": str(sc_ckpts[0])},
                               # The kill tests wait for every receiver; the last test
                               # goes back to the default (90%: one of three may be out).
                               "commitPolicy": {"attemptTimeoutSeconds": 120,
                                                "minReceivers": 3},
                               "retention": {"snapshotEvery": 2},
                               "retryLimit": 4}}], ns)
        sc = Scenario(cp=cp, kube=kube, ns=ns, tmp=tmp, store=store, trainer=trainer,
                      agents=agents, servers=servers, kubelet=kubelet, primary=primary,
                      standby=standby, ckpts=sc_ckpts)
        try:
            yield sc
        finally:
            primary.stop()
            standby.stop()
            for proc in [*agents, *servers]:
                proc.stop()
            cp.request("DELETE", f"/api/v1/namespaces/{ns}")


def _other_port(host: str, taken: int) -> int:
    """A port free on ``host`` other than ``taken`` (the agents', not yet listening)."""
    while (port := free_port_on(host)) == taken:
        pass
    return port


def test_a_new_fleet_gets_its_initial_commit_record_and_ready_receivers(scenario: Scenario
                                                                        ) -> None:
    sc = scenario

    def ready() -> dict[str, Any] | None:
        status: dict[str, Any] = sc.fleet().get("status") or {}
        return status if status.get("readyReceivers") == 3 else None

    status = eventually(ready, timeout_s=60, what="fleet Ready with 3 receivers")
    assert status["commit"] == {"committedVersion": 0, "baselineId": str(sc.ckpts[0]),
                                "attempt": ""}
    assert [r["name"] for r in status["receivers"]] == ["rollout-0", "rollout-1", "rollout-2"]
    assert all(r["version"] == 0 for r in status["receivers"])
    assert _conditions(sc.fleet())["Ready"] == ("True", "AllReceiversCommitted")
    assert ("Normal", "Initialized") in {e[:2] for e in sc.events(FLEET)}


def test_a_refit_commits_through_a_two_owner_indexed_encoder_job_bit_exact(
        scenario: Scenario) -> None:
    sc = scenario
    sc.new_version(1)
    sc.create_refit("policy-v1", 0, 1, owners=2)
    refit = sc.wait_phase("policy-v1", "Committed")
    st = refit["status"]
    (attempt,) = st["attempts"]
    assert (attempt["mode"], attempt["outcome"]) == ("mixed", "Committed")
    assert attempt["receiverCount"] == 3
    assert st["receiverCount"] == 3
    assert st["receiverStates"] == [{"state": "committed", "count": 3}]
    assert attempt["payloads"] >= 2  # one or more from each owner
    assert attempt["bytes"] > 0
    assert {"prepare", "publish", "flush", "commit"} <= set(attempt["stages"])
    assert (st["attemptCount"], st["bytes"]) == (1, attempt["bytes"])
    assert _conditions(refit) == {
        "Validated": ("True", "BaseVersionCommitted"), "Applying": ("False", "Committed"),
        "Encoding": ("False", "Committed"), "Failed": ("False", "Committed"),
        "Committed": ("True", "Committed")}
    commit = sc.fleet()["status"]["commit"]
    assert (commit["committedVersion"], commit["baselineId"], commit["attempt"],
            commit["refit"]) == (1, str(sc.ckpts[1]), attempt["id"], "policy-v1")
    assert st["committed"]["attempt"] == attempt["id"]
    assert {r["name"]: r["state"] for r in st["receivers"]} == dict.fromkeys(
        ["rollout-0", "rollout-1", "rollout-2"], "committed")
    # The encoder Job: deterministic name, indexed, owned by the refit, both indexes done.
    job = sc.kube.get(sc.path("jobs", attempt["job"], group="batch/v1"))
    assert attempt["job"] == job_name("policy-v1", attempt["id"])
    assert (job["spec"]["completionMode"], job["spec"]["completions"]) == ("Indexed", 2)
    assert job["status"]["completedIndexes"] == "0,1"
    assert job["metadata"]["ownerReferences"][0]["uid"] == refit["metadata"]["uid"]
    profile = sc.kube.get(sc.path("configmaps", "policy-v1-profile", group="v1"))
    assert "profile.json" in profile["data"]
    reasons = [e[1] for e in sc.events("policy-v1")]
    for r in ("Validated", "AttemptStarted", "EncoderJobCreated", "Committed"):
        assert r in reasons, reasons
    assert ("Normal", "Committed") in {e[:2] for e in sc.events(FLEET)}
    assert sc.exact(1)
    eventually(lambda: sc.fleet()["status"].get("readyReceivers") == 3
               and "activeRefit" not in sc.fleet()["status"], what="fleet Ready at v1")


class _Killer(threading.Thread):
    """SIGKILLs an agent as soon as it applies an attempt (its journal says dirty), then
    restarts it. Its server keeps the half-written weights: the restarted agent reports
    them unknown, and a dense load restores them. (An agent killed before it wrote
    anything would restart at its version, with nothing to repair.)"""

    def __init__(self, victim: AgentProcess) -> None:
        super().__init__(name=f"kill-{victim.name}", daemon=True)
        self.victim, self.state = victim, ""
        self.done = threading.Event()

    def run(self) -> None:
        client = self.victim.client(timeout_s=5.0)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    st = client.status()
                except DcrError:
                    time.sleep(0.01)
                    continue
                if st.attempt is not None and st.state == "applying":
                    self.state = str(st.state)
                    break
                time.sleep(0.005)
            self.victim.restart()  # same port and state dir, as a pod restart
        finally:
            self.done.set()


def test_an_agent_killed_mid_refit_rejoins_and_the_overwrite_retry_commits(
        scenario: Scenario) -> None:
    sc = scenario
    sc.new_version(2)
    victim = sc.agents[1]
    killer = _Killer(victim)
    killer.start()
    sc.create_refit("policy-v2", 1, 2)
    refit = sc.wait_phase("policy-v2", "Committed")
    killer.done.wait(60)
    assert killer.state, "the victim was never seen in an attempt"
    assert victim.restarts == 1
    attempts = refit["status"]["attempts"]
    assert [(a["mode"], a["outcome"]) for a in attempts] == [
        ("mixed", "Failed"), ("overwrite", "Committed")]
    assert "rollout-1" in attempts[0]["reason"]
    # The restarted agent holds unknown weights; a dense load restores v1 before it takes
    # part again: the retry's admission does it, or, if the agent was still starting then
    # and the refit waited for it, the fleet poll's catch-up did it in between (which of
    # the two depends on how fast the agent restarts on a busy machine).
    by_refit = attempts[1]["rejoined"] == ["rollout-1"]
    by_fleet = "rollout-1 holds None" in sc.primary.tail(1_000_000)
    assert by_refit or by_fleet, sc.primary.tail()
    if by_refit:
        assert "ReceiverRejoined" in [e[1] for e in sc.events("policy-v2")]
    assert sc.fleet()["status"]["commit"]["attempt"] == attempts[1]["id"]
    assert ("Warning", "AttemptFailed") in {e[:2] for e in sc.events("policy-v2")}
    assert sc.exact(2)


def test_the_operator_exports_refits_attempts_stages_bytes_and_fleets_to_prometheus(
        scenario: Scenario) -> None:
    m = scenario.primary.metrics()  # it ran policy-v1 (clean) and policy-v2 (a kill)
    fleet = {"namespace": scenario.ns, "fleet": FLEET}
    committed = {"outcome": "Committed", **fleet}
    assert value(m, "dcr_operator_refits_total", **committed) == 2
    assert value(m, "dcr_operator_refits_total", outcome="Failed", **fleet) == 0
    assert value(m, "dcr_operator_attempts_total", mode="mixed", **committed) == 1
    assert value(m, "dcr_operator_attempts_total", mode="overwrite", **committed) == 1
    failed = value(m, "dcr_operator_attempts_total", mode="mixed", outcome="Failed", **fleet)
    assert failed >= 1
    reasons = matching(m, "dcr_operator_attempt_failures_total", **fleet)
    assert sum(reasons.values()) == failed
    assert all(dict(k)["reason"].isidentifier() for k in reasons), reasons  # AgentError, ...
    assert value(m, "dcr_operator_committed_version", **fleet) == 2
    assert value(m, "dcr_operator_payload_bytes_total", **fleet) == sum(
        scenario.refit(n)["status"]["bytes"] for n in ("policy-v1", "policy-v2"))
    # Refit durations, a histogram per fleet: both commits, each under its largest bucket.
    assert value(m, "dcr_operator_refit_duration_seconds_count", **fleet) == 2
    assert value(m, "dcr_operator_refit_duration_seconds_sum", **fleet) > 0
    assert value(m, "dcr_operator_refit_duration_seconds_bucket", le="+Inf", **fleet) == 2
    # Every ended attempt's stages: three attempts prepared (one failed), two committed.
    assert value(m, "dcr_operator_attempt_stage_duration_seconds_count", stage="commit") == 2
    assert value(m, "dcr_operator_attempt_stage_duration_seconds_count", stage="prepare") >= 3
    last = value(m, "dcr_operator_last_commit_timestamp_seconds", **fleet)
    assert time.time() - 3600 < last <= time.time()
    assert value(m, "dcr_operator_refits_running") == 0
    assert value(scenario.standby.metrics(), "dcr_operator_refits_running") == 0  # paused


def test_the_standby_takes_over_a_refit_whose_operator_died_and_nothing_applies_twice(
        scenario: Scenario) -> None:
    sc = scenario
    # retention.snapshotEvery 2: v2's commit started a Job writing v2's snapshot.
    eventually(lambda: (sc.store / "snapshots" / "v0000000002" / "index.dcrs").is_file(),
               timeout_s=120, what="the snapshot Job of v2 done")
    sc.new_version(3)
    sc.kubelet.hold(lambda pod: pod["metadata"]["labels"].get("dcr.dev/refit") == "policy-v3")
    sc.create_refit("policy-v3", 2, 3, owners=2)

    def running() -> dict[str, Any] | None:
        st = sc.refit("policy-v3").get("status") or {}
        held = [a for a in st.get("attempts", []) if a["outcome"] == "Running" and a.get("job")]
        return held[0] if held and any(p.startswith(held[0]["job"])
                                       for p in sc.kubelet.started) else None

    first = eventually(running, timeout_s=120, what="policy-v3's first attempt encoding")
    sc.primary.kill()  # mid-attempt: receivers prepared, gates closed, encoders held
    # The dead operator's peering record expires; the standby resumes the refit: the old
    # attempt is abandoned, its Job deleted, a new attempt runs in overwrite mode.
    def another() -> dict[str, Any] | None:
        st = sc.refit("policy-v3").get("status") or {}
        return next((a for a in st.get("attempts", []) if a["id"] != first["id"]), None)

    second = eventually(another, timeout_s=120, what="the standby's attempt")
    # The dead attempt's encoders now write after all (a zombie): nobody may apply them.
    sc.kubelet.release(zombies=True)
    refit = sc.wait_phase("policy-v3", "Committed")
    attempts = {a["id"]: a for a in refit["status"]["attempts"]}
    assert attempts[first["id"]]["outcome"] == "Abandoned"
    assert (attempts[second["id"]]["mode"], attempts[second["id"]]["outcome"]) == (
        "overwrite", "Committed")
    assert sc.fleet()["status"]["commit"]["attempt"] == second["id"]
    assert sc.kube.get(sc.path("jobs", group="batch/v1"), labelSelector=(
        f"dcr.dev/attempt={first['id']}"))["items"] == []  # deleted as obsolete
    for a in sc.agents:
        st = a.client().status()
        assert (st.version, st.attempt, st.state) == (3, second["id"], "committed")
    assert sc.exact(3)
    # v3's commit adopted v2's snapshot into the history, and the fleet's status says so.
    history = History.parse((sc.store / HISTORY_KEY).read_bytes(), "the fleet's store")
    assert [s.version for s in history.snapshots] == [2]
    assert eventually(lambda: (sc.fleet()["status"].get("history") or {}).get("snapshots"),
                      timeout_s=60, what="status.history") == [2]
    # The standby was paused by the primary's peering record until it expired.
    assert "Resuming operations after the pause" in sc.standby.tail(400)


def test_a_refit_from_a_stale_base_version_is_rejected_with_a_clear_condition(
        scenario: Scenario) -> None:
    sc = scenario
    sc.create_refit("policy-stale", 1, 2)
    refit = sc.wait_phase("policy-stale", "Failed", timeout_s=60)
    failed = next(c for c in refit["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BaseVersionMismatch"
    assert failed["message"] == (
        f"WeightRefit policy-stale refits 1 -> 2, but RolloutFleet {FLEET} has committed "
        f"version 3 (checkpoint {sc.ckpts[3]}, attempt "
        f"{sc.fleet()['status']['commit']['attempt']}); a refit must start from the "
        "committed version (baseVersion 3).")
    assert _conditions(refit)["Validated"] == ("False", "BaseVersionMismatch")
    assert refit["status"].get("attempts", []) == []
    assert ("Warning", "RefitFailed") in {e[:2] for e in sc.events("policy-stale")}
    assert sc.kube.get(sc.path("jobs", group="batch/v1"),
                       labelSelector="dcr.dev/refit=policy-stale")["items"] == []


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_kubectl_get_shows_the_printer_columns(scenario: Scenario) -> None:
    sc = scenario
    def kubectl(*args: str) -> str:
        return subprocess.run(["kubectl", f"--kubeconfig={sc.cp.kubeconfig}", "-n", sc.ns,
                               *args], capture_output=True, text=True, check=True,
                              timeout=60).stdout

    out = kubectl("get", "rolloutfleets,weightrefits")
    wide = kubectl("get", "rolloutfleets,weightrefits", "-o", "wide")
    events = kubectl("get", "events", "--sort-by=.metadata.creationTimestamp",
                     "--field-selector=involvedObject.name=policy-v2")
    # docs/monitoring.md quotes these, captured from this apiserver.
    (sc.tmp / "kubectl-get.txt").write_text("\n".join([out, wide, events]))
    print(out, wide, events, sep="\n")
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "VERSION", "READY", "RECEIVERS", "PODS", "REFIT",
                                "STATUS", "AGE"]
    assert lines[1].split()[:5] == [f"rolloutfleet.dcr.dev/{FLEET}", "3", "3", "3", "3"]
    header = next(line for line in lines if line.startswith("NAME") and "FLEET" in line)
    assert header.split() == ["NAME", "FLEET", "VERSION", "PHASE", "REASON", "ATTEMPTS",
                              "RECEIVERS", "BYTES", "AGE"]
    rows = {line.split()[0]: line.split() for line in lines if "weightrefit" in line}
    assert rows["weightrefit.dcr.dev/policy-v2"][1:7] == [FLEET, "2", "Committed", "Committed",
                                                          "2", "3"]
    assert rows["weightrefit.dcr.dev/policy-stale"][3:6] == ["Failed", "BaseVersionMismatch",
                                                             "0"]


def test_deleting_a_refit_removes_its_payloads_and_its_jobs(scenario: Scenario) -> None:
    sc = scenario
    refit = sc.refit("policy-v2")
    ids = [a["id"] for a in refit["status"]["attempts"]]
    prefix = sc.store / "v0000000002"
    # The committed attempt's payloads are there (the killed one may never have encoded).
    assert (prefix / ids[-1]).is_dir()
    assert (prefix / ids[-1] / "manifest-o0000.dcrm").is_file()  # owners write per attempt
    sc.cp.request("DELETE", sc.path("weightrefits", "policy-v2"))
    eventually(lambda: sc.cp.request("GET", sc.path("weightrefits", "policy-v2")).status == 404,
               timeout_s=60, what="policy-v2 deleted (its finalizer done)")
    # Retention: the committed attempt stays (a receiver that missed v2 replays it from
    # the store), as the history the operator wrote names it; the others are gone.
    history = History.parse((sc.store / HISTORY_KEY).read_bytes(), "the fleet's store")
    assert history.entry(2).attempt == refit["status"]["committed"]["attempt"] == ids[-1]
    assert [i for i in ids if (prefix / i).exists()] == [ids[-1]]
    assert ("Normal", "StoreCleaned") in {e[:2] for e in sc.events("policy-v2")}
    eventually(lambda: sc.kube.get(sc.path("jobs", group="batch/v1"),
                                   labelSelector="dcr.dev/refit=policy-v2")["items"] == [],
               timeout_s=60, what="policy-v2's Jobs garbage-collected")
    assert (sc.store / "v0000000003").is_dir()  # other refits' objects stay


def test_a_refit_through_a_warm_encoder_endpoint_starts_no_job_and_commits_bit_exact(
        scenario: Scenario) -> None:
    """The fleet's owner adds an encoder profile whose endpoint is a ``dcr encoder``
    process on loopback (both owner indexes at its URL); a WeightRefit naming that
    profile commits without any Job, bit for bit, and no token shows anywhere."""
    sc = scenario
    sc.new_version(4)
    token = "e2e-encoder-token-0123456789abcdef"
    encoder = EncoderProcess(name="warm", workdir=sc.tmp / "encoder", token=token,
                             args=["--store", sc.store.as_uri(),
                                   "--checkpoint-root", str(sc.tmp / "ckpts")])
    encoder.start()
    try:
        encoder.wait_ready()
        apply(sc.kube, [{"apiVersion": "v1", "kind": "Secret",
                         "metadata": {"name": "encoder-token",
                                      "labels": {"dcr.dev/encoder-token": "true"}},
                         "data": {"token": base64.b64encode(token.encode()).decode()}}], sc.ns)
        sc.kube.merge_patch(sc.path("rolloutfleets", FLEET), {"spec": {"encoderProfiles": [
            {"name": "warm", "endpoint": {"urls": [encoder.url, encoder.url],
                                          "tokenSecretRef": {"name": "encoder-token"}}}]}})
        cp = sc.cp  # the training loop's way: dcr.client creates it and waits for the commit
        seen: list[Progress] = []
        with ApiClient(Configuration(host=cp.server, ssl_ca_cert=str(cp.ca_path),
                                     cert_file=str(cp.admin_cert_path),
                                     key_file=str(cp.admin_key_path))) as api:
            client_refit(FLEET, 4, str(sc.ckpts[4]), namespace=sc.ns, name="policy-v4",
                         encoder_profile="warm", owners=2, api_client=api,
                         on_progress=seen.append, progress_bar=False, timeout_s=240)
        assert seen[-1].phase == "Committed"
        assert seen[-1].applied == seen[-1].receivers == 3
        refit = sc.wait_phase("policy-v4", "Committed")
        (attempt,) = refit["status"]["attempts"]
        assert (attempt["mode"], attempt["outcome"]) == ("mixed", "Committed")
        assert attempt["endpoint"] == "warm"
        assert "job" not in attempt
        assert sc.kube.get(sc.path("jobs", group="batch/v1"), labelSelector=(
            "dcr.dev/refit=policy-v4,dcr.dev/component=encoder"))["items"] == []
        assert not [p for p in sc.kubelet.started  # (v4's snapshot Job runs: v4 % 2 == 0)
                    if p.startswith("policy-v4") and "snapshot" not in p]
        parts = sorted(p.name for p in (sc.store / "v0000000004" / attempt["id"]).iterdir()
                       if p.name.startswith("manifest"))
        assert parts == ["manifest-o0000.dcrm", "manifest-o0001.dcrm"]
        reasons = [e[1] for e in sc.events("policy-v4")]
        assert "EncoderEndpointCalled" in reasons
        assert "EncoderJobCreated" not in reasons
        assert sc.exact(4)
        for text in (sc.primary.tail(10_000), encoder.log_path.read_text(),
                     json.dumps(refit), json.dumps(sc.events("policy-v4"))):
            assert token not in text
    finally:
        encoder.stop()


@pytest.fixture(scope="module")
def training(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[ControlPlane, KubeClient, FakeKubelet]]:
    """A second control plane (the training cluster) with examples/training-cluster.yaml
    applied in its namespace dcr-encoders, and a stand-in kubelet for its encoder pods."""
    tmp = tmp_path_factory.mktemp("training")
    with ControlPlane(control_plane.binaries, workdir_prefix="dcr-training-") as cp:
        kube = admin_client(cp)
        kube.create("/api/v1/namespaces", {"metadata": {"name": "dcr-encoders"}})
        eventually(lambda: kube.get("/api/v1/namespaces/dcr-encoders/serviceaccounts/default"),
                   what="the training namespace's default ServiceAccount")
        example = REPO / "charts" / "dcr" / "examples" / "training-cluster.yaml"
        apply(kube, [o for o in yaml.safe_load_all(example.read_text()) if o], "dcr-encoders")
        with FakeKubelet(kube, "dcr-encoders", "dcr.dev/component in (encoder,snapshot)",
                         tmp) as kubelet:
            yield cp, kube, kubelet


def _kubeconfig(cp: ControlPlane, user: dict[str, Any]) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "training",
        "contexts": [{"name": "training", "context": {"cluster": "training", "user": "op"}}],
        "clusters": [{"name": "training", "cluster": {
            "server": cp.server,
            "certificate-authority-data": base64.b64encode(cp.ca_path.read_bytes()).decode()}}],
        "users": [{"name": "op", "user": user}]})


def test_encoder_jobs_run_in_a_training_cluster_reached_only_through_a_kubeconfig_secret(
        scenario: Scenario, training: tuple[ControlPlane, KubeClient, FakeKubelet]) -> None:
    """The fleet's profile names a kubeconfig Secret for a second control plane: a
    kubeconfig with an exec plugin is refused (the refit waits, saying so), the same
    refit proceeds once the Secret holds a plain token, its Jobs and the receiver
    profile run there (none in the rollout cluster), v5 commits bit-exact, and deleting
    the refit deletes its Jobs there, which no ownerReference could. While its encoder
    runs, the token is rotated as docs/two-clusters.md says (a second token into the
    Secret, then the first revoked by deleting the Secret it is bound to): the operator
    reads the Secret again and v5 commits in its first attempt."""
    sc = scenario
    cp_b, kube_b, kubelet_b = training
    sc.new_version(5)
    marker = sc.tmp / "exec-ran"

    def secret(kubeconfig: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "training-cluster",
                             "labels": {"dcr.dev/encoder-cluster": "true"}},
                "data": {"kubeconfig": base64.b64encode(kubeconfig.encode()).decode()}}

    apply(sc.kube, [secret(_kubeconfig(cp_b, {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": "touch",
        "args": [str(marker)], "interactiveMode": "Never"}}))], sc.ns)
    sc.kube.merge_patch(sc.path("rolloutfleets", FLEET), {"spec": {"encoderProfiles": [
        {"name": "training", "cluster": {"kubeconfigSecretRef": {"name": "training-cluster"},
                                         "namespace": "dcr-encoders"}}]}})
    sc.create_refit("policy-v5", 4, 5, profile="training", owners=2)

    def refused() -> str | None:
        for c in (sc.refit("policy-v5").get("status") or {}).get("conditions") or []:
            if c["type"] == "Validated" and c["status"] == "False" and "'exec'" in c["message"]:
                return str(c["message"])
        return None

    message = eventually(refused, timeout_s=60, what="the exec kubeconfig refused")
    assert "Secret" in message
    assert str(marker) not in message
    assert not marker.exists()  # the command never ran

    encoders = "/api/v1/namespaces/dcr-encoders/secrets"
    apply(kube_b, [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"op-token-{i}"}}
                   for i in (1, 2)], "dcr-encoders")
    token = cp_b.service_account_token("dcr-encoders", "dcr-operator-remote",
                                        bound_secret="op-token-1")
    kubelet_b.hold(lambda pod: pod["metadata"]["labels"].get("dcr.dev/refit") == "policy-v5")
    apply(sc.kube, [secret(_kubeconfig(cp_b, {"token": token}))], sc.ns)
    eventually(lambda: any(p.startswith("policy-v5") for p in kubelet_b.started),
               timeout_s=120, what="policy-v5's encoder pod started in the training cluster")
    rotated = cp_b.service_account_token("dcr-encoders", "dcr-operator-remote",
                                          bound_secret="op-token-2")
    apply(sc.kube, [secret(_kubeconfig(cp_b, {"token": rotated}))], sc.ns)
    kube_b.delete(f"{encoders}/op-token-1")  # the first token is revoked
    eventually(lambda: cp_b.request("GET", encoders, token=token).status == 401, timeout_s=60,
               what="the first token refused")
    kubelet_b.release()
    refit = sc.wait_phase("policy-v5", "Committed")
    assert [a["outcome"] for a in refit["status"]["attempts"]] == ["Committed"]
    logs = sc.primary.tail(10_000) + sc.standby.tail(10_000)  # (the standby took over v3)
    assert "refused its credentials: reading the Secret again" in logs
    assert sc.exact(5)
    uid = refit["metadata"]["uid"]
    there = kube_b.get("/apis/batch/v1/namespaces/dcr-encoders/jobs",
                       labelSelector=f"dcr.dev/refit-uid={uid}")["items"]
    assert there
    assert not any(j["metadata"].get("ownerReferences") for j in there)
    assert sc.kube.get(sc.path("jobs", group="batch/v1"),
                       labelSelector="dcr.dev/refit=policy-v5")["items"] == []
    assert any(p.startswith("policy-v5") for p in kubelet_b.finished)
    eventually(lambda: kube_b.get("/api/v1/namespaces/dcr-encoders/configmaps",
                                  labelSelector=f"dcr.dev/refit-uid={uid}")["items"] == [],
               timeout_s=30, what="the profile copy deleted once the refit committed")
    for text in (logs, json.dumps(refit), json.dumps(sc.events("policy-v5"))):
        assert token not in text
        assert rotated not in text

    sc.kube.delete(path_of(refit, sc.ns, named=True))
    eventually(lambda: kube_b.get("/apis/batch/v1/namespaces/dcr-encoders/jobs",
                                  labelSelector=f"dcr.dev/refit-uid={uid}")["items"] == [],
               timeout_s=60, what="policy-v5's Jobs deleted in the training cluster")


def test_with_the_default_min_receivers_a_dead_agent_is_left_out_and_caught_up_later(
        scenario: Scenario) -> None:
    """Fails on 0d5d9b5, where minReceivers defaulted to every selected pod: one agent
    that does not answer stalled the refit until its deadline. With the default (90% of
    three rounds down to two) v6 commits without it, its attempt and the AttemptStarted
    Event name it, and once it answers again the fleet brings it to v6 from the store."""
    sc = scenario
    sc.new_version(6)
    sc.kube.merge_patch(sc.path("rolloutfleets", FLEET),
                        {"spec": {"commitPolicy": {"minReceivers": None}}})
    assert sc.fleet()["spec"]["commitPolicy"]["minReceivers"] == "90%"
    victim = sc.agents[2]
    victim.kill()
    try:
        sc.create_refit("policy-v6", 5, 6)
        refit = sc.wait_phase("policy-v6", "Committed")
        (attempt,) = refit["status"]["attempts"]
        assert attempt["leftOut"] == ["rollout-2"]
        assert attempt["receiverCount"] == 2
        (started,) = [m for _, reason, m in sc.events("policy-v6") if reason == "AttemptStarted"]
        assert "Left out, not answering: rollout-2" in started
    finally:
        victim.start()
        victim.wait_ready()
    eventually(lambda: sc.exact(6), timeout_s=180,
               what="the left-out receiver caught up to v6 by the fleet poll")


def test_a_refit_created_before_its_base_commits_waits_for_it_then_commits(
        scenario: Scenario) -> None:
    """A trainer that creates step n+1's refit before step n's has committed (or even
    been created): v8 (base 7) waits, Validated=False WaitingForBaseVersion, nothing
    attempted, while the record names 6; v7 commits; then v8 commits from it."""
    sc = scenario
    sc.new_version(7)
    sc.new_version(8)
    sc.create_refit("policy-v8", 7, 8)

    def waiting() -> bool:
        status = sc.refit("policy-v8").get("status") or {}
        validated = [(c["status"], c["reason"]) for c in status.get("conditions", [])
                     if c["type"] == "Validated"]
        return validated == [("False", "WaitingForBaseVersion")] and not status.get("attempts")

    eventually(waiting, timeout_s=60, what="policy-v8 waiting for base version 7")
    assert sc.fleet()["status"]["commit"]["committedVersion"] == 6
    sc.create_refit("policy-v7", 6, 7)
    v7 = sc.wait_phase("policy-v7", "Committed")
    v8 = sc.wait_phase("policy-v8", "Committed")
    assert v7["status"]["committed"]["committedVersion"] == 7
    assert v8["status"]["committed"]["committedVersion"] == 8
    assert v7["status"]["completionTime"] <= v8["status"]["attempts"][0]["startTime"]
    assert sc.fleet()["status"]["commit"]["committedVersion"] == 8
    assert sc.exact(8)


def test_a_failed_encoder_job_says_why_in_the_refits_condition_and_event(
        scenario: Scenario) -> None:
    """Fails without the termination message: the condition and the Event said only
    "BackoffLimitExceeded", and why ``dcr encode`` failed sat in a pod log (often in
    another cluster). Now the encoder's own sentence, sanitized, is carried there."""
    sc = scenario
    committed = eventually(lambda: (sc.fleet().get("status") or {}).get("commit"),
                           timeout_s=60, what="a commit record")["committedVersion"]
    missing = sc.tmp / "ckpts" / "never-written"
    apply(sc.kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
                     "metadata": {"name": "policy-missing"},
                     "spec": {"fleet": FLEET, "baseVersion": committed,
                              "targetVersion": committed + 1,
                              "source": {"checkpoint": str(missing)}}}], sc.ns)
    refit = sc.wait_phase("policy-missing", "Failed")
    said = "CheckpointError: Checkpoint "
    assert all(said in a["reason"] and "does not exist" in a["reason"]
               for a in refit["status"]["attempts"]), refit["status"]["attempts"]
    failed = [e for e in sc.events("policy-missing") if e[1] == "EncoderJobFailed"]
    assert failed
    assert all(said in e[2] and "\n" not in e[2] for e in failed), failed
    assert sc.fleet()["status"]["commit"]["committedVersion"] == committed


def test_the_example_loops_fsdp2_ranks_are_the_owners_and_no_checkpoint_is_written(
        scenario: Scenario) -> None:
    """The example loop (``python -m dcr.loop``) as two gloo ranks started from v8:
    each step they train and offer, and rank 0 asks dcr.client for the refit (rollout-v9,
    then rollout-v10). Both commit through the operator with no Job and no checkpoint of
    either version written; the receivers hold, bit for bit, what rank 0 computes a dense
    load of v10 gives from its gathered weights. At v10 the ranks advance by the commit
    record the operator's request carries."""
    sc = scenario
    token = "e2e-rank-token-0123456789abcdef"
    workdir = sc.tmp / "ranks"
    workdir.mkdir()
    (workdir / "token").write_text(token)
    apply(sc.kube, [{"apiVersion": "v1", "kind": "Secret",
                     "metadata": {"name": "rank-token",
                                  "labels": {"dcr.dev/encoder-token": "true"}},
                     "data": {"token": base64.b64encode(token.encode()).decode()}}], sc.ns)
    master, *ports = _distinct_ports(3)
    sc.kube.merge_patch(sc.path("rolloutfleets", FLEET), {"spec": {
        "retention": {"snapshotEvery": None},  # a snapshot Job reads a checkpoint
        "encoderProfiles": [{"name": "ranks", "endpoint": {
            "urls": [f"http://127.0.0.1:{p}" for p in ports],
            "tokenSecretRef": {"name": "rank-token"}}}]}})
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(master), "KUBECONFIG": str(sc.cp.kubeconfig)}
    procs = []
    for rank, port in enumerate(ports):
        with (workdir / f"rank{rank}.log").open("w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dcr.loop", "--checkpoint", str(sc.ckpts[8]),
                 "--version", "8", "--steps", "2", "--fleet", FLEET, "--namespace", sc.ns,
                 "--store", sc.store.as_uri(), "--token-file", str(workdir / "token"),
                 "--listen", f"127.0.0.1:{port}", "--timeout-s", "240", "--fingerprint"],
                env={**env, "RANK": str(rank)}, stderr=log, text=True,
                stdout=subprocess.PIPE if rank == 0 else log))  # rank 0 prints the checks
    try:
        printed = procs[0].communicate(timeout=480)[0]
        procs[1].wait(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    logs = "".join(p.read_text() for p in sorted(workdir.glob("rank*.log")))
    assert [p.returncode for p in procs] == [0, 0], logs[-5000:]
    dense = {d["version"]: d["fingerprint"] for d in map(json.loads, printed.splitlines())}
    assert sorted(dense) == [9, 10]
    assert dense[9] != dense[10]
    for v in (9, 10):
        (attempt,) = sc.wait_phase(f"{FLEET}-v{v}", "Committed")["status"]["attempts"]
        assert (attempt["endpoint"], attempt["outcome"]) == ("ranks", "Committed")
    assert all(a.client().fingerprint() == dense[10] for a in sc.agents)
    assert sc.fleet()["status"]["commit"]["baselineId"] == f"/ranks/{FLEET}/v10"
    assert sc.kube.get(sc.path("jobs", group="batch/v1"), labelSelector=(
        f"dcr.dev/component in (encoder,snapshot),dcr.dev/refit in ({FLEET}-v9,{FLEET}-v10)"
    ))["items"] == []
    assert "baseline is now version 9" in logs  # advanced by v10's request
    assert token not in logs + printed + sc.primary.tail(10_000)


def _distinct_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port_on("127.0.0.1"))
    return sorted(ports)
