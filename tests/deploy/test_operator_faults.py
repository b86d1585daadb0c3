"""The deploy tier under drawn faults: the operator's Pod and the API server killed mid-refit.

A short seeded run of the fault campaign (docs/faults.md, "On the deploy tier") on the
tier's real node: the chart installed by ``helm install`` (its own release and
namespaces), the fleet and reference rollout examples with two Pods, encoder Jobs as Pods.
``random.Random(seed)`` draws, for each of a few refits, a moment (the WeightRefit
created, its first attempt started, an agent staging, an agent flushed: each read from
the refit's status or the agents' answers, never from a sleep) and a fault: the operator's
Pod deleted with grace 0, kube-apiserver killed -9 and restarted on the same etcd, or both
(the operator's container killed -9 while the API server is down). The seed is printed
and ``DCR_FAULT_SEED`` replays another.

What the parties answered goes to an event log that bench/faultcheck.py judges with the
campaign's own checks: the fleet's commit record as read from the API server, each
refit's commit as its status reports it, the agents' whole fingerprints against a dense
load, and every committed version built from the store by ``dcr materialize``.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from clusters import CLUSTER_TRAINER
from controlplane import build_binaries
from k8sutil import (
    eventually,
    fleet_example,
    host_claims,
    load_yaml,
    refit_example,
    world_readable,
)
from node import Images, Node
from registry import Pushed
from s3server import S3Server

from dcr.errors import DcrError
from dcr.protocol.agent_api import AgentClient
from dcr.refit.trainer import Trainer, reference_fingerprint
from faultcheck import check, read_events
from faultcoord import emit
from faults import tensor_sums  # the campaign's per-tensor digests of a checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "charts" / "dcr" / "examples"
SEED = int(os.environ.get("DCR_FAULT_SEED", "41"))  # CI's; any other replays its own schedule
REFITS = 4
SYSTEM, NS = "dcr-faults-system", "rl-faults"
RELEASE = "dcr-faults"
PULL_SECRET = "registry-login"
FLEET = "policy-rollout"
REPLICAS = 2
PREFIX = "policy-faults"  # the fleet's store prefix: its own history, whatever ran before
RUNTIME = "hf"  # the reference rollout Pods' loader (dcr serve --runtime=hf)
SETTLE_BOUND_S = 180.0  # once a refit committed, every agent holds it within this
REFIT_TIMEOUT_S = 420.0  # created -> Committed, faults and the operator's retries included
STAGING = {"prepared", "streaming", "staged", "gate_closed", "applying"}
TRANSIENT = (subprocess.CalledProcessError, OSError, ValueError, DcrError, AssertionError)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One refit's fault, as drawn."""

    moment: str  # a MOMENTS key: when, by the parties' answers
    target: str  # a FAULTS key: what is killed
    down_s: float  # seconds the API server stays down (a restart's gap)


@dataclass
class FaultCluster:
    node: Node
    s3: S3Server
    helm: Path
    tmp: Path
    ckpts: Path
    trainer: Trainer
    agent_token: str
    events: Path
    round: int = 0
    references: dict[int, dict[str, str]] = field(default_factory=dict)  # by version

    def reference(self, v: int) -> dict[str, str]:
        """What a dense load of version ``v`` through the rollout Pods' loader holds."""
        if v not in self.references:
            self.references[v] = reference_fingerprint(self.ckpts / f"v{v}", RUNTIME)
        return self.references[v]

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return str(self.node.kubectl(*args, input=input, check=check).stdout)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def api(self, path: str) -> dict[str, Any]:
        """One GET of the API server (no kubectl process: cheap enough to poll)."""
        assert self.node.cp is not None
        answer = self.node.cp.request("GET", path, timeout_s=5)
        if answer.status != 200:
            raise OSError(f"GET {path}: HTTP {answer.status}")
        body: dict[str, Any] = answer.body
        return body

    def apply(self, objs: list[dict[str, Any]], namespace: str = NS) -> None:
        self.kubectl("-n", namespace, "apply", "-f", "-",
                     input="\n---\n".join(yaml.safe_dump(o) for o in objs))

    def refit_status(self, name: str) -> dict[str, Any]:
        obj = self.api(f"/apis/dcr.dev/v1alpha1/namespaces/{NS}/weightrefits/{name}")
        status: dict[str, Any] = obj.get("status") or {}
        return status

    def fleet_commit(self) -> dict[str, Any] | None:
        obj = self.api(f"/apis/dcr.dev/v1alpha1/namespaces/{NS}/rolloutfleets/{FLEET}")
        commit: dict[str, Any] | None = (obj.get("status") or {}).get("commit")
        return commit

    def operator_pod(self) -> dict[str, Any]:
        pods = self.get("-n", SYSTEM, "pods", "-l", f"app.kubernetes.io/instance={RELEASE}")
        (pod,) = [p for p in pods["items"] if "deletionTimestamp" not in p["metadata"]]
        return dict(pod)

    def agents(self) -> list[AgentClient]:
        pods = self.get("-n", NS, "pods", "-l", f"app={FLEET}")["items"]
        return [AgentClient(p["metadata"]["name"], f"http://{p['status']['podIP']}:8471",
                            self.agent_token, timeout_s=10)
                for p in pods if "deletionTimestamp" not in p["metadata"]
                and p["status"].get("podIP")]

    def diagnostics(self) -> str:
        parts = [self.kubectl("get", "pods,jobs,weightrefits", "-A", "-o", "wide", check=False)]
        for pod in self.get("-n", SYSTEM, "pods")["items"]:
            parts.append(f"operator {pod['metadata']['name']}:\n"
                         + self.node.pod_logs(SYSTEM, pod["metadata"]["name"]))
        return "\n".join(parts)


# -- the record as the API server answers it ---------------------------------------------------


class RecordReader:
    """Reads the fleet's commit record a few times a second (while the API server answers)
    and logs each read; remembers when each record was first seen and the read before it."""

    def __init__(self, fc: FaultCluster) -> None:
        self.fc = fc
        self.first_seen: dict[tuple[int, str], tuple[float, dict[str, Any]]] = {}
        self._last: dict[str, Any] = {"version": 0, "attempt": ""}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="record-reader", daemon=True)

    def __enter__(self) -> RecordReader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                commit = self.fc.fleet_commit()
            except Exception:  # the API server is down or restarting: no answer, no event
                continue
            if not commit:
                continue
            t = time.time()
            read = {"version": int(commit["committedVersion"]), "attempt": commit["attempt"],
                    "baseline": commit["baselineId"]}
            emit(self.fc.events, "apiserver", "record", **read)
            key = (read["version"], read["attempt"])
            if key not in self.first_seen:
                self.first_seen[key] = (t, self._last)
            self._last = read


def log_commit(fc: FaultCluster, reader: RecordReader, name: str) -> int:
    """Log refit ``name``'s commit as a compare-and-set the record reads must explain:
    from the record read just before the new one was first seen, to what the refit's status
    says it wrote, counting the receivers of its committing attempt. Its version."""
    status = fc.refit_status(name)
    committed = status["committed"]
    new = {"version": int(committed["committedVersion"]), "attempt": committed["attempt"],
           "baseline": committed["baselineId"]}
    t, before = eventually(lambda: reader.first_seen.get((new["version"], new["attempt"])),
                           timeout_s=60, what=f"the record of {name} read back")
    (attempt,) = [a for a in status["attempts"] if a["id"] == new["attempt"]]
    # The status agrees with the record, whichever operator process wrote it.
    assert attempt["outcome"] == "Committed", (name, status["attempts"])
    counted = sorted(r["name"] for r in status.get("receivers", [])
                     if r.get("attempt") == new["attempt"]
                     and r["name"] not in attempt.get("leftOut", []))
    emit(fc.events, "operator", "cas", t=t, expected=before, new=new, outcome="success",
         receivers=counted, refit=name)
    return int(new["version"])


# -- moments and faults ------------------------------------------------------------------------


def _agent_states(agents: list[AgentClient]) -> set[str]:
    states = set()
    for a in agents:
        try:
            st = a.status()
        except DcrError:
            continue
        if st is not None and st.state:
            states.add(st.state)
    return states


# moment -> whether refit ``name`` reached it, by its status or the fleet's agents' answers
MOMENTS: dict[str, Callable[[FaultCluster, str, list[AgentClient]], bool]] = {
    "created": lambda fc, name, agents: True,
    "attempt": lambda fc, name, agents: bool(fc.refit_status(name).get("attempts")),
    "staging": lambda fc, name, agents: bool(_agent_states(agents) & STAGING),
    "flushed": lambda fc, name, agents: "flushed" in _agent_states(agents),
}


def _delete_operator_pod(fc: FaultCluster, fault: Fault) -> None:
    pod = fc.operator_pod()["metadata"]["name"]
    fc.kubectl("-n", SYSTEM, "delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")


def _restart_apiserver(fc: FaultCluster, fault: Fault, while_down: Callable[[], None] = (
        lambda: None)) -> None:
    assert fc.node.cp is not None

    def down() -> None:
        while_down()
        time.sleep(fault.down_s)

    fc.node.cp.restart_apiserver(down, hard=True)


def _both(fc: FaultCluster, fault: Fault) -> None:
    """The operator's container killed -9 (the kubelet restarts it) while the API server
    is down: the new process starts against an API server that is not there yet."""
    (status,) = fc.operator_pod()["status"]["containerStatuses"]
    _restart_apiserver(fc, fault, lambda: fc.node.kill_container(status["containerID"]))


FAULTS: dict[str, Callable[[FaultCluster, Fault], None]] = {
    "operator": _delete_operator_pod,
    "apiserver": _restart_apiserver,
    "both": _both,
}


def draw(rng: random.Random, refits: int) -> list[Fault]:
    return [Fault(moment=rng.choice(sorted(MOMENTS)), target=rng.choice(sorted(FAULTS)),
                  down_s=round(rng.uniform(0.0, 3.0), 1)) for _ in range(refits)]


def inject(fc: FaultCluster, name: str, fault: Fault) -> bool:
    """Wait for ``fault.moment`` of refit ``name`` and inject the fault; False if the refit
    finished before the moment was seen (nothing landed)."""
    agents = fc.agents()
    for a in agents:
        a.timeout_s = 2.0
    while True:
        try:
            if MOMENTS[fault.moment](fc, name, agents):
                break
            if fc.refit_status(name).get("phase") in ("Committed", "Failed"):
                return False
        except TRANSIENT:
            pass
        time.sleep(0.02)
    FAULTS[fault.target](fc, fault)
    emit(fc.events, "harness", "fault", refit=name, **asdict(fault))
    return True


# -- observing the fleet -----------------------------------------------------------------------


def observe(fc: FaultCluster, version: int) -> bool:
    """One round of every agent's status and whole fingerprints; whether all hold
    ``version``'s bits, clean. No agent is told anything: the operator drives them."""
    fc.round += 1
    want = fc.reference(version)
    agents = fc.agents()
    settled = len(agents) == REPLICAS
    for a in agents:
        try:
            st = a.status()
            assert st is not None
            clean = st.dirty is None and st.unknown is None and st.version is not None
            fp = a.fingerprint() if clean else None
        except DcrError as e:
            emit(fc.events, "harness", "agent", round=fc.round, agent=a.name,
                 pod_kind=RUNTIME, error=str(e)[:200])
            settled = False
            continue
        emit(fc.events, "harness", "agent", round=fc.round, agent=a.name, pod_kind=RUNTIME,
             version=st.version, dirty=st.dirty, unknown=st.unknown, state=st.state,
             attempt=st.attempt, fingerprint=fp)
        settled = settled and st.version == version and fp == want
    return settled


def settle(fc: FaultCluster, step: int, version: int) -> float:
    """Log that the faults stopped; wait, observing, until the fleet holds ``version``."""
    started = time.monotonic()
    emit(fc.events, "harness", "faults_stopped", step=step, bound_s=SETTLE_BOUND_S,
         agents=sorted(a.name for a in fc.agents()))
    while not observe(fc, version):
        if time.monotonic() - started > SETTLE_BOUND_S:
            raise AssertionError(f"the fleet did not reach v{version} within "
                                 f"{SETTLE_BOUND_S:.0f} s\n{fc.diagnostics()}")
        time.sleep(1)
    return time.monotonic() - started


def materialize(fc: FaultCluster, versions: list[int]) -> None:
    """Build every committed version from the store alone (the read-only key); log its
    tensors and its checkpoint's."""
    env = {**os.environ, "AWS_ENDPOINT_URL": fc.s3.endpoint, "AWS_DEFAULT_REGION": fc.s3.region,
           "AWS_ACCESS_KEY_ID": fc.s3.read_access_key,
           "AWS_SECRET_ACCESS_KEY": fc.s3.read_secret_key}
    for v in versions:
        dest = fc.tmp / "materialized" / f"v{v}"
        run = subprocess.run(
            [sys.executable, "-m", "dcr", "materialize", "--store",
             f"s3://{fc.s3.bucket}/{PREFIX}", "--out", str(dest), "--version", str(v),
             "--held", "0", "--seed", str(fc.ckpts / "v0"), "--json"],
            capture_output=True, text=True, timeout=300, check=False, env=env)
        built = ({"tensors": tensor_sums(dest)} if run.returncode == 0 else
                 {"error": run.stderr.strip().splitlines()[-1:], "tensors": {}})
        emit(fc.events, "harness", "materialized", version=v, **built)
        emit(fc.events, "harness", "checkpoint", version=v,
             tensors=tensor_sums(fc.ckpts / f"v{v}"))
        emit(fc.events, "harness", "reference", version=v, pod_kind=RUNTIME,
             fingerprint=fc.reference(v))
        shutil.rmtree(dest, ignore_errors=True)


# -- the cluster -------------------------------------------------------------------------------


def rollout(fc: FaultCluster, images: Images) -> list[dict[str, Any]]:
    """rollout-reference.yaml with two Pods, this cluster's images, the S3 server reached
    directly, and the fleet's own store prefix."""
    key_secret, deployment = load_yaml(EXAMPLES / "rollout-reference.yaml")
    key_secret["stringData"]["key"] = secrets.token_hex(24)
    read_key = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "weights-s3-read"},
                "stringData": {"AWS_ACCESS_KEY_ID": fc.s3.read_access_key,
                               "AWS_SECRET_ACCESS_KEY": fc.s3.read_secret_key}}
    deployment["spec"]["replicas"] = REPLICAS
    pod = deployment["spec"]["template"]["spec"]
    for box in pod["initContainers"] + pod["containers"]:
        box.update(image=images.serve if box["name"] == "engine" else images.dcr,
                   imagePullPolicy="Never",
                   resources={"requests": {"cpu": "100m", "memory": "256Mi"},
                              "limits": {"memory": "3Gi"}},
                   args=[a.replace("/policy-a", f"/{PREFIX}") if a.startswith("--store=")
                         else a for a in box.get("args", [])])
        for env in box.get("env", []):
            if env["name"] == "AWS_ENDPOINT_URL":
                env["value"] = fc.s3.endpoint
    return [read_key, key_secret, deployment]


def helm(fc: FaultCluster, *args: str) -> None:
    assert fc.node.cp is not None
    proc = subprocess.run([str(fc.helm), "--kubeconfig", str(fc.node.cp.kubeconfig), *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stderr}"


def install(fc: FaultCluster, pushed: Pushed, images: Images) -> None:
    """The chart (its own release, the operator pulled with the login), the claims, the
    fleet on its own store prefix, and two reference rollout Pods; until the fleet is
    Ready."""
    for ns in (SYSTEM, NS):
        fc.kubectl("create", "namespace", ns)
        fc.apply([pushed.registry.pull_secret(PULL_SECRET)], namespace=ns)
    fc.kubectl("-n", NS, "patch", "serviceaccount", "default", "-p",
               json.dumps({"imagePullSecrets": [{"name": PULL_SECRET}]}))
    repo, tag = pushed.ref.rsplit(":", 1)
    helm(fc, "install", RELEASE, str(REPO / "charts" / "dcr"), "--namespace", SYSTEM,
         f"--set=image.repository={repo}", f"--set=image.tag={tag}",
         f"--set=imagePullSecrets[0].name={PULL_SECRET}", "--set=encoder.pullPolicy=Never",
         f"--set=watchNamespaces={{{NS}}}", "--set=settings.jobPollSeconds=1",
         "--set=settings.retrySeconds=2", "--set=settings.fleetStatusSeconds=3",
         "--set=peering.lifetimeSeconds=15", "--wait", "--timeout=300s")
    fc.apply(host_claims(NS, {"policy-checkpoints": fc.ckpts.parent,
                              "policy-base-model": fc.tmp / "base-models"}))
    objs = fleet_example(fc.s3, fc.agent_token, attempt_timeout_s=120)
    (fleet,) = [o for o in objs if o["kind"] == "RolloutFleet"]
    fleet["spec"]["store"]["uri"] = f"s3://{fc.s3.bucket}/{PREFIX}"
    fc.apply(objs)
    fc.apply(rollout(fc, images))
    try:
        eventually(lambda: (fc.get("-n", NS, "rolloutfleet", FLEET).get("status") or {})
                   .get("readyReceivers") == REPLICAS, timeout_s=400, every_s=2,
                   transient=TRANSIENT, what="the fleet Ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{fc.diagnostics()}") from None


@pytest.fixture(scope="module")
def fc(node: Node, images: Images, node_s3: S3Server, pushed: Pushed,
       tmp_path_factory: pytest.TempPathFactory,
       progress: Callable[[str], None]) -> Iterator[FaultCluster]:
    binaries = build_binaries()
    assert binaries.helm is not None
    tmp = tmp_path_factory.mktemp("deploy-faults")
    ckpts = tmp / "checkpoints" / "policy-a"
    trainer = Trainer(CLUSTER_TRAINER)
    trainer.export(ckpts / "v0")
    shutil.copytree(ckpts / "v0", tmp / "base-models" / "policy-a")
    world_readable(tmp)
    c = FaultCluster(node=node, s3=node_s3, helm=binaries.helm, tmp=tmp, ckpts=ckpts,
                     trainer=trainer, agent_token=secrets.token_hex(24),
                     events=tmp / "events.jsonl")
    started = time.monotonic()
    install(c, pushed, images)
    progress(f"tests/deploy: the faults' release installed and its fleet Ready in "
             f"{time.monotonic() - started:.0f} s")
    yield c
    c.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    helm(c, "uninstall", RELEASE, "--namespace", SYSTEM)
    c.kubectl("delete", "namespace", SYSTEM, "--wait=false", check=False)
    c.kubectl("delete", "pv", f"{NS}-policy-checkpoints", f"{NS}-policy-base-model",
              "--wait=false", check=False)


# -- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One refit under its fault, as observed."""

    landed: bool  # the drawn moment was seen and the fault injected
    version: int  # what the refit committed
    attempts: list[str]  # each attempt's outcome and reason (its status)
    committed_s: float  # WeightRefit created -> Committed
    settled_s: float  # Committed -> every agent holds it, bit for bit


def refit_under(fc: FaultCluster, reader: RecordReader, step: int, fault: Fault) -> Outcome:
    """Refit the fleet to the next version with ``fault`` drawn for it."""
    v = step + 1
    fc.trainer.step()
    fc.trainer.export(fc.ckpts / f"v{v}")
    world_readable(fc.ckpts)
    name = f"{FLEET}-v{v}"
    created = time.monotonic()
    fc.apply([refit_example(name, v - 1, v)])
    hit = inject(fc, name, fault)
    try:
        eventually(lambda: fc.refit_status(name).get("phase") in ("Committed", "Failed"),
                   timeout_s=REFIT_TIMEOUT_S, every_s=1, transient=TRANSIENT,
                   what=f"WeightRefit {name} finished")
        assert fc.refit_status(name)["phase"] == "Committed", fc.refit_status(name)
    except AssertionError as e:
        raise AssertionError(f"seed {SEED}, v{v} ({fault}): {e}\n{fc.diagnostics()}") from None
    committed_s = time.monotonic() - created
    attempts = [f"{a['outcome']}" + (f" ({a['reason'][:160]})" if a.get("reason") else "")
                for a in fc.refit_status(name)["attempts"]]
    out = Outcome(landed=hit, version=log_commit(fc, reader, name), attempts=attempts,
                  committed_s=round(committed_s, 1), settled_s=round(settle(fc, step, v), 1))
    emit(fc.events, "harness", "refit", refit=name, **asdict(out))
    return out


def test_seeded_operator_and_api_server_kills_mid_refit_break_no_invariant(
        fc: FaultCluster, progress: Callable[[str], None]) -> None:
    """Each refit commits despite its drawn fault, the fleet then holds it bit for bit
    within the bound with no step of ours, and the checker finds no violation."""
    schedule = draw(random.Random(SEED), REFITS)
    progress(f"tests/deploy: fault seed {SEED} (DCR_FAULT_SEED replays another); schedule: "
             + "; ".join(f"v{i + 1}: {f.target} at {f.moment}"
                         + (f", API server down {f.down_s} s" if f.target != "operator" else "")
                         for i, f in enumerate(schedule)))
    started = time.monotonic()
    with RecordReader(fc) as reader:
        outcomes = []
        for step, fault in enumerate(schedule):
            out = refit_under(fc, reader, step, fault)
            progress(f"tests/deploy: v{out.version} ({fault.target} at {fault.moment}, "
                     f"{'landed' if out.landed else 'not landed'}): attempts "
                     f"{out.attempts}, created -> Committed {out.committed_s} s, every agent "
                     f"holding it {out.settled_s} s later")
            outcomes.append(out)
    committed = [o.version for o in outcomes]
    materialize(fc, committed)
    report = check(read_events(fc.events))
    progress(f"tests/deploy: fault seed {SEED}: {len(report.violations)} violations; "
             f"{time.monotonic() - started:.0f} s for the refits and the checks "
             f"(events: {fc.events})")
    assert [str(x) for x in report.violations] == [], f"seed {SEED}; events: {fc.events}"
    assert committed == list(range(1, REFITS + 1))
    assert len(report.recovery_s) == REFITS  # the fleet settled after each commit
    assert any(o.landed for o in outcomes), f"seed {SEED}: no drawn moment was seen in time"
