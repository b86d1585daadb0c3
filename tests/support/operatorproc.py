"""The operator as the chart's Deployment runs it, ``python -m dcr_operator``, as a
subprocess of a test, with short poll intervals; its log and its ``/metrics``; and the
namespace it works in, set up as the chart would (:func:`chart_namespace`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from controlplane import ControlPlane
from k8sutil import REPO, admin_client, apply, eventually, helm_template, install_crds
from promtext import Key, samples

from dcr.refit.launch import free_port


@dataclass
class Operator:
    """``python -m dcr_operator`` as a subprocess (it is what the chart's Deployment runs)."""

    name: str
    namespace: str
    kubeconfig: Path
    log: Path
    priority: int
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = field(default_factory=free_port)

    fleet_status_seconds: float = 2.0
    env: dict[str, str] = field(default_factory=dict)  # more DCR_OPERATOR_* settings

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1",
               "DCR_OPERATOR_JOB_POLL_SECONDS": "0.2", "DCR_OPERATOR_RETRY_SECONDS": "1",
               "DCR_OPERATOR_FLEET_STATUS_SECONDS": str(self.fleet_status_seconds),
               "DCR_OPERATOR_PEERING_LIFETIME_SECONDS": "6",
               "DCR_OPERATOR_METRICS_PORT": str(self.metrics_port), **self.env}
        out: IO[bytes] = open(self.log, "ab")  # noqa: SIM115 (owned by the process)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcr_operator", f"--namespace={self.namespace}",
             "--peering=dcr-operator", f"--priority={self.priority}", "--log-level=INFO"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        out.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> dict[Key, float]:
        """``GET /metrics``, parsed (tests/support/promtext.py)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return samples(r.read().decode())

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def chart_namespace(cp: ControlPlane, helm: Path, ns: str, release: str, tmp: Path) -> Path:
    """Create namespace ``ns`` with what the chart installs for an operator watching it
    (the CRDs, then RBAC, ServiceAccount and peering); the kubeconfig of that
    ServiceAccount's token, as the chart's pod would log in."""
    kube = admin_client(cp)
    kube.create("/api/v1/namespaces", {"metadata": {"name": ns}})
    eventually(lambda: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default"),
               what="the namespace's default ServiceAccount")
    rendered = helm_template(helm, "--include-crds", f"--namespace={ns}",
                             f"--set=watchNamespaces={{{ns}}}", release=release)
    install_crds(kube)
    apply(kube, [o for o in rendered if o["kind"] in (
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "KopfPeering")], ns)
    sa = next(o for o in rendered if o["kind"] == "ServiceAccount")["metadata"]["name"]
    return cp.write_kubeconfig_for_token(cp.service_account_token(ns, sa),
                                         tmp / "operator.kubeconfig", namespace=ns)
