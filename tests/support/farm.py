"""A rollout fleet of N receivers against the real API server and the real operator: the
scale harness of tests/operator/test_scale.py and bench/scale.py.

What the operator meets is what it meets in a cluster, at N:
- N Pod objects in the real API server, Running and Ready, each at its own loopback
  address (127.1.x.y). Nothing runs them: the harness writes their status as a kubelet
  (or kwok, for fake nodes) would, in one pass, since the operator reads only their IPs,
  phase and readiness.
- At each address, a real agent: ``AgentService`` behind the agent's own HTTP app
  (``make_app``), over an in-process engine holding one rank of the small vLLM-layout
  reference model (:mod:`transitions`). All N share this process and one event loop
  (many agents per process, on loopback addresses); their store requests are counted.
- The operator as the chart runs it (:class:`operatorproc.Operator`), under the chart's
  RBAC, and its encoder Jobs run by :class:`kubelet.FakeKubelet` as local processes
  writing to a file store.

:class:`ScaleFleet` sets all of it up in a fresh namespace and runs refits; it measures
what a refit costs: wall time created to Committed, the operator's CPU seconds and peak
memory, API-server requests, status bytes and store requests.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from controlplane import ControlPlane
from k8sutil import admin_client, apply, eventually
from kubelet import FakeKubelet
from operatorproc import Operator, chart_namespace
from promtext import samples
from safetensors.torch import save_file
from stubs import free_port_on
from transitions import Transition

from dcr.protocol.agent_api import AttemptSpec
from dcr.receiver.server import make_app
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import ReferenceModel
from dcr.serve.local import LocalDriver
from dcr.transport.receive import Source, StoreSource
from dcr.transport.store import FileStore

TOKEN = "scale-agent-token-0123456789abcdef"
FLEET = "scale"


def pod_ips(n: int) -> list[str]:
    """N loopback addresses, one per pod (Linux answers on all of 127.0.0.0/8)."""
    return [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(n)]


class CountingStore:
    """A store whose requests are counted by kind (the agents' reads: what S3 bills)."""

    def __init__(self, inner: FileStore) -> None:
        self.inner, self.uri = inner, inner.uri
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def put(self, key: str, data: bytes) -> None:
        self._count("put")
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        self._count("head")
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[str]:
        self._count("list")
        return self.inner.list(prefix)

    def taken(self) -> dict[str, int]:
        """The counts so far, and zero them."""
        with self._lock:
            out = dict(self.counts)
            self.counts.clear()
        return out


@dataclass
class AgentFarm:
    """N agents on one event loop thread, agent ``i`` at ``hosts[i]:port``."""

    transition: Transition
    hosts: list[str]
    store: CountingStore
    tmp: Path
    port: int = 0
    models: list[ReferenceModel] = field(default_factory=list)
    services: list[AgentService] = field(default_factory=list)
    _runners: list[web.AppRunner] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="farm", daemon=True)

    def _source(self, spec: AttemptSpec) -> Source:
        return StoreSource(store=self.store, version=spec.target_version,
                           attempt=spec.attempt, owners=spec.owners)

    def start(self) -> None:
        self.port = self.port or free_port_on(*self.hosts[:50])
        self.thread.start()
        for i, host in enumerate(self.hosts):
            model = ReferenceModel(self.transition.cfg, tp_size=1, tp_rank=0)
            model.load_weights(self.transition.old.items())
            staging = self.tmp / "agents" / str(i)
            service = AgentService(
                f"rollout-{i}", LocalDriver([model], staging_dir=staging,
                                            checkpoint_root=self.tmp),
                self._source, canonical=self.transition.canonical, staging_dir=staging,
                version=0)
            service.attach()
            self.models.append(model)
            self.services.append(service)
            self._runners.append(self._call(self._serve(service, host)))

    async def _serve(self, service: AgentService, host: str) -> web.AppRunner:
        runner = web.AppRunner(make_app(service, TOKEN), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, self.port).start()
        return runner

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def exact(self) -> bool:
        """Every engine holds, bit for bit, a dense load of the transition's new version."""
        return all(self.transition.exact(m, 1, 0) for m in self.models)

    def close(self) -> None:
        for runner in self._runners:
            with contextlib.suppress(Exception):
                self._call(runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _write_checkpoint(sd: dict[str, torch.Tensor], where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in sd.items()}, str(where / "model.safetensors"))
    return where


def _proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, peak resident bytes) of a process, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(stat[11]) + int(stat[12])) / ticks
    hwm = next(int(line.split()[1]) * 1024 for line in
               Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return cpu, hwm


def apiserver_requests(cp: ControlPlane) -> collections.Counter[str]:
    """The API server's request counts so far, by ``verb resource``."""
    text = cp.request("GET", "/metrics").body
    out: collections.Counter[str] = collections.Counter()
    for (name, labels), v in samples(text).items():
        if name == "apiserver_request_total":
            d = dict(labels)
            out[f"{d.get('verb', '')} {d.get('resource', '')}"] += int(v)
    return out


@dataclass
class ScaleFleet:
    """The whole scene at ``n`` receivers, in a fresh namespace; a context manager."""

    cp: ControlPlane
    helm: Path
    n: int
    tmp: Path
    transition: Transition
    fleet_status_seconds: float = 5.0

    def __post_init__(self) -> None:
        self.kube = admin_client(self.cp)
        self.ns = f"scale-{self.n}-{int(time.time())}"
        self.store = CountingStore(FileStore(self.tmp / "store"))
        self.ckpts = {0: _write_checkpoint(self.transition.old, self.tmp / "ckpts" / "v0"),
                      1: _write_checkpoint(self.transition.new, self.tmp / "ckpts" / "v1")}
        self.farm = AgentFarm(self.transition, pod_ips(self.n), self.store, self.tmp)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> ScaleFleet:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        kube, ns = self.kube, self.ns
        kubeconfig = chart_namespace(self.cp, self.helm, ns, "dcr-scale", self.tmp)
        self._stack.callback(self.cp.request, "DELETE", f"/api/v1/namespaces/{ns}")

        self.farm.start()
        self._stack.callback(self.farm.close)
        apply(kube, [{"apiVersion": "v1", "kind": "Secret",
                      "metadata": {"name": "agent-token",
                                   "labels": {"dcr.dev/agent-token": "true"}},
                      "data": {"token": base64.b64encode(TOKEN.encode()).decode()}}], ns)
        for i, host in enumerate(self.farm.hosts):  # what a kubelet would report
            kube.create(f"/api/v1/namespaces/{ns}/pods", {
                "metadata": {"name": f"rollout-{i}", "labels": {"app": "rollout"}},
                "spec": {"containers": [{"name": "agent", "image": "dcr:scale"}]}})
            kube.merge_patch(f"/api/v1/namespaces/{ns}/pods/rollout-{i}/status", {"status": {
                "phase": "Running", "podIP": host, "podIPs": [{"ip": host}],
                "conditions": [{"type": "Ready", "status": "True"}]}})

        self.operator = Operator("scale", ns, kubeconfig, self.tmp / "operator.log",
                                 priority=100, fleet_status_seconds=self.fleet_status_seconds)
        kubelet = FakeKubelet(kube, ns, "dcr.dev/component in (encoder,snapshot)", self.tmp)
        self.kubelet = self._stack.enter_context(kubelet)
        self.operator.start()
        self._stack.callback(self.operator.stop)
        apply(kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
                      "metadata": {"name": FLEET},
                      "spec": {"selector": {"matchLabels": {"app": "rollout"}},
                               "agent": {"port": self.farm.port,
                                         "tokenSecretRef": {"name": "agent-token"}},
                               "store": {"uri": self.store.uri},
                               "initial": {"version": 0,
                                           "checkpoint": str(self.ckpts[0])},
                               "commitPolicy": {"minReceivers": "100%"}}}], ns)
        try:
            eventually(lambda: (self.fleet().get("status") or {}).get("readyReceivers")
                       == self.n, timeout_s=120 + self.n / 5, every_s=1.0,
                       what=f"the fleet's {self.n} receivers ready")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnostics()}") from None

    def diagnostics(self) -> str:
        status = json.dumps(self.fleet().get("status"))[:3000]
        return f"fleet status: {status}\noperator log:\n{self.operator.tail(60)}"

    def fleet(self) -> dict[str, Any]:
        return dict(self.kube.get(f"/apis/dcr.dev/v1alpha1/namespaces/{self.ns}/"
                                  f"rolloutfleets/{FLEET}"))

    def refit_object(self, name: str) -> dict[str, Any]:
        return dict(self.kube.get(f"/apis/dcr.dev/v1alpha1/namespaces/{self.ns}/"
                                  f"weightrefits/{name}"))

    def refit(self, timeout_s: float = 600) -> dict[str, Any]:
        """Refit v0 -> v1 and measure it; the measurements and the WeightRefit."""
        assert self.operator.proc is not None
        pid = self.operator.proc.pid
        self.store.taken()
        cpu0, _ = _proc_usage(pid)
        farm0 = time.process_time()  # this process: the N agents (and the harness)
        requests0 = apiserver_requests(self.cp)
        started = time.monotonic()
        apply(self.kube, [{"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
                           "metadata": {"name": "scale-v1"},
                           "spec": {"fleet": FLEET, "baseVersion": 0, "targetVersion": 1,
                                    "source": {"checkpoint": str(self.ckpts[1])}}}], self.ns)
        polls = 0

        def ended() -> str | None:
            nonlocal polls
            polls += 1
            phase = (self.refit_object("scale-v1").get("status") or {}).get("phase")
            return phase if phase in ("Committed", "Failed") else None

        try:
            phase = eventually(ended, timeout_s=timeout_s, every_s=0.25,
                               what=f"WeightRefit scale-v1 at {self.n} receivers ended")
        except AssertionError as e:
            refit_status = json.dumps(self.refit_object("scale-v1").get("status"))[:3000]
            raise AssertionError(f"{e}\nrefit status: {refit_status}\n"
                                 f"{self.diagnostics()}") from None
        wall = time.monotonic() - started
        cpu1, hwm = _proc_usage(pid)
        farm_cpu = time.process_time() - farm0
        delta = apiserver_requests(self.cp) - requests0
        refit = self.refit_object("scale-v1")
        return {
            "receivers": self.n, "phase": phase, "created_to_end_s": round(wall, 3),
            "stages_s": refit["status"]["attempts"][-1].get("stages", {}),
            "attempts": len(refit["status"]["attempts"]),
            "operator_cpu_s": round(cpu1 - cpu0, 2),
            "operator_peak_rss_mib": round(hwm / 2**20, 1),
            "agents_cpu_s": round(farm_cpu, 2),  # all N agents, one process, shared cores
            # The harness itself GETs the WeightRefit `polls` times; counted, not removed.
            "apiserver_requests": sum(delta.values()), "harness_polls": polls,
            "apiserver_requests_by_verb_resource": dict(sorted(delta.items())),
            "weightrefit_status_bytes": len(json.dumps(refit["status"])),
            "rolloutfleet_status_bytes": len(json.dumps(self.fleet()["status"])),
            "agent_store_requests": self.store.taken(),
            "refit": refit,
        }
