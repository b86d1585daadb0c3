"""The rollout pod for real: ``vllm serve`` in a pod beside ``dcr agent``, refit by the operator.

``charts/dcr/examples/rollout-vllm.yaml`` as written, with the image ``make image-vllm-cpu``
builds (vLLM's CPU build and DCR's worker extension) and what a CPU needs in place of a GPU
(``cpu_engine`` lists it), on the node of the deploy tier: the operator installed by
``helm install`` from the registry, encoder Jobs as Pods, the store on S3, and a rollout
pod that never sees the training side's checkpoints (its init container builds the
committed version from the store and the run's base model).

vLLM's CPU build computes every linear layer from a copy it packs after loading, so the
agent starts with its weights unknown and the fleet rejoins it densely, from the store,
before the first delta (docs/derived-weights.md, "Weights an engine derives after loading").

The tests run in order, each on the state the previous one left: the pod starts unknown and
the fleet rejoins it -> two refits commit through encoder pods -> a third has the vLLM
container killed mid-refit -> the pod is deleted and its replacement is compared.

Bits are checked as a user can from outside the pod: the agent's own check of every attempt
against the manifest's targets (the commit); greedy completions with logprobs on the engine's
own port, as clients call it (the client guard inside vLLM; its admin routes answer only the
agent, which holds the engine admin token), against a new pod started on the committed
version (what the engine computes with); and the engine's fingerprints of every parameter
against that new pod's dense load through the same loader.

Opt-in (``make test-vllm-pod``; CI runs it when the vllm-cpu image is in its cache): the
image is ~7 GB; the module took 4.5-7 min here, 1.5-3 of them importing the image.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import build_binaries, run_reporting
from k8sutil import (
    eventually,
    fleet_example,
    host_claims,
    load_yaml,
    pod_ready,
    refit_example,
    world_readable,
)
from node import Node
from registry import Pushed
from s3server import S3Server

import vllm_serve
from dcr.errors import DcrError
from dcr.protocol.agent_api import AgentClient, AgentStatus

if not os.environ.get("DCR_DEPLOY_VLLM"):
    pytest.skip("opt-in: make test-vllm-pod (DCR_DEPLOY_VLLM=1) builds the ~6 GB vllm-cpu "
                "image and runs vllm serve in a pod", allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "charts" / "dcr" / "examples"
IMAGE_SCRIPT = REPO / "tools" / "image" / "build.sh"
SYSTEM, NS = "dcr-vllm-system", "rl-vllm"
RELEASE = "dcr"
PULL_SECRET = "registry-login"
FLEET = "policy-rollout"
STEPS = 3
LR = 1e-5
PROMPT = [5, 6, 7, 8, 9]
SERVED = "policy-a"
# Where the module's times go, when asked (DCR_VLLM_POD_OUT=bench/results/vllm-pod.json).
MEASURED_OUT = os.environ.get("DCR_VLLM_POD_OUT")
START_S = 600  # pull nothing, import ~6 GB of vLLM and torch, load, warm up: 1-4 min here
# While pods start and stop, kubectl and the agents' ports fail for a while: not yet.
TRANSIENT = (subprocess.CalledProcessError, OSError, ValueError, DcrError)


@dataclass
class VllmCluster:
    node: Node
    s3: S3Server
    pushed: Pushed
    image: str  # the vllm-cpu image, imported into the node's containerd
    helm: Path
    tmp: Path  # the pods' logs are kept here when a check fails
    agent_token: str
    measured: dict[str, Any] = field(default_factory=dict)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return self.node.kubectl(*args, input=input, check=check).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def apply(self, objs: list[dict[str, Any]], namespace: str = NS) -> None:
        self.kubectl("-n", namespace, "apply", "-f", "-",
                     input="\n---\n".join(yaml.safe_dump(o) for o in objs))

    def pods(self) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = self.get("-n", NS, "pods", "-l", f"app={FLEET}")["items"]
        return [p for p in pods if "deletionTimestamp" not in p["metadata"]]

    def ready_pod(self, timeout_s: float = START_S) -> dict[str, Any]:
        try:
            (pod,) = eventually(lambda: [p for p in self.pods() if pod_ready(p)],
                                timeout_s=timeout_s, every_s=2, transient=TRANSIENT,
                                what="the vLLM pod Ready")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnostics()}") from None
        return pod

    def fleet(self) -> dict[str, Any]:
        status: dict[str, Any] = self.get("-n", NS, "rolloutfleet", FLEET).get("status") or {}
        return status

    def agent(self, pod: dict[str, Any]) -> AgentClient:
        return AgentClient(pod["metadata"]["name"], f"http://{pod['status']['podIP']}:8471",
                           self.agent_token, timeout_s=120)

    def refit_async(self, name: str, base: int, target: int) -> None:
        self.apply([refit_example(name, base, target)])

    def refit_status(self, name: str) -> dict[str, Any]:
        status: dict[str, Any] = self.get("-n", NS, "weightrefit", name).get("status") or {}
        return status

    def wait_refit(self, name: str) -> dict[str, Any]:
        """The refit, once it finished; it must have committed."""
        try:
            eventually(lambda: self.refit_status(name).get("phase") in ("Committed", "Failed"),
                       timeout_s=900, every_s=1, transient=TRANSIENT,
                       what=f"WeightRefit {name} finished")
            obj: dict[str, Any] = self.get("-n", NS, "weightrefit", name)
            assert obj["status"]["phase"] == "Committed", obj["status"]
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnostics()}") from None
        return obj

    def refit(self, name: str, base: int, target: int) -> dict[str, Any]:
        self.refit_async(name, base, target)
        return self.wait_refit(name)

    def diagnostics(self) -> str:
        parts = [self.kubectl("get", "pods,jobs", "-A", "-o", "wide", check=False)]
        for pod in self.get("-n", SYSTEM, "pods")["items"]:
            parts.append(f"operator:\n{self.node.pod_logs(SYSTEM, pod['metadata']['name'])}")
        for pod in self.pods():
            name = pod["metadata"]["name"]
            for c in ("materialize", "vllm", "agent"):
                log = self.kubectl("-n", NS, "logs", name, "-c", c, check=False)
                (self.tmp / f"{name}-{c}.log").write_text(log)
                # vLLM's engine core reports its own failure lines before the API server's
                errors = [line for line in log.splitlines() if "EngineCore" in line
                          and ("ERROR" in line or "Error" in line)]
                parts.append(f"{name}/{c} ({self.tmp / f'{name}-{c}.log'}):\n"
                             + "\n".join(errors[:60]) + "\n" + log[-3000:])
        return "\n".join(parts)


@pytest.fixture(scope="module")
def vllm_image(node: Node, progress: Callable[[str], None]) -> str:
    """``make image-vllm-cpu``, imported into the node's containerd."""
    started = time.monotonic()
    status, output = run_reporting(["env", "DCR_IMAGES=vllm-cpu", "bash", str(IMAGE_SCRIPT)],
                                   progress=progress,
                                   name="make image-vllm-cpu")
    if status != 0:
        pytest.fail(f"{IMAGE_SCRIPT} exited with {status}:\n{output[-3000:]}")
    (line,) = [p for p in (line.split() for line in output.splitlines())
               if len(p) == 4 and p[:2] == ["image", "vllm-cpu"]]
    ref, archive = line[2], Path(line[3])
    progress(f"tests/deploy: vllm-cpu image ready in {time.monotonic() - started:.0f} s; "
             f"importing {archive.stat().st_size / 2**30:.1f} GiB into the node")
    started = time.monotonic()
    node.load_image(archive)
    progress(f"tests/deploy: imported in {time.monotonic() - started:.0f} s")
    return ref


@pytest.fixture(scope="module")
def vc(node: Node, node_s3: S3Server, pushed: Pushed, vllm_image: str,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCluster]:
    binaries = build_binaries()
    assert binaries.helm is not None
    tmp = tmp_path_factory.mktemp("vllm-pod")
    dirs = vllm_serve.serve_versions(tmp / "checkpoints" / "policy-a", steps=STEPS, lr=LR)
    shutil.copytree(dirs[0], tmp / "base-models" / "policy-a")
    world_readable(tmp)
    c = VllmCluster(node=node, s3=node_s3, pushed=pushed, image=vllm_image,
                    helm=binaries.helm, tmp=tmp, agent_token=secrets.token_hex(24))
    install(c, tmp)
    yield c
    c.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    helm(c, "uninstall", RELEASE, "--namespace", SYSTEM)


def helm(c: VllmCluster, *args: str) -> str:
    assert c.node.cp is not None
    proc = subprocess.run([str(c.helm), "--kubeconfig", str(c.node.cp.kubeconfig), *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def install(c: VllmCluster, tmp: Path) -> None:
    """The chart (its operator pulled from the registry with the login), the claims, the
    fleet and the vLLM rollout Deployment."""
    for ns in (SYSTEM, NS):
        c.kubectl("create", "namespace", ns)
        c.apply([c.pushed.registry.pull_secret(PULL_SECRET)], namespace=ns)
    c.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=restricted")
    c.kubectl("-n", NS, "patch", "serviceaccount", "default", "-p",
              json.dumps({"imagePullSecrets": [{"name": PULL_SECRET}]}))
    repo, tag = c.pushed.ref.rsplit(":", 1)
    helm(c, "install", RELEASE, str(REPO / "charts" / "dcr"), "--namespace", SYSTEM,
         f"--set=image.repository={repo}", f"--set=image.tag={tag}",
         f"--set=imagePullSecrets[0].name={PULL_SECRET}", "--set=encoder.pullPolicy=Never",
         f"--set=watchNamespaces={{{NS}}}", "--set=settings.jobPollSeconds=1",
         "--set=settings.retrySeconds=2", "--set=settings.fleetStatusSeconds=3",
         "--wait", "--timeout=300s")
    c.apply(host_claims(NS, {"policy-checkpoints": tmp / "checkpoints",
                             "policy-base-model": tmp / "base-models"}))
    c.apply(fleet_example(c.s3, c.agent_token, attempt_timeout_s=300))
    c.apply(rollout(c))


def cpu_engine(engine: dict[str, Any], image: str) -> None:
    """What running rollout-vllm.yaml's vLLM container on a CPU changes: the image; the
    flags a CPU build needs (no CUDA graphs, a short context for the 1 GiB KV cache, the
    dtype the checkpoints hold); its KV cache size and thread binding (the node's cores are
    shared); offline; memory in place of a GPU."""
    engine["image"] = image
    engine["imagePullPolicy"] = "Never"
    engine["args"] += ["--dtype=bfloat16", "--enforce-eager", "--max-model-len=256",
                       "--max-num-seqs=4", f"--served-model-name={SERVED}"]
    engine["env"] += [{"name": k, "value": v} for k, v in (
        ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"))]
    engine["resources"] = {"requests": {"cpu": "500m", "memory": "2Gi"},
                           "limits": {"memory": "10Gi"}}


def rollout(c: VllmCluster) -> list[dict[str, Any]]:
    """rollout-vllm.yaml with one replica, this cluster's images and S3, on a CPU, and a
    random engine admin token in place of the placeholder the guard refuses."""
    objs = {o["kind"]: o for o in load_yaml(EXAMPLES / "rollout-vllm.yaml")}
    engine_token, deployment = objs["Secret"], objs["Deployment"]
    engine_token["stringData"]["token"] = secrets.token_hex(24)
    deployment["spec"]["replicas"] = 1
    pod = deployment["spec"]["template"]["spec"]
    by_name = {x["name"]: x for x in pod["initContainers"] + pod["containers"]}
    cpu_engine(by_name["vllm"], c.image)
    for name in ("materialize", "agent"):
        by_name[name]["image"] = c.pushed.ref
        by_name[name]["imagePullPolicy"] = "Never"
        by_name[name]["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                                      "limits": {"memory": "2Gi"}}
        for env in by_name[name].get("env", []):
            if env["name"] == "AWS_ENDPOINT_URL":
                env["value"] = c.s3.endpoint
    read_key = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "weights-s3-read"},
                "stringData": {"AWS_ACCESS_KEY_ID": c.s3.read_access_key,
                               "AWS_SECRET_ACCESS_KEY": c.s3.read_secret_key}}
    return [read_key, engine_token, deployment, objs["NetworkPolicy"]]


def greedy(vc: VllmCluster, pod: dict[str, Any]) -> tuple[str, list[float]]:
    """A greedy completion with logprobs on the engine's port, as a client asks."""
    try:
        return vllm_serve.greedy(f"http://{pod['status']['podIP']}:8000", PROMPT, model=SERVED)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"completion refused: {e.code} {e.read()[:2000]!r}\n"
                             f"{vc.diagnostics()}") from None


def test_the_vllm_pod_starts_unknown_and_the_fleet_rejoins_it_from_the_store(
        vc: VllmCluster) -> None:
    started = time.monotonic()
    pod = vc.ready_pod()
    status = eventually(lambda: (s := vc.fleet()).get("readyReceivers") == 1 and s,
                        timeout_s=START_S, every_s=2, transient=TRANSIENT,
                        what="the fleet Ready")
    vc.measured["pod_ready_s"] = round(time.monotonic() - started, 1)
    assert status["commit"]["committedVersion"] == 0
    st = vc.agent(pod).status()
    assert (st.version, st.unknown, st.gate_open) == (0, None, True)
    # vLLM's CPU build packed the linear layers after loading: the agent started with its
    # weights unknown, and the fleet rejoined it by a dense load of v0 built from the store.
    agent_log = vc.node.pod_logs(NS, pod["metadata"]["name"], "agent")
    assert "derived after loading" in agent_log, agent_log
    assert "built version 0 from the store" in agent_log, agent_log
    # Clients reach the engine's port; its admin routes are the guard's 404 without the
    # token the agent holds (which just drove the rejoin through them).
    with pytest.raises(urllib.error.HTTPError) as refused:
        vllm_serve.post(f"http://{pod['status']['podIP']}:8000", "/pause", {})
    assert (refused.value.code, json.loads(refused.value.read())["kind"]) == (404, "NotServed")


def test_refits_commit_through_encoder_pods(vc: VllmCluster) -> None:
    for v in range(1, STEPS):
        started = time.monotonic()
        refit = vc.refit(f"vllm-v{v}", v - 1, v)
        vc.measured[f"refit_v{v}_s"] = round(time.monotonic() - started, 1)
        (attempt,) = refit["status"]["attempts"]
        assert (attempt["mode"], attempt["outcome"]) == ("mixed", "Committed")
    st = vc.agent(vc.ready_pod()).status()
    assert (st.version, st.dirty, st.unknown) == (STEPS - 1, None, None)


def test_the_vllm_container_killed_mid_refit_restarts_and_the_refit_commits(
        vc: VllmCluster) -> None:
    """Once the refit's first attempt has started, every process of the vLLM container is
    killed (as an out-of-memory kill would); the kubelet restarts it, the agent finds a new
    engine whose weights it does not know, the fleet rejoins it densely from the store, and
    the refit commits. Whether the killed attempt fails or the agent carries it over the
    restart depends on when the kill lands; what must hold is the end: committed, and the
    same bits as a pod that never saw the kill (the next test)."""
    pod = vc.ready_pod()
    (engine,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "vllm"]
    name = f"vllm-v{STEPS}"
    vc.refit_async(name, STEPS - 1, STEPS)
    eventually(lambda: vc.refit_status(name).get("attempts"), timeout_s=300, every_s=0.1,
               transient=TRANSIENT, what="the refit's first attempt started")
    vc.node.kill_container(engine["containerID"])
    assert vc.refit_status(name).get("phase") != "Committed"  # the kill landed before it
    started = time.monotonic()
    refit = vc.wait_refit(name)
    vc.measured["refit_with_kill_s"] = round(time.monotonic() - started, 1)
    attempts = refit["status"]["attempts"]
    vc.measured["attempts_with_kill"] = [(a["mode"], a["outcome"]) for a in attempts]
    assert attempts[-1]["outcome"] == "Committed", attempts
    pod = vc.ready_pod()
    (after,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "vllm"]
    assert after["restartCount"] == engine["restartCount"] + 1
    st = vc.agent(pod).status()
    assert (st.version, st.dirty, st.unknown) == (STEPS, None, None)
    log = vc.kubectl("-n", NS, "logs", pod["metadata"]["name"], "-c", "agent")
    # The agent saw the new engine, forgot the version, and rejoined it densely from the
    # store (its second build there: the first was at start).
    assert "the engine restarted" in log, log[-3000:]
    assert log.count("built version") >= 2, log[-3000:]
    vc.measured["refit_pod"] = pod["metadata"]["name"]
    vc.measured["greedy"] = greedy(vc, pod)
    vc.measured["fingerprint"] = vc.agent(pod).fingerprint()


def test_a_new_pod_on_the_committed_version_computes_and_holds_the_same_bits(
        vc: VllmCluster) -> None:
    """The pod is deleted; its replacement builds the committed version from the store,
    loads it densely, and answers the same completion, logprob for logprob, holding the
    same bits in every parameter."""
    old = vc.measured["refit_pod"]
    vc.kubectl("-n", NS, "delete", "pod", old, "--wait=false")
    started = time.monotonic()
    pod = eventually(lambda: next((p for p in vc.pods()
                                   if p["metadata"]["name"] != old and pod_ready(p)), None),
                     timeout_s=START_S, every_s=2, transient=TRANSIENT,
                     what="the replacement pod Ready")

    def at_target() -> AgentStatus | None:
        st = vc.agent(pod).status()
        return st if st.version == STEPS else None

    st = eventually(at_target, timeout_s=START_S, every_s=2, transient=TRANSIENT,
                    what=f"the new pod at v{STEPS}")
    vc.measured["replacement_ready_s"] = round(time.monotonic() - started, 1)
    assert (st.dirty, st.unknown) == (None, None)
    assert greedy(vc, pod) == vc.measured["greedy"]
    assert vc.agent(pod).fingerprint() == vc.measured["fingerprint"]
    times = {k: v for k, v in vc.measured.items() if k not in ("greedy", "fingerprint")}
    print(f"vllm pod: {json.dumps(times)}")
    if MEASURED_OUT:  # a measurement, not a check: the times are this machine's
        Path(MEASURED_OUT).write_text(json.dumps({
            "what": "tests/deploy/test_vllm_pod.py: rollout-vllm.yaml's pod on the deploy "
                    "tier's node, vllm-cpu image, times observed by the test (wall clock)",
            "model": {"family": vllm_serve.FAMILY.name, **vllm_serve.FAMILY.config},
            "cores": os.cpu_count(), "load_avg": os.getloadavg(), **times}, indent=2) + "\n")
