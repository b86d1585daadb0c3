"""The deploy tier: the project as a user deploys it, on a node whose Pods really run.

Nothing here runs as a host process of ours but the trainer (which writes checkpoints
to a directory the node's Pods mount), the S3 server and the image registry. The chart
is installed with ``helm install`` using the images ``make image`` builds, the
operator's pulled from the registry (``make push``) with the login the chart's
``imagePullSecrets`` names; the operator runs as a Pod under the chart's
ServiceAccount; the chart's own examples are applied with ``kubectl apply`` (adjusted
only where a cluster differs: the images' names, the S3 endpoint, real secrets, a
hostPath in place of the PersistentVolumeClaim, smaller resource requests); encoder
Jobs run as Pods; rollout Pods run the agent sidecar next to the reference serving
engine (``dcr serve``), and mount no training checkpoint: an init container builds the
committed version from the store and the run's base model.

The tests run in order, each on the state the previous one left:
install (pulled from the registry; a pull without the login refused) -> fleet Ready ->
a refit commits bit-exact through a two-owner encoder Job -> ``kubectl get`` columns ->
a rollout Pod deleted mid-refit is replaced and rejoins -> the operator Pod killed
mid-refit is replaced and the refit finishes -> a Pod added by scaling up starts at the
committed version -> deleting a refit cleans its Jobs and the payloads catch-up does
not need -> the warm encoder example deployed and a refit through it (after one through
Jobs, both latencies recorded) -> what crossed the rollout side's emulated link to the
store (every rollout Pod reaches the store only through it) -> ``helm upgrade`` ->
``helm uninstall`` and namespace deletion leave nothing behind.

What the commands print is kept under the session's temporary directory
(``deploy-transcript.txt``): docs/walkthrough.md quotes it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from clusters import CLUSTER_TRAINER
from controlplane import build_binaries
from k8sutil import (
    fleet_example,
    host_claims,
    load_yaml,
    pod_ready,
    refit_example,
    world_readable,
)
from node import GATEWAY, Images, Node
from promtext import Key, samples, value
from registry import Pushed, push
from s3server import S3Server

from dcr.drivers.base import merge_fingerprints
from dcr.format.history import HISTORY_KEY, History
from dcr.protocol.agent_api import AgentClient
from dcr.refit.boundary import Link
from dcr.refit.trainer import Trainer, reference_fingerprint

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "charts" / "dcr" / "examples"
SYSTEM, NS = "dcr-system", "rl"
PULL_SECRET = "registry-login"  # the chart's imagePullSecrets: the registry's login
RELEASE = "dcr"
FLEET = "policy-rollout"
REPLICAS = 2
TRAINER = CLUSTER_TRAINER
# Where the two refits' latencies go, when asked: they are a measurement, not a check.
LATENCY_OUT = os.environ.get("DCR_DEPLOY_LATENCY_OUT")
T = TypeVar("T")


def eventually(check: Callable[[], T | None], *, timeout_s: float, what: str,
               every_s: float = 0.5) -> T:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
        except Exception as e:  # a transient kubectl or HTTP failure: try again
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")
        time.sleep(every_s)


@dataclass
class Cluster:
    node: Node
    images: Images
    s3: S3Server
    helm: Path
    tmp: Path
    ckpts: Path  # the training side's checkpoints: encoder Pods mount them, rollout Pods never
    base: Path  # the run's starting model alone (a public base model): rollout Pods' seed
    trainer: Trainer
    agent_token: str
    rollout_link: Link  # the rollout Pods reach the store only through this emulated link
    pushed: Pushed  # the dcr image in the node's registry: the chart's pods pull it
    transcript: list[str] = field(default_factory=list)
    fetched: dict[str, int] = field(default_factory=dict)  # init containers' bytes, by Pod
    latency: dict[str, Any] = field(default_factory=dict)  # created -> Committed, by way

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                record: bool = False) -> str:
        proc = self.node.kubectl(*args, input=input, check=check)
        if record:
            self.transcript.append(f"$ kubectl {' '.join(args)}\n{proc.stdout}")
            (self.tmp / "deploy-transcript.txt").write_text("\n".join(self.transcript))
        return proc.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def helm_run(self, *args: str, record: bool = True) -> str:
        assert self.node.cp is not None
        proc = subprocess.run([str(self.helm), "--kubeconfig", str(self.node.cp.kubeconfig),
                               *args], capture_output=True, text=True, timeout=300,
                              check=False)
        if record:
            self.transcript.append(f"$ helm {' '.join(args)}\n{proc.stdout}")
        assert proc.returncode == 0, f"helm {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def apply(self, objs: list[dict[str, Any]], namespace: str = NS) -> None:
        self.kubectl("-n", namespace, "apply", "-f", "-",
                     input="\n---\n".join(yaml.safe_dump(o) for o in objs))

    def refit(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.get("-n", NS, "weightrefit", name)
        return obj

    def fleet(self) -> dict[str, Any]:
        obj: dict[str, Any] = self.get("-n", NS, "rolloutfleet", FLEET)
        return obj

    def rollout_pods(self) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = self.get("-n", NS, "pods", "-l", f"app={FLEET}")["items"]
        return [p for p in pods if "deletionTimestamp" not in p["metadata"]]

    def operator_pods(self) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = self.get(
            "-n", SYSTEM, "pods", "-l", "app.kubernetes.io/name=dcr")["items"]
        return pods

    def new_version(self, v: int) -> None:
        self.trainer.step()
        self.trainer.export(self.ckpts / f"v{v}")
        world_readable(self.ckpts)

    def create_refit(self, name: str, base: int, target: int, profile: str | None = None
                     ) -> None:
        refit = refit_example(name, base, target)
        if profile is not None:
            refit["spec"]["encoder"]["profile"] = profile
        self.apply([refit])

    def wait_phase(self, name: str, phase: str, timeout_s: float = 400) -> dict[str, Any]:
        try:
            eventually(lambda: (self.refit(name).get("status") or {}).get("phase")
                       in (phase, "Committed", "Failed"), timeout_s=timeout_s,
                       what=f"WeightRefit {name} {phase}")
            refit = self.refit(name)
            assert refit["status"]["phase"] == phase
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnostics(name)}") from None
        return refit

    def diagnostics(self, refit: str = "") -> str:
        parts = []
        if refit:
            parts.append(f"refit status: {json.dumps(self.refit(refit).get('status'))}")
        parts.append(self.kubectl("get", "pods,jobs", "-A", "-o", "wide", check=False))
        for pod in self.operator_pods():
            parts.append(f"operator {pod['metadata']['name']}:\n"
                         + self.node.pod_logs(SYSTEM, pod["metadata"]["name"]))
        for pod in self.rollout_pods():
            for c in ("agent", "engine"):
                parts.append(f"{pod['metadata']['name']}/{c}:\n"
                             + self.node.pod_logs(NS, pod["metadata"]["name"], c)[-3000:])
        return "\n".join(parts)

    def agents(self) -> list[AgentClient]:
        return [AgentClient(p["metadata"]["name"], f"http://{p['status']['podIP']}:8471",
                            self.agent_token, timeout_s=30)
                for p in self.rollout_pods() if p["status"].get("podIP")]

    def exact(self, v: int, replicas: int = REPLICAS) -> bool:
        """Every one of ``replicas`` rollout Pods' engines holds, bit for bit, a dense load
        of version ``v``."""
        want = reference_fingerprint(self.ckpts / f"v{v}")
        agents = self.agents()
        return len(agents) == replicas and all(a.fingerprint() == want for a in agents)


def _fetched(log: str) -> int:
    """The bytes ``dcr materialize`` says it fetched."""
    m = re.search(r"; ([\d,]+) bytes fetched", log)
    assert m, log
    return int(m[1].replace(",", ""))


def _conditions(obj: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in obj["status"]["conditions"]}


# -- the chart's examples, adjusted for this cluster ------------------------------------------


def fleet_manifests(c: Cluster) -> list[dict[str, Any]]:
    """The fleet example; its warm profile calls the warm encoder over plain HTTP, as
    :func:`encoder_manifests` serves it (no certificates are issued in this cluster)."""
    objs = fleet_example(c.s3, c.agent_token, attempt_timeout_s=180)
    for obj in objs:
        for profile in obj.get("spec", {}).get("encoderProfiles", []):
            if "endpoint" in profile:
                urls = profile["endpoint"]["urls"]
                profile["endpoint"]["urls"] = [u.replace("https://", "http://") for u in urls]
    return objs


def rollout_manifests(c: Cluster) -> list[dict[str, Any]]:
    """The reference rollout example, and its read-only store key (``weights-s3-read``)."""
    key_secret, deployment = load_yaml(EXAMPLES / "rollout-reference.yaml")
    read_key = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "weights-s3-read"},
                "stringData": {"AWS_ACCESS_KEY_ID": c.s3.read_access_key,
                               "AWS_SECRET_ACCESS_KEY": c.s3.read_secret_key}}
    key_secret["stringData"]["key"] = secrets.token_hex(24)
    deployment["spec"]["replicas"] = REPLICAS
    pod = deployment["spec"]["template"]["spec"]
    for container in pod["initContainers"] + pod["containers"]:
        container["image"] = c.images.serve if container["name"] == "engine" else c.images.dcr
        container["imagePullPolicy"] = "Never"
        container["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                                  "limits": {"memory": "3Gi"}}
        for env in container.get("env", []):
            if env["name"] == "AWS_ENDPOINT_URL":  # the other side of the boundary
                env["value"] = f"http://{GATEWAY}:{c.rollout_link.port}"
    for volume in pod["volumes"]:  # the starting model only, never a later version
        assert "persistentVolumeClaim" not in volume or volume["name"] == "base-model"
    return [read_key, key_secret, deployment]


def relay_manifests(c: Cluster) -> list[dict[str, Any]]:
    """The relay example: its tree, fleet and rollout pods with this cluster's images,
    random tokens and small requests; the rollout pods' engine key is rollout-reference's
    Secret, which the store fleet's pods already use. The fleet's store (its history) is
    this cluster's S3 server, which the rollout pods reach only through their link and with
    the read-only key; nothing of the training side is mounted. TLS is the TLS tests'
    concern: here every party speaks plain HTTP (no certificates are issued)."""
    objs = load_yaml(EXAMPLES / "relay.yaml")
    keys = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "labels": labels},
             "stringData": {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}}
            for name, labels, key, secret in (
                ("weights-s3", {"dcr.dev/store-credentials": "true"}, c.s3.access_key,
                 c.s3.secret_key),
                ("weights-s3-read", {}, c.s3.read_access_key, c.s3.read_secret_key))]
    for obj in objs:
        if obj["kind"] == "Secret":
            obj["stringData"]["token"] = secrets.token_hex(24)
        if obj["kind"] == "RolloutFleet":
            spec = obj["spec"]
            spec["commitPolicy"] = {"attemptTimeoutSeconds": 180}
            spec["store"].update(endpoint=c.s3.endpoint, region=c.s3.region)
            spec["agent"]["scheme"] = "http"
            spec["relay"]["url"] = spec["relay"]["url"].replace("https://", "http://")
            for tls in ("caSecretRef", "serverName"):
                spec["relay"].pop(tls)
            (profile,) = spec["encoderProfiles"]
            profile["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                                    "limits": {"memory": "2Gi"}}
            profile["imagePullPolicy"] = "Never"
        if obj["kind"] in ("StatefulSet", "Deployment"):
            pod = obj["spec"]["template"]["spec"]
            _plain_http_pod(pod, f"http://{GATEWAY}:{c.rollout_link.port}")
            for container in pod.get("initContainers", []) + pod["containers"]:
                container["image"] = (c.images.serve if container["name"] == "engine"
                                      else c.images.dcr)
                container["imagePullPolicy"] = "Never"
                container["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                                          "limits": {"memory": "3Gi"}}
    return [*keys, *objs]


def _plain_http_pod(pod: dict[str, Any], store_endpoint: str) -> None:
    """A Pod spec of an example without its TLS: no certificate volume, and each of its
    containers as :func:`_plain_http` leaves it. TLS is the TLS tests' concern: no
    certificates are issued in this cluster."""
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "tls"]
    for container in pod.get("initContainers", []) + pod["containers"]:
        _plain_http(container, store_endpoint)


def _plain_http(container: dict[str, Any], store_endpoint: str) -> None:
    """``container`` without the example's TLS (its env, Secret mount and HTTPS probes and
    URLs), reaching the store at ``store_endpoint`` (the rollout Pods' link)."""
    container["env"] = [e for e in container.get("env", [])
                        if not e["name"].startswith("DCR_TLS_")]
    for e in container["env"]:
        if e["name"] == "AWS_ENDPOINT_URL":
            e["value"] = store_endpoint
    container["volumeMounts"] = [m for m in container.get("volumeMounts", [])
                                 if m["name"] != "tls"]
    container["args"] = [a.replace("https://", "http://") for a in container.get("args", [])]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            container[probe]["httpGet"]["scheme"] = "HTTP"


GROUP = "policy-group"  # a replica of two pods, StatefulSets shaped like a group


def group_manifests(c: Cluster) -> list[dict[str, Any]]:
    """A replica spanning two pods, shaped as a LeaderWorkerSet group would be (no
    LeaderWorkerSet controller runs here: its pod webhook needs certificates and a Service
    the API server calls): two StatefulSets of one pod each on one headless Service, the
    leader's ``dcr serve`` holding TP rank 0 and reaching the worker's (rank 1) with
    ``--peer``, the leader's agent naming the worker's member agent with ``--member``,
    both by their DNS names. Both start on the training side's v0 (read-only) and build
    later versions from the fleet's own store prefix under their own volume. The fleet
    groups them by labels of its own choosing (``spec.groups``)."""
    prefix = f"s3://{c.s3.bucket}/{GROUP}"
    worker = f"{GROUP}-worker-0.{GROUP}"
    secure = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "3Gi"}}
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "AWS_ENDPOINT_URL", "value": c.s3.endpoint},
           {"name": "DCR_AGENT_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "rollout-agent-token", "key": "token"}}}]
    mounts = [{"name": "staging", "mountPath": "/dcr/staging"},
              {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True},
              {"name": "engine-key", "mountPath": "/etc/dcr/engine-key", "readOnly": True}]
    common = ["--staging-dir=/dcr/staging", "--checkpoint-root=/weights",
              "--engine-api-key-file=/etc/dcr/engine-key/key"]

    def statefulset(role: str, serve: list[str], agent: list[str]) -> dict[str, Any]:
        labels = {"app": GROUP, "dcr.dev/group": "g0", "dcr.dev/group-role": role}
        ready = "/readyz" if role == "leader" else "/healthz"  # a member has no engine
        probe = {"httpGet": {"path": ready, "port": 8471}, "periodSeconds": 5}
        return {
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": f"{GROUP}-{role}"},
            "spec": {"serviceName": GROUP, "replicas": 1,
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "securityContext": {"fsGroup": 65532, "runAsNonRoot": True,
                                             "seccompProfile": {"type": "RuntimeDefault"}},
                         "containers": [
                             {"name": "engine", "image": c.images.serve,
                              "imagePullPolicy": "Never", "securityContext": secure,
                              "command": ["dcr", "serve"], "resources": small,
                              "args": ["--runtime=vllm-ref", "--tp-size=2",
                                       "--model=/checkpoints/policy-a/v0",
                                       "--staging-dir=/dcr/staging",
                                       "--checkpoint-root=/weights",
                                       "--api-key-file=/etc/dcr/engine-key/key", *serve],
                              "volumeMounts": [*mounts, {"name": "weights",
                                                         "mountPath": "/weights",
                                                         "readOnly": True}]},
                             {"name": "agent", "image": c.images.dcr,
                              "imagePullPolicy": "Never", "securityContext": secure,
                              "command": ["dcr", "agent"], "resources": small, "env": env,
                              "args": ["--name=$(POD_NAME)", "--listen=0.0.0.0:8471",
                                       f"--store={prefix}", "--model-version=0",
                                       "--canonical=/checkpoints/policy-a/v0",
                                       "--state-dir=/var/lib/dcr", *common, *agent],
                              "envFrom": [{"secretRef": {"name": "weights-s3-read"}}],
                              "ports": [{"containerPort": 8471}], "readinessProbe": probe,
                              "volumeMounts": [*mounts,
                                               {"name": "weights", "mountPath": "/weights"},
                                               {"name": "state",
                                                "mountPath": "/var/lib/dcr"}]}],
                         "volumes": [
                             {"name": "staging",
                              "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                             {"name": "weights", "emptyDir": {}},
                             {"name": "state", "emptyDir": {}},
                             {"name": "checkpoints", "persistentVolumeClaim": {
                                 "claimName": "policy-checkpoints", "readOnly": True}},
                             {"name": "engine-key", "secret": {
                                 "secretName": "rollout-engine-key", "defaultMode": 0o400}}],
                     }}}}

    (fleet,) = [o for o in fleet_manifests(c) if o["kind"] == "RolloutFleet"]
    fleet["metadata"]["name"] = GROUP
    fleet["spec"].update(
        selector={"matchLabels": {"app": GROUP}},
        groups={"size": 2, "label": "dcr.dev/group", "leaderLabel": "dcr.dev/group-role",
                "leaderValue": "leader"},
        store={**fleet["spec"]["store"], "uri": prefix})
    fleet["spec"].pop("retention", None)
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": GROUP},
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                  "selector": {"app": GROUP}, "ports": [{"name": "agent", "port": 8471}]}},
        statefulset("worker", ["--tp-rank=1", "--listen=0.0.0.0:8001"],
                    ["--role=member", "--staging-mib=64"]),
        statefulset("leader", ["--tp-rank=0", "--listen=127.0.0.1:8001",
                               f"--peer=http://{worker}:8001"],
                    ["--engine-url=http://127.0.0.1:8001", f"--member=http://{worker}:8471"]),
        fleet,
    ]


def encoder_manifests(c: Cluster) -> list[dict[str, Any]]:
    """The warm encoder example: this cluster's image, S3 endpoint and checkpoint path."""
    objs = load_yaml(EXAMPLES / "encoder-endpoint.yaml")
    by_kind = {o["kind"]: o for o in objs}
    by_kind["Secret"]["stringData"]["token"] = secrets.token_hex(24)
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    _plain_http_pod(pod, c.s3.endpoint)
    (container,) = pod["containers"]
    container["image"] = c.images.dcr
    container["imagePullPolicy"] = "Never"
    container["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                              "limits": {"memory": "2Gi"}}
    for env in container["env"]:
        if env["name"] == "AWS_DEFAULT_REGION":
            env["value"] = c.s3.region
    return objs


def volume_manifests(c: Cluster) -> list[dict[str, Any]]:
    """The claims the examples name, each bound to a node directory."""
    return host_claims(NS, {"policy-checkpoints": c.ckpts.parent,
                            "policy-base-model": c.base.parent})


@pytest.fixture(scope="module")
def cluster(node: Node, images: Images, node_s3: S3Server, pushed: Pushed,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    binaries = build_binaries()
    assert binaries.helm is not None
    tmp = tmp_path_factory.mktemp("deploy")
    ckpts = tmp / "checkpoints" / "policy-a"
    trainer = Trainer(TRAINER)
    trainer.export(ckpts / "v0")
    world_readable(tmp / "checkpoints")
    base = tmp / "base-models" / "policy-a"
    shutil.copytree(ckpts / "v0", base)
    world_readable(tmp / "base-models")
    link = Link(name="rollout-side", host=GATEWAY, mbit=200, rtt_ms=20,
                target=int(node_s3.endpoint.rsplit(":", 1)[1])).start()
    c = Cluster(node=node, images=images, s3=node_s3, helm=binaries.helm, tmp=tmp,
                ckpts=ckpts, base=base, trainer=trainer, agent_token=secrets.token_hex(24),
                rollout_link=link, pushed=pushed)
    yield c
    link.stop()
    print(f"transcript: {tmp / 'deploy-transcript.txt'}", file=sys.stderr)


# -- the tests, in order ------------------------------------------------------------------------


def test_helm_install_runs_the_operator_as_a_pod_under_its_service_account(
        cluster: Cluster) -> None:
    c = cluster
    c.kubectl("create", "namespace", NS, record=True)
    # Encoder Jobs' pods, the rollout pods and the warm encoder must all meet it.
    c.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=restricted",
              record=True)
    # The operator's image comes from the registry, with the login the chart names
    # (imagePullSecrets). The kubelet lets a Pod use an image pulled with a login only if
    # the Pod has that login too (even with imagePullPolicy Never), so the workloads'
    # namespace gets it on its default ServiceAccount, which encoder Jobs and the rollout
    # Pods run as.
    c.kubectl("create", "namespace", SYSTEM, record=True)
    c.apply([c.pushed.registry.pull_secret(PULL_SECRET)], namespace=SYSTEM)
    c.apply([c.pushed.registry.pull_secret(PULL_SECRET)])
    c.kubectl("-n", NS, "patch", "serviceaccount", "default", "-p",
              json.dumps({"imagePullSecrets": [{"name": PULL_SECRET}]}), record=True)
    repo, tag = c.pushed.ref.rsplit(":", 1)
    c.helm_run("install", RELEASE, str(REPO / "charts" / "dcr"), "--namespace", SYSTEM,
               f"--set=image.repository={repo}", f"--set=image.tag={tag}",
               "--set=image.pullPolicy=Always", f"--set=imagePullSecrets[0].name={PULL_SECRET}",
               "--set=encoder.pullPolicy=Never",
               f"--set=watchNamespaces={{{NS}}}", "--set=settings.jobPollSeconds=1",
               "--set=settings.retrySeconds=2", "--set=settings.fleetStatusSeconds=3",
               "--set=peering.lifetimeSeconds=15", "--wait", "--timeout=300s")
    (pod,) = eventually(lambda: [p for p in c.operator_pods() if pod_ready(p)], timeout_s=180,
                        what="the operator Pod Ready")
    c.kubectl("-n", SYSTEM, "get", "deployments,pods", record=True)
    assert pod["spec"]["serviceAccountName"] == f"{RELEASE}-operator"  # the chart's own
    assert pod["spec"]["containers"][0]["image"] == c.pushed.ref
    (status,) = pod["status"]["containerStatuses"]
    assert status["imageID"] == f"{repo}@{c.pushed.digest}"  # pulled from the registry
    pulled = [e for e in c.get("-n", SYSTEM, "events")["items"]
              if e["involvedObject"]["name"] == pod["metadata"]["name"]
              and e["reason"] == "Pulled"]
    assert pulled, "the kubelet pulled the operator's image"
    assert status["restartCount"] == 0, c.node.pod_logs(SYSTEM, pod["metadata"]["name"])
    # It runs as the chart's non-root user, logged in to the apiserver in-cluster.
    logs = c.node.pod_logs(SYSTEM, pod["metadata"]["name"])
    assert "Traceback" not in logs, logs


def test_the_registry_refuses_a_pull_without_the_login(cluster: Cluster) -> None:
    """The registry is private: the image the operator pulled with the chart's pull
    Secret is refused to a Pod that names none (it is not on the node under any other
    name this Pod could use, and imagePullPolicy Always asks the registry again)."""
    c = cluster
    name = "pull-without-login"
    c.apply([{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
              "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                       "containers": [{"name": "main", "image": c.pushed.ref,
                                       "imagePullPolicy": "Always", "command": ["true"]}]}}],
            namespace=SYSTEM)
    try:
        waiting = eventually(
            lambda: next((s["state"]["waiting"] for s in (c.get("-n", SYSTEM, "pod", name)[
                "status"].get("containerStatuses") or []) if "waiting" in s["state"]
                and s["state"]["waiting"].get("reason") in ("ErrImagePull", "ImagePullBackOff")),
                None), timeout_s=120, what="the pull refused")
        events = " ".join(e.get("message", "") for e in c.get("-n", SYSTEM, "events")["items"]
                          if e["involvedObject"]["name"] == name)
        assert re.search(r"401|[Uu]nauthorized|authorization failed", events), (waiting, events)
    finally:
        c.kubectl("-n", SYSTEM, "delete", "pod", name, "--wait=false")


def test_the_examples_apply_and_the_fleet_becomes_ready(cluster: Cluster) -> None:
    c = cluster
    c.apply(volume_manifests(c))
    eventually(lambda: all(
        pvc["status"].get("phase") == "Bound"
        for pvc in c.get("-n", NS, "pvc")["items"]), timeout_s=60, what="the claims Bound")
    c.apply(fleet_manifests(c))
    c.apply(rollout_manifests(c))
    try:
        eventually(lambda: len([p for p in c.rollout_pods() if pod_ready(p)]) == REPLICAS,
                   timeout_s=300, what=f"{REPLICAS} rollout Pods Ready")
        status = eventually(
            lambda: (s := c.fleet().get("status") or {}).get("readyReceivers") == REPLICAS
            and s, timeout_s=180, what="the fleet Ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{c.diagnostics()}") from None
    assert status["commit"]["committedVersion"] == 0
    conditions = _conditions(c.fleet())
    assert conditions["Ready"] == ("True", "AllReceiversCommitted")
    # The rollout pods hold the read-only key only (the server refuses its writes).
    assert conditions["ReceiversReadOnly"] == ("True", "NoPodHoldsWriteCredentials")
    c.kubectl("-n", NS, "get", "pods", "-o", "wide", record=True)
    assert c.exact(0)


def _one_shot(c: Cluster, name: str, args: list[str], **container: Any) -> str:
    """Run ``python -c`` in the dcr image as a restricted-level Pod of the namespace; its
    log once it Succeeded."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "main", "image": c.images.dcr, "imagePullPolicy": "Never",
                        "command": ["python", "-c"], "args": args,
                        "securityContext": {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}},
                        **container}]}}
    c.apply([pod])
    eventually(lambda: c.get("-n", NS, "pod", name)["status"].get("phase")
               in ("Succeeded", "Failed"), timeout_s=120, what=f"Pod {name} done")
    logs = c.node.pod_logs(NS, name)
    assert c.get("-n", NS, "pod", name)["status"]["phase"] == "Succeeded", logs
    c.kubectl("-n", NS, "delete", "pod", name, "--wait=false")
    return logs


def test_the_kubelet_expands_what_the_operator_does_not_escape_and_nothing_it_does(
        cluster: Cluster) -> None:
    """On this kubelet, ``$(AWS_SECRET_ACCESS_KEY)`` in a container's args beside
    ``envFrom`` of the store credentials becomes the secret (the attack an encoder Job's
    free-form checkpoint path allowed); the operator's escape of the same text arrives
    as written."""
    from dcr_operator.jobs import kubelet_literal

    c = cluster
    raw = "/checkpoints/$(AWS_SECRET_ACCESS_KEY)"
    logs = _one_shot(c, "expansion", ["import json, sys; print(json.dumps(sys.argv[1:]))",
                                      raw, kubelet_literal(raw)],
                     envFrom=[{"secretRef": {"name": "weights-s3"}}])
    expanded, escaped = json.loads(logs.strip().splitlines()[-1])
    assert expanded == f"/checkpoints/{c.s3.secret_key}"
    assert escaped == raw


def test_a_client_pod_reaches_the_inference_routes_and_none_of_the_engines_admin_routes(
        cluster: Cluster) -> None:
    """From another Pod, each rollout Pod answers ``/health`` through the agent's client
    gateway, refuses ``/collective_rpc``, ``/pause`` and ``/update_weights`` there with
    a 404 the engine never sees, and its engine's own port is closed to it (loopback
    only). Fails with the example before the gateway, whose engine listened on the pod
    IP, admin routes included."""
    c = cluster
    ips = [p["status"]["podIP"] for p in c.rollout_pods()]
    probe = """
import json, sys, urllib.error, urllib.request
out = {}
for ip in sys.argv[1:]:
    for method, port, path in (("GET", 8000, "/health"), ("POST", 8000, "/collective_rpc"),
                               ("POST", 8000, "/pause"), ("POST", 8000, "/update_weights"),
                               ("GET", 8001, "/health")):
        req = urllib.request.Request(f"http://{ip}:{port}{path}", method=method,
                                     data=b"{}" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                got = r.status
        except urllib.error.HTTPError as e:
            got = e.code
        except OSError as e:
            got = type(e).__name__
        out[f"{ip} {method} {port}{path}"] = got
print(json.dumps(out))
"""
    got = json.loads(_one_shot(c, "rollout-client", [probe, *ips]).strip().splitlines()[-1])
    for ip in ips:
        assert got[f"{ip} GET 8000/health"] == 200
        for path in ("/collective_rpc", "/pause", "/update_weights"):
            assert got[f"{ip} POST 8000{path}"] == 404
        assert got[f"{ip} GET 8001/health"] in ("URLError", "ConnectionRefusedError")


def test_a_refit_commits_through_encoder_pods_bit_exact(cluster: Cluster) -> None:
    c = cluster
    c.new_version(1)
    c.create_refit("policy-rollout-v1", 0, 1)
    refit = c.wait_phase("policy-rollout-v1", "Committed")
    (attempt,) = refit["status"]["attempts"]
    assert (attempt["mode"], attempt["outcome"]) == ("mixed", "Committed")
    job = c.get("-n", NS, "job", attempt["job"])
    assert (job["spec"]["completionMode"], job["spec"]["completions"]) == ("Indexed", 2)
    assert job["status"]["succeeded"] == 2
    pods = c.get("-n", NS, "pods", "-l", f"job-name={attempt['job']}")["items"]
    assert sorted(p["status"]["phase"] for p in pods) == ["Succeeded", "Succeeded"]
    assert {p["spec"]["nodeName"] for p in pods} == {"dcr-node"}  # real Pods, really run
    objects = list((c.s3.data_dir / c.s3.bucket / "policy-a").rglob("*"))
    assert any(attempt["id"] in str(o) for o in objects)
    assert c.exact(1)
    c.kubectl("-n", NS, "get", "weightrefits,rolloutfleets", record=True)


def test_the_operator_service_and_every_agent_serve_prometheus_metrics(cluster: Cluster) -> None:
    """What Prometheus scrapes, from the real pods: the operator through the chart's metrics
    Service (the API server's service proxy), each agent on its pod's port."""
    c = cluster
    fleet = {"namespace": NS, "fleet": FLEET}
    service = f"/api/v1/namespaces/{SYSTEM}/services/http:{RELEASE}-operator-metrics:metrics"

    def operator() -> dict[Key, float] | None:
        m = samples(c.kubectl("get", "--raw", f"{service}/proxy/metrics"))
        # A fleet poll (every 3 s here) since the commit: every receiver on version 1,
        # no refit unfinished.
        polled = (value(m, "dcr_operator_fleet_receivers", **fleet) == REPLICAS
                  and value(m, "dcr_operator_fleet_receivers_behind", **fleet) == 0
                  and value(m, "dcr_operator_fleet_refits_unfinished", **fleet) == 0)
        return m if polled else None

    m = eventually(operator, timeout_s=60, what="the fleet poll's gauges in the metrics")
    assert value(m, "dcr_operator_refits_total", outcome="Committed", **fleet) == 1
    assert value(m, "dcr_operator_refits_total", outcome="Failed", **fleet) == 0
    assert value(m, "dcr_operator_attempts_total", mode="mixed", outcome="Committed",
                 **fleet) == 1
    assert value(m, "dcr_operator_refit_duration_seconds_count", **fleet) == 1
    assert value(m, "dcr_operator_attempt_stage_duration_seconds_count", stage="flush") == 1
    assert value(m, "dcr_operator_committed_version", **fleet) == 1
    committed_at = c.fleet()["status"]["commit"]["committedAt"]
    assert value(m, "dcr_operator_last_commit_timestamp_seconds", **fleet) == (
        dt.datetime.fromisoformat(committed_at.replace("Z", "+00:00")).timestamp())
    for agent in c.agents():
        with urllib.request.urlopen(f"{agent.url}/metrics", timeout=30) as r:
            a = samples(r.read().decode())
        assert value(a, "dcr_agent_version") == 1, agent.name
        assert value(a, "dcr_agent_payloads_applied_total") >= 1, agent.name
        assert value(a, "dcr_agent_attempts_total", outcome="committed") == 1, agent.name


def test_kubectl_get_shows_the_printer_columns(cluster: Cluster) -> None:
    c = cluster
    fleet_row = [f"rolloutfleet.dcr.dev/{FLEET}", "1", str(REPLICAS), str(REPLICAS)]
    # READY counts the receivers the last poll reached: on a loaded machine one poll may
    # miss an agent, the next one finds it again.
    lines = eventually(
        lambda: (out := c.kubectl("-n", NS, "get", "rolloutfleets,weightrefits").splitlines())
        and out[1].split()[:4] == fleet_row and out, timeout_s=60,
        what="the fleet's row with every receiver ready")
    assert lines[0].split() == ["NAME", "VERSION", "READY", "RECEIVERS", "PODS", "REFIT",
                                "STATUS", "AGE"]
    header = next(line for line in lines if line.startswith("NAME") and "FLEET" in line)
    assert header.split() == ["NAME", "FLEET", "VERSION", "PHASE", "REASON", "ATTEMPTS",
                              "RECEIVERS", "BYTES", "AGE"]
    # (The fleet's row names the refit too, in its REFIT column, while a poll has yet to
    # see it finish.)
    row = next(line.split() for line in lines
               if line.startswith("weightrefit.dcr.dev/policy-rollout-v1 "))
    assert row[1:7] == [FLEET, "1", "Committed", "Committed", "1", str(REPLICAS)]


def test_a_rollout_pod_deleted_mid_refit_is_replaced_and_rejoins(cluster: Cluster) -> None:
    c = cluster
    c.new_version(2)
    before = c.rollout_pods()
    victim = before[0]["metadata"]["name"]
    c.create_refit("policy-rollout-v2", 1, 2)
    eventually(lambda: (c.refit("policy-rollout-v2").get("status") or {}).get("phase")
               not in (None, "", "Pending"), timeout_s=120, what="the refit under way")
    c.kubectl("-n", NS, "delete", "pod", victim, "--wait=false", record=True)
    refit = c.wait_phase("policy-rollout-v2", "Committed")
    assert refit["status"]["committed"]["attempt"]
    names = eventually(
        lambda: (pods := [p for p in c.rollout_pods() if pod_ready(p)]) and len(pods) == REPLICAS
        and {p["metadata"]["name"] for p in pods}, timeout_s=300,
        what="the Deployment's replacement Pod Ready")
    assert victim not in names
    # The replacement mounts no training checkpoint: its init container built the
    # version committed when it started from the base model and the store's deltas (or it
    # rejoined from the store later), so the whole fleet holds v2's bits.
    eventually(lambda: c.fleet()["status"].get("readyReceivers") == REPLICAS, timeout_s=180,
               what="every receiver committed at v2")
    assert c.exact(2), c.diagnostics("policy-rollout-v2")
    (new,) = names - {p["metadata"]["name"] for p in before}
    built = c.kubectl("-n", NS, "logs", new, "-c", "materialize", record=True)
    assert "bytes fetched; every file checked" in built, built
    c.fetched[new] = _fetched(built)


def test_the_operator_pod_killed_mid_refit_is_replaced_and_the_refit_finishes(
        cluster: Cluster) -> None:
    c = cluster
    c.new_version(3)
    (old,) = c.operator_pods()
    c.create_refit("policy-rollout-v3", 2, 3)
    eventually(lambda: (c.refit("policy-rollout-v3").get("status") or {}).get("attempts"),
               timeout_s=120, what="an attempt started")
    c.kubectl("-n", SYSTEM, "delete", "pod", old["metadata"]["name"], "--grace-period=0",
              "--force", record=True)
    c.wait_phase("policy-rollout-v3", "Committed", timeout_s=500)
    (new,) = eventually(lambda: [p for p in c.operator_pods() if pod_ready(p)], timeout_s=120,
                        what="the replacement operator Pod")
    assert new["metadata"]["name"] != old["metadata"]["name"]
    assert c.exact(3), c.diagnostics("policy-rollout-v3")


def test_a_pod_added_by_scaling_up_starts_at_the_committed_version(cluster: Cluster) -> None:
    """The new pod's init container builds v3 from the base model and the store's deltas
    (what it fetched is in its log); its agent reports v3 at once, bit-exact."""
    c = cluster
    before = {p["metadata"]["name"] for p in c.rollout_pods()}
    c.kubectl("-n", NS, "scale", "deployment", FLEET, f"--replicas={REPLICAS + 1}",
              record=True)
    (added,) = eventually(
        lambda: (new := [p for p in c.rollout_pods() if pod_ready(p)
                         and p["metadata"]["name"] not in before]) and new,
        timeout_s=300, what="the added Pod Ready")
    name = added["metadata"]["name"]
    built = c.kubectl("-n", NS, "logs", name, "-c", "materialize", record=True)
    assert "version 3 from 3 deltas replayed from version 0" in built, built
    c.fetched[name] = _fetched(built)
    assert c.exact(3, REPLICAS + 1), c.diagnostics("policy-rollout-v3")
    c.kubectl("-n", NS, "scale", "deployment", FLEET, f"--replicas={REPLICAS}", record=True)
    eventually(lambda: len(c.rollout_pods()) == REPLICAS, timeout_s=180,
               what="back to the fleet's size")


def test_deleting_a_refit_removes_its_jobs_and_payloads(cluster: Cluster) -> None:
    c = cluster
    refit = c.refit("policy-rollout-v2")
    ids = [a["id"] for a in refit["status"]["attempts"]]
    committed = refit["status"]["committed"]["attempt"]
    prefix = c.s3.data_dir / c.s3.bucket / "policy-a" / "v0000000002"
    assert any((prefix / i).exists() for i in ids)
    c.kubectl("-n", NS, "delete", "weightrefit", "policy-rollout-v2", "--timeout=120s",
              record=True)
    # The committed attempt stays: a pod that missed v2 replays it from the store.
    assert [i for i in ids if (prefix / i).exists()] == [committed]
    eventually(lambda: c.get("-n", NS, "jobs", "-l", "dcr.dev/refit=policy-rollout-v2")
               ["items"] == [], timeout_s=120, what="its Jobs garbage-collected")
    assert (c.s3.data_dir / c.s3.bucket / "policy-a" / "v0000000003").is_dir()


def _latency(refit: dict[str, Any], observed_s: float | None) -> dict[str, Any]:
    """WeightRefit created -> Committed, three ways: the apiserver's timestamps (whole
    seconds), the attempt's stages (the operator's clock), and this test's clock (None
    for a refit this test did not create)."""
    created = refit["metadata"]["creationTimestamp"]
    committed = next(c["lastTransitionTime"] for c in refit["status"]["conditions"]
                     if c["type"] == "Committed")
    (attempt,) = refit["status"]["attempts"]
    stamps = [dt.datetime.fromisoformat(t.replace("Z", "+00:00")) for t in (created, committed)]
    return {"refit": refit["metadata"]["name"], "created": created, "committed": committed,
            "created_to_committed_s": (stamps[1] - stamps[0]).total_seconds(),
            "observed_s": None if observed_s is None else round(observed_s, 2),
            "attempt_stages_s": attempt["stages"],
            "attempt_s": round(sum(attempt["stages"].values()), 3),
            "encoder": {"job": attempt["job"]} if "job" in attempt
            else {"endpoint": attempt["endpoint"]}}


def test_a_refit_through_the_warm_encoder_example_commits_bit_exact(
        cluster: Cluster, progress: Callable[[str], None]) -> None:
    """examples/encoder-endpoint.yaml deployed as written (but for this cluster's image,
    S3 and checkpoint path), the fleet's "warm" profile naming its Service: a refit
    naming it starts no Job and commits bit-exact. The same run refits once through the
    Job profile first; both latencies (created -> Committed) are printed and, with
    $DCR_DEPLOY_LATENCY_OUT set, written there as JSON (recorded, never asserted)."""
    c = cluster
    c.apply(encoder_manifests(c))
    try:
        (pod,) = eventually(
            lambda: [p for p in c.get("-n", NS, "pods", "-l", "app=dcr-encoder")["items"]
                     if pod_ready(p)], timeout_s=180, what="the warm encoder Pod Ready")
    except AssertionError as e:
        described = c.kubectl("-n", NS, "describe", "pods", "-l", "app=dcr-encoder",
                              check=False)
        raise AssertionError(f"{e}\n{described}") from None
    # The fleet's "warm" profile names the example's Service as written: the operator's
    # Pod reaches it by its DNS name (CoreDNS) and cluster IP (kube-proxy).
    assert pod["status"]["podIP"]
    c.kubectl("-n", NS, "get", "deployments,services", "-l", "app=dcr-encoder", record=True)
    runs = []
    for v, profile in ((4, "training-pool"), (5, "warm")):
        c.new_version(v)
        name = f"policy-rollout-v{v}"
        started = time.monotonic()
        c.create_refit(name, v - 1, v, profile=profile)
        refit = c.wait_phase(name, "Committed")
        runs.append(_latency(refit, time.monotonic() - started))
        assert c.exact(v), c.diagnostics(name)
        progress(f"tests/deploy: {name} through {profile}: created -> Committed "
                 f"{runs[-1]['created_to_committed_s']:.0f} s (apiserver), "
                 f"{runs[-1]['observed_s']:.1f} s (observed), attempt "
                 f"{runs[-1]['attempt_s']:.2f} s {runs[-1]['attempt_stages_s']}")
    job_run, warm_run = runs
    assert "job" in job_run["encoder"]
    assert warm_run["encoder"] == {"endpoint": "warm"}
    assert c.get("-n", NS, "jobs", "-l", "dcr.dev/refit=policy-rollout-v5")["items"] == []
    c.kubectl("-n", NS, "get", "weightrefits", record=True)
    c.latency.update(job=job_run, warm=warm_run)


def trainer_manifests(c: Cluster) -> list[dict[str, Any]]:
    """The trainer example for this cluster: the serve image, its S3, a random token, two
    steps from v5, small requests; rank 0 prints each version's dense fingerprints."""
    objs = load_yaml(EXAMPLES / "trainer-ranks.yaml")
    for obj in objs:
        if obj["kind"] == "Secret":
            obj["stringData"]["token"] = secrets.token_hex(24)
        if obj["kind"] == "Job":
            _plain_http_pod(obj["spec"]["template"]["spec"], c.s3.endpoint)
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            container["image"] = c.images.serve
            container["imagePullPolicy"] = "Never"
            container["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                                      "limits": {"memory": "3Gi"}}
            container["args"] = [a for a in container["args"] if not a.startswith("--steps=")]
            container["args"] += ["--steps=2", "--fingerprint", "--timeout-s=400"]
            for env in container["env"]:
                env.update({"AWS_ENDPOINT_URL": {"value": c.s3.endpoint},
                            "AWS_DEFAULT_REGION": {"value": c.s3.region}}.get(env["name"], {}))
    return objs


def test_a_training_loops_ranks_are_the_owners_on_pods_and_no_checkpoint_is_written(
        cluster: Cluster, progress: Callable[[str], None]) -> None:
    """examples/trainer-ranks.yaml: the example loop as an Indexed Job of two DDP ranks
    (gloo between the pods by their names on the headless Service) started from v5. Rank 0
    asks for v6 and v7 with dcr.client; both commit through the fleet's "ranks" profile,
    which names the ranks' pods: no encoder Job, no checkpoint of v6 or v7 anywhere. Every
    rollout Pod holds, bit for bit, what a dense load of v7 gives (rank 0 computes it from
    its gathered weights). created -> Committed is recorded beside the Job's and the warm
    encoder's from the test before (with $DCR_DEPLOY_LATENCY_OUT, as JSON)."""
    c = cluster
    objs = trainer_manifests(c)
    urls = [f"http://trainer-{r}.trainer.{NS}.svc:8472" for r in range(2)]
    c.kubectl("-n", NS, "patch", "rolloutfleet", FLEET, "--type=merge", "-p", json.dumps({
        "spec": {"retention": {"snapshotEvery": None},  # a snapshot Job reads a checkpoint
                 "encoderProfiles": [
                     *c.fleet()["spec"]["encoderProfiles"],
                     {"name": "ranks", "endpoint": {"urls": urls, "tokenSecretRef": {
                         "name": "rank-token", "key": "token"}}}]}}), record=True)
    c.apply(objs)

    def job() -> dict[str, Any] | None:
        status = c.get("-n", NS, "job", "trainer").get("status") or {}
        return status if status.get("succeeded") == 2 or status.get("failed") else None

    try:
        done = eventually(job, timeout_s=600, what="the trainer Job's two ranks done")
        assert done.get("succeeded") == 2, done
    except AssertionError as e:
        logs = "\n".join(c.node.pod_logs(NS, p["metadata"]["name"], "rank")[-4000:] for p in
                         c.get("-n", NS, "pods", "-l", "app=trainer")["items"])
        raise AssertionError(f"{e}\n{logs}\n{c.diagnostics()}") from None
    (rank0,) = [p for p in c.get("-n", NS, "pods", "-l", "app=trainer")["items"]
                if p["metadata"]["name"].startswith("trainer-0-")]
    lines = c.node.pod_logs(NS, rank0["metadata"]["name"], "rank").splitlines()
    dense = {d["version"]: d["fingerprint"]
             for d in (json.loads(line) for line in lines if line.startswith('{"version"'))}
    assert sorted(dense) == [6, 7]
    runs = []
    for v in (6, 7):
        refit = c.wait_phase(f"{FLEET}-v{v}", "Committed")
        (attempt,) = refit["status"]["attempts"]
        assert attempt["endpoint"] == "ranks"
        runs.append(_latency(refit, None))
    assert c.get("-n", NS, "jobs", "-l", "dcr.dev/refit in (policy-rollout-v6,"
                 "policy-rollout-v7)")["items"] == []
    assert not any((c.ckpts / f"v{v}").exists() for v in (6, 7))
    agents = c.agents()
    assert len(agents) == REPLICAS
    assert all(a.fingerprint() == dense[7] for a in agents), c.diagnostics(f"{FLEET}-v7")
    assert c.fleet()["status"]["commit"]["baselineId"] == f"/ranks/{FLEET}/v7"
    token = next(o for o in objs if o["kind"] == "Secret")["stringData"]["token"]
    for pod in c.operator_pods():
        assert token not in c.node.pod_logs(SYSTEM, pod["metadata"]["name"])
    c.kubectl("-n", NS, "get", "jobs,pods", "-l", "app=trainer", "-o", "wide", record=True)
    c.kubectl("-n", NS, "delete", "job", "trainer", "--timeout=120s")
    c.latency["ranks"] = runs[-1]
    for way in ("job", "warm", "ranks"):
        run = c.latency.get(way)
        if run:
            progress(f"tests/deploy: created -> Committed through {way}: "
                     f"{run['created_to_committed_s']:.0f} s (apiserver), attempt "
                     f"{run['attempt_s']:.2f} s {run['attempt_stages_s']}")
    if not LATENCY_OUT or set(c.latency) != {"job", "warm", "ranks"}:
        return
    out = Path(LATENCY_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "WeightRefit created -> Committed on the deploy tier's one-node cluster "
                "(real kubelet and images), the same model and run, three ways: a refit "
                "through the encoder Job profile, one through the warm encoder (dcr "
                "encoder), then the training loop's own refits, its two data-parallel rank pods "
                "the owners (python -m dcr.loop --sharding ddp; the second of its two steps)",
        "command": "DCR_DEPLOY_LATENCY_OUT=bench/results/operator-latency.json "
                   ".venv/bin/python -m pytest tests/deploy/test_deploy.py",
        "tests": ["tests/deploy/test_deploy.py::"
                  "test_a_refit_through_the_warm_encoder_example_commits_bit_exact",
                  "tests/deploy/test_deploy.py::"
                  "test_a_training_loops_ranks_are_the_owners_on_pods_and_no_checkpoint_is_written"],
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)},
        "model": {"trainer": dataclasses.asdict(TRAINER),
                  "checkpoint_bytes": sum(f.stat().st_size
                                          for f in (c.ckpts / "v5").glob("*.safetensors"))},
        "owners": 2, "receivers": REPLICAS, **c.latency}, indent=1) + "\n")


def test_the_fleet_keeps_at_most_refit_history_limit_finished_refits(cluster: Cluster) -> None:
    """A run leaves one WeightRefit per step; with refitHistoryLimit the operator's fleet
    poll deletes all but the newest finished ones (their finalizer cleans the store)."""
    c = cluster

    def finished() -> list[str]:  # oldest first
        items = c.get("-n", NS, "weightrefits")["items"]
        done = [(r["status"]["completionTime"], r["metadata"]["name"]) for r in items
                if r["spec"]["fleet"] == FLEET
                and (r.get("status") or {}).get("phase") in ("Committed", "Failed")]
        return [name for _, name in sorted(done)]

    before = finished()
    assert len(before) > 2, before
    c.kubectl("-n", NS, "patch", "rolloutfleet", FLEET, "--type=merge",
              "-p", '{"spec": {"refitHistoryLimit": 2}}', record=True)

    def pruned() -> list[str] | None:
        names = finished()
        return names if len(names) <= 2 else None

    kept = eventually(pruned, timeout_s=120, what="the fleet's finished WeightRefits down to 2")
    assert kept == before[-2:]  # the newest two
    c.kubectl("-n", NS, "get", "weightrefits", record=True)


def test_a_refit_through_the_relay_tree_survives_a_relay_pod_killed_mid_refit(
        cluster: Cluster) -> None:
    """examples/relay.yaml: a StatefulSet of three relay nodes that find each other by
    name (cluster DNS), a relay fleet whose encoder Jobs of two owners publish to the root
    and write through to the fleet's store, and two rollout pods that mount nothing of
    the training side reading through the read Service. Relay node 1 is killed once the
    first attempt started; its replacement rejoins under the same name, v1 commits, and
    both rollout pods hold v1 bit for bit; v2 and v3 follow through the tree; the store's
    history names all three. Then a rollout pod is deleted and one added by scaling, each
    reaching v3 bit for bit from the history (spec.catchUp.peers): the replacement from
    the store (no sibling holds a copy built for a rejoin: they refit in place), the one
    added after it from the replacement's copy, as their agents' counters say."""
    c = cluster
    for v in (1, 2, 3):  # run without the store fleet's refits before it
        if not (c.ckpts / f"v{v}").exists():
            c.new_version(v)
    c.apply(relay_manifests(c))

    def pods(app: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = c.get("-n", NS, "pods", "-l", f"app={app}")["items"]
        return [p for p in items if "deletionTimestamp" not in p["metadata"] and pod_ready(p)]

    def fleet_ready(n: int) -> bool:  # every receiver polled at the committed version
        status = c.get("-n", NS, "rolloutfleet", "relay-rollout").get("status") or {}
        return status.get("readyReceivers") == status.get("receiverCount") == n

    try:
        eventually(lambda: len(pods("rollout-relay")) == 3 and len(pods("relay-rollout")) == 2,
                   timeout_s=300, what="three relay nodes and two rollout Pods Ready")
        eventually(lambda: fleet_ready(2), timeout_s=180, what="the relay fleet Ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{c.diagnostics()}") from None
    (victim,) = [p for p in pods("rollout-relay")
                 if p["metadata"]["name"] == "rollout-relay-1"]
    for p in pods("relay-rollout"):  # nothing of the training side: its checkpoints claim
        claims = {v["persistentVolumeClaim"]["claimName"] for v in p["spec"]["volumes"]
                  if "persistentVolumeClaim" in v}
        assert claims == {"policy-base-model"}, claims

    def relay_refit(v: int) -> None:
        refit = refit_example(f"relay-rollout-v{v}", v - 1, v, fleet="relay-rollout")
        refit["spec"]["encoder"] = {"profile": "training-pool", "owners": 2}
        c.apply([refit])

    relay_refit(1)
    eventually(lambda: (c.refit("relay-rollout-v1").get("status") or {}).get("attempts"),
               timeout_s=120, what="an attempt started")
    c.kubectl("-n", NS, "delete", "pod", "rollout-relay-1", "--grace-period=0", "--force",
              record=True)
    c.wait_phase("relay-rollout-v1", "Committed", timeout_s=500)
    back = eventually(lambda: [p for p in pods("rollout-relay")
                               if p["metadata"]["name"] == "rollout-relay-1"],
                      timeout_s=180, what="relay node 1 replaced and Ready")
    assert back[0]["metadata"]["uid"] != victim["metadata"]["uid"]

    def agents(n: int, what: str) -> dict[str, AgentClient]:  # /readyz: at the commit
        ready = eventually(lambda: (lambda r: r if len(r) == n and fleet_ready(n) else None)(
            pods("relay-rollout")), timeout_s=300, what=what)
        return {p["metadata"]["name"]: AgentClient(
            p["metadata"]["name"], f"http://{p['status']['podIP']}:8471", c.agent_token,
            timeout_s=30) for p in ready}

    want = reference_fingerprint(c.ckpts / "v1")
    assert all(a.fingerprint() == want for a in agents(
        2, "both rollout Pods Ready at v1").values())
    for v in (2, 3):
        relay_refit(v)
        c.wait_phase(f"relay-rollout-v{v}", "Committed", timeout_s=500)
    relay_store = c.s3.data_dir / c.s3.bucket / "policy-a-relay"
    history = History.parse((relay_store / HISTORY_KEY).read_bytes(), "the relay fleet's store")
    assert [e.version for e in history.versions] == [1, 2, 3]
    want = reference_fingerprint(c.ckpts / "v3")
    assert all(a.fingerprint() == want for a in agents(
        2, "both rollout Pods Ready at v3").values())

    # A pod deleted, then one added by scaling: each starts from version 0 and the
    # operator rejoins it to v3, built from a peer's copy or the store.
    (gone,) = [p for p in pods("relay-rollout") if p["metadata"]["name"] == "relay-rollout-0"]
    c.kubectl("-n", NS, "delete", "pod", "relay-rollout-0", "--grace-period=0", "--force",
              record=True)
    eventually(lambda: [p for p in pods("relay-rollout") if p["metadata"]["name"] ==
                        "relay-rollout-0" and p["metadata"]["uid"] != gone["metadata"]["uid"]],
               timeout_s=300, what="rollout Pod 0 replaced and Ready")
    agents(2, "the replacement rejoined v3")
    c.kubectl("-n", NS, "scale", "statefulset", "relay-rollout", "--replicas=3", record=True)
    now = agents(3, "the Pod added by scaling rejoined v3")
    assert all(a.fingerprint() == want for a in now.values())
    counters = {name: _peer_counters(a) for name, a in now.items()}
    c.transcript.append(f"relay fleet peer catch-up (bytes from peers, refusals): {counters}")
    assert counters["relay-rollout-0"][0] == 0  # from the store: no sibling lent a copy
    assert counters["relay-rollout-0"][1] >= 1  # ... each asked first
    assert counters["relay-rollout-2"][0] > 0  # from relay-rollout-0's copy of v3
    c.kubectl("-n", NS, "get", "statefulsets,pods", "-l", "app in (rollout-relay,relay-rollout)",
              "-o", "wide", record=True)
    # Leave the namespace as the tests after this one expect it.
    for kind, name in (*(("weightrefit", f"relay-rollout-v{v}") for v in (1, 2, 3)),
                       ("statefulset", "relay-rollout"), ("statefulset", "rollout-relay"),
                       ("rolloutfleet", "relay-rollout")):
        c.kubectl("-n", NS, "delete", kind, name, "--timeout=180s")


def _peer_counters(agent: AgentClient) -> tuple[float, float]:
    """An agent's bytes fetched from peers' copies it used, and peers' copies refused."""
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=30) as r:
        m = samples(r.read().decode())
    return (value(m, "dcr_agent_peer_bytes_fetched_total"),
            value(m, "dcr_agent_peer_refusals_total"))


def test_the_rollout_side_reached_the_store_only_through_its_link(
        cluster: Cluster, progress: Callable[[str], None]) -> None:
    """Every byte the rollout Pods read (refits' payloads, the init containers' builds,
    the history) crossed one emulated 200 Mbit/s link; the total is reported. The link
    stops here, after the relay fleet's pods (which build from the store through it too):
    the group's pods after it reach the store directly."""
    c = cluster
    c.rollout_link.stop()
    down, up = c.rollout_link.bytes_down, c.rollout_link.bytes_up
    full = sum(f.stat().st_size for f in (c.ckpts / "v5").glob("*.safetensors"))
    report = (f"rollout side <- store across the link: {down:,} bytes down, {up:,} up; "
              f"the init containers' builds {sum(c.fetched.values()):,} of them "
              f"({', '.join(f'{k} {v:,}' for k, v in sorted(c.fetched.items()))}); one full "
              f"checkpoint is {full:,} bytes")
    progress(f"tests/deploy: {report}")
    c.transcript.append(report)
    assert len(c.fetched) == 2  # the replacement and the scaled-up Pod
    assert down >= sum(c.fetched.values()) > 0


def test_a_group_of_two_pods_refits_bit_exact_and_recovers_its_killed_worker_pod(
        cluster: Cluster) -> None:
    """spec.groups on real pods (:func:`group_manifests`): the fleet counts one receiver
    of two pods; v1 commits through the leader's agent, bit-exact on both ranks; the
    worker pod killed once the attempt started is replaced by its StatefulSet, the group
    rebuilds v1 from the store under each pod's own volume, and v2 commits."""
    c = cluster
    c.apply(group_manifests(c))

    def status() -> dict[str, Any]:
        return group_status(c)

    def holds(v: int) -> bool:
        return group_holds(c, v)

    try:
        eventually(lambda: status().get("readyReceivers") == 1, timeout_s=300,
                   what="the group Ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{c.diagnostics()}") from None
    st = status()
    assert (st["receiverCount"], st["podCount"]) == (1, 2)
    ((entry,),) = [st["receivers"]]
    assert entry["pods"] == [f"{GROUP}-leader-0", f"{GROUP}-worker-0"]

    def refit(name: str, base: int, target: int) -> None:
        c.apply([refit_example(name, base, target, fleet=GROUP)])

    refit(f"{GROUP}-v1", 0, 1)
    c.wait_phase(f"{GROUP}-v1", "Committed")
    assert holds(1)
    (victim,) = c.get("-n", NS, "pods", "-l", f"app={GROUP},dcr.dev/group-role=worker")[
        "items"]
    if not (c.ckpts / "v2").exists():  # the store fleet's tests made it, if they ran
        c.new_version(2)
    refit(f"{GROUP}-v2", 1, 2)
    eventually(lambda: (c.refit(f"{GROUP}-v2").get("status") or {}).get("attempts"),
               timeout_s=120, what="an attempt started")
    c.kubectl("-n", NS, "delete", "pod", victim["metadata"]["name"], "--grace-period=0",
              "--force", record=True)
    c.wait_phase(f"{GROUP}-v2", "Committed", timeout_s=500)
    # The attempt may commit before the kill lands; either way the replaced worker pod
    # starts on v0 and the group is whole again only once the fleet rejoined it to v2.
    (back,) = eventually(
        lambda: [p for p in c.get("-n", NS, "pods", "-l",
                                  f"app={GROUP},dcr.dev/group-role=worker")["items"]
                 if p["metadata"]["uid"] != victim["metadata"]["uid"] and pod_ready(p)],
        timeout_s=300, what="the worker pod replaced and Ready")

    def rejoined() -> bool:
        entry = (status().get("receivers") or [{}])[0]
        return entry.get("version") == 2 and not entry.get("error")

    eventually(rejoined, timeout_s=300, what="the group at v2 with its new worker pod")
    assert back["metadata"]["uid"] != victim["metadata"]["uid"]
    assert holds(2)
    c.kubectl("-n", NS, "get", "rolloutfleet", GROUP, "-o", "wide", record=True)
    # The next test refits the group once more across an upgrade of the operator, then
    # removes it.


def group_status(c: Cluster) -> dict[str, Any]:
    return c.get("-n", NS, "rolloutfleet", GROUP).get("status") or {}


def group_holds(c: Cluster, v: int) -> bool:
    """The group's two ranks hold, bit for bit, a dense load of version ``v``."""
    want = merge_fingerprints([reference_fingerprint(c.ckpts / f"v{v}", "vllm-ref",
                                                     tp_size=2, tp_rank=r)
                               for r in range(2)])
    (leader,) = c.get("-n", NS, "pods", "-l", f"app={GROUP},dcr.dev/group-role=leader")[
        "items"]
    agent = AgentClient(GROUP, f"http://{leader['status']['podIP']}:8471", c.agent_token,
                        timeout_s=60)
    return agent.fingerprint() == want


def test_helm_upgrade_to_a_new_operator_image_mid_refit_and_the_refit_commits(
        cluster: Cluster) -> None:
    """docs/upgrades.md, "Upgrading the operator": ``helm upgrade`` to a new operator
    image while the group's refit to v3 runs. The image is the same build pushed under
    another repository (``make push`` to REGISTRY/dcr-next): what is tried is the upgrade
    itself (the Deployment replaced mid-attempt, the new Pod pulling the new reference,
    encoder Jobs after it naming the new image), not a skew between releases, which
    tests/integration/test_receiver_process.py tries with agents one version apart. The
    refit commits and both ranks hold v3 bit for bit."""
    c = cluster
    if not (c.ckpts / "v3").exists():  # the store fleet's tests made it, if they ran
        c.new_version(3)
    upgraded = push(c.pushed.registry, "dcr-next")
    (old,) = [p for p in c.operator_pods() if pod_ready(p)]
    c.apply([refit_example(f"{GROUP}-v3", 2, 3, fleet=GROUP)])
    eventually(lambda: (c.refit(f"{GROUP}-v3").get("status") or {}).get("attempts"),
               timeout_s=120, what="an attempt started")
    repo, tag = upgraded.ref.rsplit(":", 1)
    c.helm_run("upgrade", RELEASE, str(REPO / "charts" / "dcr"), "--namespace", SYSTEM,
               "--reuse-values", f"--set=image.repository={repo}", f"--set=image.tag={tag}",
               "--wait", "--timeout=300s")
    (new,) = eventually(lambda: [p for p in c.operator_pods() if pod_ready(p)
                                 and p["metadata"]["name"] != old["metadata"]["name"]],
                        timeout_s=180, what="the upgraded operator Pod")
    assert new["spec"]["containers"][0]["image"] == upgraded.ref
    c.wait_phase(f"{GROUP}-v3", "Committed", timeout_s=500)
    eventually(lambda: (group_status(c).get("receivers") or [{}])[0].get("version") == 3,
               timeout_s=120, what="the group's status at v3")
    assert group_holds(c, 3), c.diagnostics(f"{GROUP}-v3")
    c.kubectl("-n", NS, "get", "weightrefit", f"{GROUP}-v3", "-o", "wide", record=True)
    for kind, name in (("statefulset", f"{GROUP}-leader"), ("statefulset", f"{GROUP}-worker"),
                       ("rolloutfleet", GROUP)):
        c.kubectl("-n", NS, "delete", kind, name, "--timeout=180s")


def test_helm_upgrade_rolls_the_operator_with_the_new_value(cluster: Cluster) -> None:
    c = cluster
    (old,) = c.operator_pods()
    c.helm_run("upgrade", RELEASE, str(REPO / "charts" / "dcr"), "--namespace", SYSTEM,
               "--reuse-values", "--set=logLevel=DEBUG", "--wait", "--timeout=300s")
    (new,) = eventually(lambda: [p for p in c.operator_pods() if pod_ready(p)
                                 and p["metadata"]["name"] != old["metadata"]["name"]],
                        timeout_s=180, what="the upgraded operator Pod")
    assert "--log-level=DEBUG" in new["spec"]["containers"][0]["args"]


def test_helm_uninstall_and_namespace_deletion_leave_nothing_behind(cluster: Cluster) -> None:
    c = cluster
    # docs/operations.md, "Uninstall": refits that are done go while the operator runs (it
    # cleans their payloads), then the release, then the namespace.
    c.kubectl("-n", NS, "delete", "weightrefits", "--all", "--timeout=180s", record=True)
    # What catch-up needs stays (the store's history and each version's committed
    # attempt); every other attempt's objects are gone.
    fleet_store = c.s3.data_dir / c.s3.bucket / "policy-a"
    history = History.parse((fleet_store / HISTORY_KEY).read_bytes(), "the fleet's store")
    kept = {f"v{e.version:010d}/{e.attempt}" for e in history.versions}
    assert {p.relative_to(fleet_store).as_posix() for p in fleet_store.glob("v*/a-*")} == kept
    assert len(kept) >= 4
    c.kubectl("-n", NS, "delete", "deployment", FLEET, "--wait=true", "--timeout=120s")
    c.helm_run("uninstall", RELEASE, "--namespace", SYSTEM, "--wait", "--timeout=120s")
    left = c.kubectl("get", "clusterroles,clusterrolebindings,clusterkopfpeerings", "-o",
                     "name", "-l", "app.kubernetes.io/instance=" + RELEASE, check=False)
    assert left.strip() == ""
    for ns in (SYSTEM, NS):
        assert c.kubectl("-n", ns, "get", "deployments,serviceaccounts,roles,rolebindings,"
                         "kopfpeerings", "-o", "name", "-l",
                         "app.kubernetes.io/instance=" + RELEASE, check=False).strip() == ""
    # The fleet stays with its CRD (helm never deletes CRDs) and carries no finalizer:
    # with no operator left, deleting its namespace finishes.
    assert c.fleet()["metadata"].get("finalizers") in (None, [])
    c.kubectl("delete", "namespace", NS, "--wait=false", record=True)
    eventually(lambda: c.kubectl("get", "namespace", NS, check=False).strip() == "",
               timeout_s=120, what=f"namespace {NS} deleted")
    c.kubectl("delete", "namespace", SYSTEM, "--wait=true", "--timeout=120s")
