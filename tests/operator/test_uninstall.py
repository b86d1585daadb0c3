"""Once the operator is gone (``helm uninstall``), the namespaces it served still delete.

A finalizer is a promise that some controller will act before the object goes; with the
operator uninstalled nobody keeps it, and the namespace hangs in Terminating on the
object that carries it. So the operator holds its finalizer (``dcr.dev/cleanup``) only
on WeightRefits it still has work for: one that is unfinished (its run to stop, its Jobs
to delete) or that recorded attempts whose payloads the store may still hold. A
RolloutFleet never carries it, and a finished refit without attempts loses it.

Here, on the real control plane: the operator runs as a process (``python -m
dcr_operator``), initializes a fleet, keeps its receivers' status fresh (a pod that
appears later shows up in ``status.receivers``), and fails a refit from a stale base
version; then it stops (SIGTERM, as a Deployment's pod is stopped) and the namespace is
deleted: it must be gone within a bound, with nothing left waiting for the operator.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from controlplane import ControlPlane
from k8sutil import REPO, apply, eventually, install_crds

from dcr_operator.kube import KubeClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOKEN = "uninstall-agent-token-0123456789abcdef"
DELETE_WITHIN_S = 120  # the namespace controller's sweep, generous for a loaded machine


def _path(ns: str, plural: str, name: str = "") -> str:
    root = "/api/v1" if plural in ("pods", "secrets", "serviceaccounts") else \
        "/apis/dcr.dev/v1alpha1"
    return f"{root}/namespaces/{ns}/{plural}" + (f"/{name}" if name else "")


@pytest.fixture
def operator_ns(control_plane: ControlPlane, kube: KubeClient) -> Iterator[str]:
    """A namespace of its own: the test deletes it and waits for it to go."""
    ns = f"uninstall-{uuid.uuid4().hex[:8]}"
    kube.create("/api/v1/namespaces", {"metadata": {"name": ns}})
    install_crds(kube)
    eventually(lambda: kube.get(_path(ns, "serviceaccounts", "default")),
               what="the namespace's default ServiceAccount")
    yield ns
    control_plane.request("DELETE", f"/api/v1/namespaces/{ns}")


def _start_operator(cp: ControlPlane, ns: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "PYTHONUNBUFFERED": "1",
           "DCR_OPERATOR_RETRY_SECONDS": "1", "DCR_OPERATOR_FLEET_STATUS_SECONDS": "1",
           "DCR_OPERATOR_METRICS_PORT": "0"}
    out: IO[bytes] = open(log, "ab")  # noqa: SIM115 (owned by the process)
    try:
        return subprocess.Popen([sys.executable, "-m", "dcr_operator", f"--namespace={ns}",
                                 "--standalone", "--log-level=INFO"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    finally:
        out.close()


def _holders(kube: KubeClient, ns: str) -> list[str]:
    """Every fleet and refit of ``ns`` that carries a finalizer (the operator's)."""
    return [f"{plural}/{o['metadata']['name']}: {o['metadata']['finalizers']}"
            for plural in ("rolloutfleets", "weightrefits")
            for o in kube.get(_path(ns, plural)).get("items", [])
            if o["metadata"].get("finalizers")]


def test_after_the_operator_stops_its_namespace_deletes_with_nothing_waiting_for_it(
        control_plane: ControlPlane, kube: KubeClient, operator_ns: str, tmp_path: Path
) -> None:
    ns, cp = operator_ns, control_plane
    apply(kube, [{"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": "agent-token", "labels": {"dcr.dev/agent-token": "true"}},
                  "data": {"token": base64.b64encode(TOKEN.encode()).decode()}}], ns)
    operator = _start_operator(cp, ns, tmp_path / "operator.log")
    try:
        apply(kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
                      "metadata": {"name": "rollout"},
                      "spec": {"selector": {"matchLabels": {"app": "rollout"}},
                               "agent": {"port": 8471,
                                         "tokenSecretRef": {"name": "agent-token"}},
                               "store": {"uri": (tmp_path / "store").as_uri()},
                               "initial": {"version": 3,
                                           "checkpoint": str(tmp_path / "v3")}}}], ns)
        eventually(lambda: (kube.get(_path(ns, "rolloutfleets", "rollout")).get("status")
                            or {}).get("commit"),
                   what="the fleet's initial commit record", timeout_s=60)

        # The fleet's status keeps up with its pods without a per-fleet timer: a pod that
        # appears now is listed (unreachable: no agent listens at its address).
        apply(kube, [{"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": "rollout-0", "labels": {"app": "rollout"}},
                      "spec": {"containers": [{"name": "agent", "image": "dcr:test"}]}}], ns)
        kube.merge_patch(_path(ns, "pods", "rollout-0") + "/status", {"status": {
            "phase": "Running", "podIP": "127.0.0.9", "podIPs": [{"ip": "127.0.0.9"}]}})
        eventually(lambda: [r["name"] for r in (kube.get(_path(ns, "rolloutfleets", "rollout"))
                                                .get("status") or {}).get("receivers", [])]
                   == ["rollout-0"], what="the new pod in the fleet's receivers", timeout_s=60)

        apply(kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
                      "metadata": {"name": "stale"},
                      "spec": {"fleet": "rollout", "baseVersion": 1, "targetVersion": 2,
                               "source": {"checkpoint": str(tmp_path / "v2")}}}], ns)
        eventually(lambda: (kube.get(_path(ns, "weightrefits", "stale")).get("status")
                            or {}).get("phase") == "Failed",
                   what="the stale refit Failed", timeout_s=60)
        refit = kube.get(_path(ns, "weightrefits", "stale"))
        assert refit["status"].get("attempts", []) == []  # nothing in the store to clean

        eventually(lambda: _holders(kube, ns) == [], timeout_s=60,
                   what="no finalizer on the fleet or on a finished refit without attempts")
    finally:
        operator.terminate()
        try:
            operator.wait(30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait(10)

    assert cp.request("DELETE", f"/api/v1/namespaces/{ns}").status == 200
    try:
        eventually(lambda: cp.request("GET", f"/api/v1/namespaces/{ns}").status == 404,
                   timeout_s=DELETE_WITHIN_S, every_s=1.0,
                   what=f"namespace {ns} deleted with the operator stopped")
    except AssertionError as e:
        left: Any = {p: [(o["metadata"]["name"], o["metadata"].get("finalizers"))
                         for o in kube.get(_path(ns, p)).get("items", [])]
                     for p in ("rolloutfleets", "weightrefits")}
        log = (tmp_path / "operator.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{e}\nstill there, with their finalizers: {left}\n"
                             f"operator log:\n{log}") from None
