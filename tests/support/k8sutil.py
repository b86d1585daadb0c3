"""Helpers for tests against the real apiserver: apply manifests, poll, render the chart."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from kubernetes.client import Configuration

from dcr_operator.api.generate import crd_manifests
from dcr_operator.errors import Conflict, NotFound
from dcr_operator.kube import KubeClient

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "dcr"
T = TypeVar("T")

# kind -> (api prefix, plural, namespaced)
KINDS: dict[str, tuple[str, str, bool]] = {
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions",
                                 False),
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "Secret": ("/api/v1", "secrets", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Pod": ("/api/v1", "pods", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "StatefulSet": ("/apis/apps/v1", "statefulsets", True),
    "Service": ("/api/v1", "services", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "Job": ("/apis/batch/v1", "jobs", True),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims", True),
    "ClusterKopfPeering": ("/apis/kopf.dev/v1", "clusterkopfpeerings", False),
    "KopfPeering": ("/apis/kopf.dev/v1", "kopfpeerings", True),
    "RolloutFleet": ("/apis/dcr.dev/v1alpha1", "rolloutfleets", True),
    "WeightRefit": ("/apis/dcr.dev/v1alpha1", "weightrefits", True),
    # prometheus-operator's (the chart's optional monitoring; tests/operator/test_monitoring.py)
    "ServiceMonitor": ("/apis/monitoring.coreos.com/v1", "servicemonitors", True),
    "PodMonitor": ("/apis/monitoring.coreos.com/v1", "podmonitors", True),
    "PrometheusRule": ("/apis/monitoring.coreos.com/v1", "prometheusrules", True),
    # LeaderWorkerSet's (the multi-node rollout example; tests/operator/test_examples.py)
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets", True),
}


def admin_client(cp: Any) -> KubeClient:
    """A client of the control plane's admin (system:masters) client certificate."""
    return KubeClient(lambda: Configuration(host=cp.server, ssl_ca_cert=str(cp.ca_path),
                                            cert_file=str(cp.admin_cert_path),
                                            key_file=str(cp.admin_key_path)))


def path_of(obj: dict[str, Any], namespace: str | None = None, *, named: bool = False) -> str:
    prefix, plural, namespaced = KINDS[obj["kind"]]
    ns = obj.get("metadata", {}).get("namespace") or namespace
    base = f"{prefix}/namespaces/{ns}/{plural}" if namespaced else f"{prefix}/{plural}"
    return f"{base}/{obj['metadata']['name']}" if named else base


def apply(kube: KubeClient, objs: Iterable[dict[str, Any]], namespace: str | None = None
          ) -> list[dict[str, Any]]:
    """Create each object (replace it if it exists); the created objects."""
    out = []
    for obj in objs:
        try:
            out.append(kube.create(path_of(obj, namespace), obj))
        except Conflict:
            current = kube.get(path_of(obj, namespace, named=True))
            obj = {**obj, "metadata": {**obj["metadata"],
                                       "resourceVersion": current["metadata"]["resourceVersion"]}}
            out.append(kube.request("PUT", path_of(obj, namespace, named=True), obj))
    return out


def install_crds(kube: KubeClient) -> None:
    apply(kube, crd_manifests().values())
    wait_established(kube, crd_manifests().values())


def wait_established(kube: KubeClient, crds: Iterable[dict[str, Any]]) -> None:
    """Until the API server serves each CustomResourceDefinition (``Established``)."""
    for crd in crds:
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
        eventually(lambda path=path: any(  # type: ignore[misc]
            c["type"] == "Established" and c["status"] == "True"
            for c in (kube.get(path).get("status") or {}).get("conditions") or []),
            what=f"{path} established")


def eventually(check: Callable[[], T | None], *, timeout_s: float = 60.0, what: str,
               every_s: float = 0.2,
               transient: tuple[type[BaseException], ...] = (NotFound,)) -> T:
    """Poll ``check`` until it returns something truthy (``transient`` errors, NotFound
    by default, count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
        except transient as e:
            last = e
        else:
            if last:
                return cast(T, last)
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")
        time.sleep(every_s)


def helm_template(helm: Path, *args: str, release: str = "dcr") -> list[dict[str, Any]]:
    out = subprocess.run([str(helm), "template", release, str(CHART), *args],
                         capture_output=True, text=True, check=True, timeout=60)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def load_yaml(path: Path) -> list[dict[str, Any]]:
    """Every document of a YAML file (a chart example), empty ones left out."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


def world_readable(root: Path) -> None:
    """The node's Pods run as a non-root user: what they mount from ``root`` must be
    world-readable."""
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def host_claims(namespace: str, paths: dict[str, Path]) -> list[dict[str, Any]]:
    """A read-only PersistentVolumeClaim per ``paths`` entry (claim name -> directory on
    the node), each bound to a hostPath PersistentVolume of its own: Pods mount claims
    only, as the restricted level requires."""
    objs: list[dict[str, Any]] = []
    for claim, path in paths.items():
        objs.append({"apiVersion": "v1", "kind": "PersistentVolume",
                     "metadata": {"name": f"{namespace}-{claim}"},
                     "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                              "persistentVolumeReclaimPolicy": "Retain",
                              "storageClassName": "",
                              "claimRef": {"namespace": namespace, "name": claim},
                              "hostPath": {"path": str(path), "type": "Directory"}}})
        objs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": claim, "namespace": namespace},
                     "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                              "volumeName": f"{namespace}-{claim}",
                              "resources": {"requests": {"storage": "1Gi"}}}})
    return objs


def fleet_example(s3: Any, token: str, *, attempt_timeout_s: int) -> list[dict[str, Any]]:
    """charts/dcr/examples/rolloutfleet.yaml for a one-node cluster: ``s3``'s endpoint and
    owners' key (an :class:`s3server.S3Server`), the agents' ``token``, and small encoder
    pods of images already on the node."""
    token_secret, fleet = load_yaml(CHART / "examples" / "rolloutfleet.yaml")
    token_secret["stringData"]["token"] = token
    spec = fleet["spec"]
    spec["store"].update(endpoint=s3.endpoint, region=s3.region)
    spec["commitPolicy"]["attemptTimeoutSeconds"] = attempt_timeout_s
    # One cluster here: no training cluster for a profile's Jobs to run in (the operator
    # tier runs that one against a second control plane).
    spec["encoderProfiles"] = [p for p in spec["encoderProfiles"] if "cluster" not in p]
    (profile,) = [p for p in spec["encoderProfiles"] if "endpoint" not in p]
    profile.pop("nodeSelector", None)  # one node, unlabelled
    profile["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                            "limits": {"memory": "2Gi"}}
    profile["imagePullPolicy"] = "Never"
    credentials = {"apiVersion": "v1", "kind": "Secret",
                   "metadata": {"name": "weights-s3",
                                "labels": {"dcr.dev/store-credentials": "true"}},
                   "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key,
                                  "AWS_SECRET_ACCESS_KEY": s3.secret_key}}
    return [token_secret, credentials, fleet]


def refit_example(name: str, base: int, target: int, *, fleet: str | None = None
                  ) -> dict[str, Any]:
    """charts/dcr/examples/weightrefit.yaml as ``name``, from ``base`` to ``target``, whose
    checkpoint is the example fleet's ``/checkpoints/policy-a/v<target>``; for ``fleet``
    when given, else the example's fleet."""
    refit = load_yaml(CHART / "examples" / "weightrefit.yaml")[0]
    refit["metadata"]["name"] = name
    refit["spec"].update(baseVersion=base, targetVersion=target,
                         source={"checkpoint": f"/checkpoints/policy-a/v{target}"})
    if fleet is not None:
        refit["spec"]["fleet"] = fleet
    return refit
