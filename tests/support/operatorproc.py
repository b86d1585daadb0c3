"""The operator as the chart's Deployment runs it, ``python -m dcr_operator``, as a
subprocess of a test, with short poll intervals; its log and its ``/metrics``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from k8sutil import REPO
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
