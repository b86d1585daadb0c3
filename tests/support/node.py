"""A real one-node Kubernetes cluster on this machine, for the deploy tier.

:class:`ControlPlane` (tests/k8s) runs the API machinery on loopback, where no Pod ever
runs. :class:`Node` adds what makes Pods real, all as local processes over a private
bridge and a temporary directory:

- **containerd** (the Debian package) with runc, its own root, state and socket under
  the node's directory, and a sandbox ("pause") image built here from a few lines of C;
- a **CNI bridge** (``dcr0``, the containernetworking plugins) whose gateway address is
  the node's and the control plane's address: kube-apiserver listens and advertises
  there, so Pods reach it through the ``kubernetes`` Service;
- **kube-proxy** in iptables mode (the Service's cluster IP to the apiserver),
  **kube-scheduler**, and the **kubelet** (cgroupfs driver, cgroup v1 allowed, no swap
  check, eviction thresholds that ignore a full disk, cluster DNS at the gateway);
- **CoreDNS** (built by ``build.sh node``) on the gateway, the cluster's DNS: its
  ``kubernetes`` plugin answers Services (``kubernetes.default.svc``, which kopf's
  in-cluster login resolves), a headless Service's pods by hostname (a StatefulSet's
  ``<pod>.<service>``) and pod addresses, from the API server; nothing outside
  ``cluster.local``.

Images get onto the node with :meth:`Node.load_image` (``ctr images import`` of an
archive, as a registry-less cluster loads them; Pods then use ``imagePullPolicy:
IfNotPresent`` or ``Never``), or the kubelet pulls them from a registry the node trusts
(:meth:`Node.trust_registry`: containerd's ``hosts.toml`` with the registry's CA).

One node per machine at a time: the bridge, its subnet and kube-proxy's iptables chains
are the host's, so :class:`Node` holds an exclusive lock file while it runs and removes
all of it on stop (``kube-proxy --cleanup``, the bridge, every mount under its directory).
Needs root, and the Debian packages ``containerd runc containernetworking-plugins
iptables`` (``.ci/run`` installs them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from controlplane import (
    BUILD_SCRIPT,
    SERVICE_CLUSTER_IP_RANGE,
    ControlPlane,
    ControlPlaneError,
    _free_port,
    _kill_group,
    build_binaries,
    run_reporting,
)

logger = logging.getLogger(__name__)

BRIDGE = "dcr0"
SUBNET = "10.213.0.0/24"
GATEWAY = "10.213.0.1"
NODE_NAME = "dcr-node"
PAUSE_IMAGE = "localhost/dcr-pause:1"
CNI_BIN = Path("/usr/lib/cni")
LOCK = Path("/run/dcr-deploy-node.lock")
PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables")
_NODE_COMPONENTS = ("kubelet", "kube-scheduler", "kube-proxy", "kubectl", "coredns")
_PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void done(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGTERM, done);
    signal(SIGINT, done);
    for (;;) pause();
}
"""


class NodeError(ControlPlaneError):
    """The node could not be prepared or started; the message says which part and why."""


@dataclass(frozen=True, kw_only=True)
class Images:
    """The project's images as loaded into a node (``make image``)."""

    dcr: str  # operator, agent sidecar, encoder
    serve: str  # the reference serving engine (dcr serve)


@dataclass(frozen=True, kw_only=True)
class NodeBinaries:
    kubelet: Path
    kube_scheduler: Path
    kube_proxy: Path
    kubectl: Path
    coredns: Path


def missing_prerequisites() -> list[str]:
    """What this machine lacks for a node (empty when a node can start)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for tool in ("containerd", "ctr", "runc", "iptables", "gcc", "ip"):
        if shutil.which(tool) is None:
            missing.append(tool)
    if not (CNI_BIN / "bridge").exists():
        missing.append(str(CNI_BIN / "bridge"))
    return missing


def build_node_binaries(progress: Callable[[str], None] | None = None) -> NodeBinaries:
    """kubelet, kube-scheduler, kube-proxy and kubectl from ``build.sh node`` (cached;
    a cold build's steps go to ``progress`` as they run)."""
    status, output = run_reporting(["bash", str(BUILD_SCRIPT), "node"], progress=progress,
                                   name="build.sh node")
    if status != 0:
        raise NodeError(f"{BUILD_SCRIPT} node exited with status {status}:\n{output[-3000:]}")
    found = {parts[1]: Path(parts[3]) for line in output.splitlines()
             if len(parts := line.split()) >= 4 and parts[0] in ("built", "reused")}
    missing = set(_NODE_COMPONENTS) - found.keys()
    if missing:
        raise NodeError(f"{BUILD_SCRIPT} node did not report {sorted(missing)}")
    return NodeBinaries(kubelet=found["kubelet"], kube_scheduler=found["kube-scheduler"],
                        kube_proxy=found["kube-proxy"], kubectl=found["kubectl"],
                        coredns=found["coredns"])


class Node:
    """A control plane on the bridge address and one node whose Pods really run.

    ``with Node() as node:`` gives ``node.cp`` (the :class:`ControlPlane`, admin kubeconfig
    at ``node.cp.kubeconfig``), ``node.kubectl(...)`` and ``node.load_image(archive)``.
    """

    def __init__(self, *, startup_timeout_s: float = 120.0, keep_workdir: bool = False,
                 progress: Callable[[str], None] | None = None) -> None:
        self._progress = progress
        self._startup_timeout_s = startup_timeout_s
        self._keep_workdir = keep_workdir
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._lock: IO[str] | None = None
        self._workdir: Path | None = None
        self.cp: ControlPlane | None = None
        self.binaries: NodeBinaries | None = None

    # -- public surface ---------------------------------------------------------------------

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise NodeError("the node is not started")
        return self._workdir

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        missing = missing_prerequisites()
        if missing:
            raise NodeError(f"a node needs {', '.join(missing)} (Debian packages: "
                            f"{' '.join(PACKAGES)}; root)")
        self._lock = LOCK.open("w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise NodeError(f"another deploy-tier node runs on this machine ({LOCK} is "
                            "locked); one at a time") from None
        self._workdir = Path(tempfile.mkdtemp(prefix="dcr-node-"))
        try:
            self.binaries = build_node_binaries(self._progress)
            _reap_orphans(self._workdir)  # a node killed before its stop() (we hold the lock)
            self._cleanup_network()
            self._make_bridge()
            self.cp = ControlPlane(build_binaries(progress=self._progress), controllers=("*",),
                                   address=GATEWAY,
                                   workdir_prefix="dcr-node-cp-",
                                   startup_timeout_s=self._startup_timeout_s,
                                   keep_workdir=self._keep_workdir,
                                   extra_apiserver_args=self._apiserver_args())
            self.cp.start()
            self._start_dns()
            self._start_containerd()
            self._import_pause_image()
            self._start_scheduler()
            self._start_kubelet()
            self._wait_node_ready()
            # After the Node exists: kube-proxy started before waits 30 s for it, then
            # sees the node's IPs change and exits, leaving only the rules it had synced
            # (no Service created later ever got one).
            self._start_proxy()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every Pod, process and mount, and remove the bridge and iptables chains."""
        kubelet = self._processes.pop("kubelet", None)
        if kubelet is not None:
            _kill_group(kubelet, "kubelet")
        if "containerd" in self._processes:
            self._kill_containers()
        for name in reversed(list(self._processes)):
            _kill_group(self._processes.pop(name), name)
        if self.cp is not None:
            self.cp.stop()
            self.cp = None
        if self._workdir is not None:
            _unmount_under(self._workdir)
            self._cleanup_network()
            if not self._keep_workdir:
                shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """``kubectl --kubeconfig <admin> ARGS``; raises :class:`NodeError` on failure."""
        assert self.binaries is not None
        assert self.cp is not None
        proc = subprocess.run([str(self.binaries.kubectl), "--kubeconfig", str(self.cp.kubeconfig),
                               *args], input=input, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if check and proc.returncode != 0:
            raise NodeError(f"kubectl {' '.join(args)} exited with {proc.returncode}: "
                            f"{proc.stderr.strip()}")
        return proc

    def load_image(self, archive: Path) -> None:
        """Import an image archive (OCI or docker) into the node's containerd."""
        self._ctr("images", "import", "--all-platforms", str(archive), timeout_s=600)

    def kill_container(self, container_id: str) -> None:
        """SIGKILL to every process of one running container (a pod status's
        ``containerID``, ``containerd://<id>``), as an out-of-memory kill or a crash ends
        it; the kubelet then restarts it by the pod's restart policy."""
        runtime, _, cid = container_id.partition("://")
        if runtime != "containerd" or not cid.isalnum():
            raise NodeError(f"container id {container_id!r} is not containerd://<id>")
        self._ctr("tasks", "kill", "--all", "-s", "SIGKILL", cid)

    def trust_registry(self, address: str, ca: Path) -> None:
        """Let containerd pull from the registry at ``address`` (HOST:PORT) over TLS, its
        certificate checked against ``ca`` (read at each pull: no restart)."""
        d = self.workdir / "containerd" / "certs.d" / address
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(ca, d / "ca.crt")
        (d / "hosts.toml").write_text(
            f'server = "https://{address}"\n\n[host."https://{address}"]\n'
            f'  capabilities = ["pull", "resolve"]\n  ca = "{d / "ca.crt"}"\n')

    def pod_logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        args = ["-n", namespace, "logs", pod, "--tail=200"]
        if container:
            args += ["-c", container]
        proc = self.kubectl(*args, check=False)
        return proc.stdout + proc.stderr

    # -- pieces ------------------------------------------------------------------------------

    @staticmethod
    def _apiserver_args() -> list[str]:
        return ["--kubelet-preferred-address-types=InternalIP"]

    def _make_bridge(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")

    def _cleanup_network(self) -> None:
        if self.binaries is not None:
            subprocess.run([str(self.binaries.kube_proxy), "--cleanup"], capture_output=True,
                           check=False, timeout=60)
        _remove_kube_chains()  # what kube-proxy --cleanup leaves: the kubelet's own chains
        with contextlib.suppress(OSError):  # Pods' host-side ends, while the bridge names them
            for veth in Path("/sys/class/net").iterdir():
                master = veth / "master"
                if master.exists() and master.resolve().name == BRIDGE:
                    subprocess.run(["ip", "link", "del", veth.name], capture_output=True,
                                   check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)

    def _start_dns(self) -> None:
        """CoreDNS on the gateway (the kubelet's ``clusterDNS``), serving ``cluster.local``
        from the API server as the admin."""
        assert self.binaries is not None
        corefile = self.workdir / "Corefile"
        corefile.write_text(f"""cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {GATEWAY}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {self._kubeconfig()}
        pods insecure
        ttl 5
    }}
    cache 5
}}
""")
        self._spawn("coredns", [str(self.binaries.coredns), "-conf", str(corefile)])
        self._wait("coredns", lambda: _udp_port_bound(GATEWAY, 53))

    def _start_containerd(self) -> None:
        d = self.workdir / "containerd"
        (d / "cni").mkdir(parents=True)
        (d / "cni" / "10-dcr.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "dcr",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(d / "ipam"),
                          "ranges": [[{"subnet": SUBNET, "gateway": GATEWAY,
                                       "rangeStart": GATEWAY.rsplit(".", 1)[0] + ".10"}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}, indent=1))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (d / "config.toml").write_text(f"""version = 2
root = "{d / 'root'}"
state = "{d / 'state'}"
disabled_plugins = ["io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d / 'runc'}"
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d / 'cni'}"
  [{cri}.registry]
    config_path = "{d / 'certs.d'}"
""")
        self._spawn("containerd", ["containerd", "--config", str(d / "config.toml"),
                                   "--log-level", "warn"])
        self._wait("containerd", lambda: self._ctr("version", check=False).returncode == 0)

    def _ctr(self, *args: str, check: bool = True,
             timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io",
                               *args], capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        if check and proc.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} exited with {proc.returncode}: "
                            f"{proc.stderr.strip()}")
        return proc

    def _import_pause_image(self) -> None:
        """The sandbox image: a static binary that sleeps until signalled, as an OCI
        archive written here (no registry, no builder tool)."""
        d = self.workdir / "pause"
        d.mkdir()
        (d / "pause.c").write_text(_PAUSE_C)
        _run("gcc", "-static", "-Os", "-s", "-o", str(d / "pause"), str(d / "pause.c"))
        archive = write_oci_archive(d, {"pause": d / "pause"}, PAUSE_IMAGE,
                                    entrypoint=["/pause"])
        self.load_image(archive)

    def _kubeconfig(self) -> Path:
        assert self.cp is not None
        return self.cp.kubeconfig

    def _start_scheduler(self) -> None:
        assert self.binaries is not None
        self._spawn("kube-scheduler", [
            str(self.binaries.kube_scheduler), f"--kubeconfig={self._kubeconfig()}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
            "--profiling=false"])

    def _start_proxy(self) -> None:
        assert self.binaries is not None
        config = self.workdir / "kube-proxy.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self._kubeconfig())},
            "mode": "iptables",
            "clusterCIDR": SUBNET,
            "hostnameOverride": NODE_NAME,
            "bindAddress": "127.0.0.1",
            "healthzBindAddress": f"127.0.0.1:{_free_port()}",
            "metricsBindAddress": f"127.0.0.1:{_free_port()}",
            # Pods and the apiserver share one bridge: SNAT every Service connection so
            # replies come back through the host (no br_netfilter needed).
            "iptables": {"masqueradeAll": True},
            "conntrack": {"maxPerCore": 0, "min": 0,
                          "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }))
        self._spawn("kube-proxy", [str(self.binaries.kube_proxy), f"--config={config}"])
        # Ready once the kubernetes Service's cluster IP has its rule (Pods log in through it).
        service_ip = SERVICE_CLUSTER_IP_RANGE.rsplit(".", 1)[0] + ".1"
        self._wait("kube-proxy", lambda: f"-d {service_ip}/32" in subprocess.run(
            ["iptables", "-t", "nat", "-S", "KUBE-SERVICES"], capture_output=True, text=True,
            check=False).stdout)

    def _start_kubelet(self) -> None:
        assert self.binaries is not None
        assert self.cp is not None
        d = self.workdir / "kubelet"
        d.mkdir()
        (d / "resolv.conf").write_text("")  # Pods get cluster DNS only, not the host's
        pki = self.cp.workdir / "pki"
        config = d / "config.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": GATEWAY,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 0,
            "authentication": {"anonymous": {"enabled": False},
                               "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(pki / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "clusterDNS": [GATEWAY],
            "clusterDomain": "cluster.local",
            "resolvConf": str(d / "resolv.conf"),
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            # This machine's disk may be fuller than the defaults allow: never evict for it.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "maxPods": 60,
            "podLogsDir": str(d / "pod-logs"),
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
        }))
        self._spawn("kubelet", [
            str(self.binaries.kubelet), f"--config={config}",
            f"--kubeconfig={self._kubeconfig()}", f"--root-dir={d / 'root'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={GATEWAY}", "--v=1"])

    def _wait_node_ready(self) -> None:
        def ready() -> bool:
            assert self.cp is not None
            got = self.cp.request("GET", f"/api/v1/nodes/{NODE_NAME}")
            if got.status != 200:
                return False
            conditions = got.body.get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        self._wait("kubelet", ready)

    def _kill_containers(self) -> None:
        """Every container and sandbox of the node, killed and deleted (the kubelet is gone)."""
        tasks = self._ctr("tasks", "ls", "-q", check=False).stdout.split()
        for task in tasks:
            self._ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 30
        while tasks and time.monotonic() < deadline:
            for task in tasks:
                self._ctr("tasks", "delete", task, check=False)
            tasks = self._ctr("tasks", "ls", "-q", check=False).stdout.split()
            time.sleep(0.2)
        for container in self._ctr("containers", "ls", "-q", check=False).stdout.split():
            self._ctr("containers", "delete", container, check=False)

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> None:
        logger.info("Starting %s: %s", name, " ".join(args))
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        with self.log_path(name).open("wb") as log:
            self._processes[name] = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=self.workdir, start_new_session=True)

    def _wait(self, name: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        process = self._processes.get(name)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise NodeError(f"{name} exited with status {process.returncode} during "
                                f"startup; its log ends:\n{self._tail(name)}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.3)
        raise NodeError(f"{name} not ready within {self._startup_timeout_s:.0f} s; its log "
                        f"ends:\n{self._tail(name)}")

    def _tail(self, name: str, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"


# -- helpers ------------------------------------------------------------------------------------


def _run(*args: str) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NodeError(f"{' '.join(args)} exited with {proc.returncode}: {proc.stderr.strip()}")


def _reap_orphans(own: Path) -> None:
    """Kill what a node killed before its ``stop()`` left running, undo its mounts and
    remove all it stored but its logs (images, layers and etcd's data: gigabytes a run).

    Called under the lock, so whatever runs from a node's directory (``dcr-node-*``: the
    node's own processes, containerd's shims, the node's control plane, whose workdir is
    ``dcr-node-cp-*``) or serves its bridge address belongs to a node that is gone, and
    every such directory but ``own`` (this node's, just made) is a dead node's.
    Containers go through runc, whose state the node keeps in its directory.
    """
    tmp = tempfile.gettempdir()
    for stale in Path(tmp).glob("dcr-node-*/containerd/runc/k8s.io"):
        listed = subprocess.run(["runc", "--root", str(stale), "list", "-q"],
                                capture_output=True, text=True, check=False).stdout.split()
        for container in listed:
            subprocess.run(["runc", "--root", str(stale), "delete", "--force", container],
                           capture_output=True, check=False)
    marks = (f"{tmp}/dcr-node-", f"--bind-address={GATEWAY}", f"--listen-address={GATEWAY}",
             f"--addr {GATEWAY}:")  # the node's own, its control plane, DNS, the tests' S3
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            line = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        if any(m in line for m in marks):
            with contextlib.suppress(OSError):
                os.kill(int(proc.name), 9)
    _clear_dead_workdirs(Path(tmp), own)


def _clear_dead_workdirs(tmp: Path, own: Path) -> None:
    """Unmount every node directory under ``tmp``; empty all but ``own`` of all but logs.

    Only real directories: a link named like one (anyone may make it in ``/tmp``) is
    neither followed nor unmounted under, and a directory that still has a mount below it
    is left whole rather than emptied into the mounted filesystem."""
    for stale in tmp.glob("dcr-node-*"):
        if stale.is_symlink() or not stale.is_dir():
            continue
        _unmount_under(stale)
        if stale != own and not _mounts_under(stale):
            _remove_all_but_logs(stale)


def _remove_all_but_logs(root: Path) -> None:
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.suffix != ".log":
            with contextlib.suppress(OSError):
                entry.unlink()


def _remove_kube_chains() -> None:
    """Delete every ``KUBE-*`` iptables chain and the rules that jump to them."""
    for table in ("filter", "nat", "mangle"):
        listed = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True,
                                text=True, check=False).stdout.splitlines()
        for rule in listed:
            parts = rule.split()
            if parts[:1] == ["-A"] and not parts[1].startswith("KUBE-") and "-j" in parts \
                    and parts[parts.index("-j") + 1].startswith("KUBE-"):
                subprocess.run(["iptables", "-t", table, "-D", *parts[1:]],
                               capture_output=True, check=False)
        chains = [p.split()[1] for p in listed if p.startswith("-N KUBE-")]
        for flag in ("-F", "-X"):
            for chain in chains:
                subprocess.run(["iptables", "-t", table, flag, chain], capture_output=True,
                               check=False)


def _udp_port_bound(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True  # taken: the server is up
        return False


def _unmount_under(root: Path) -> None:
    """Lazily unmount everything mounted below ``root`` (volumes, overlay rootfs, shm)."""
    for target in sorted(_mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return [m for m in mounts if m.startswith(prefix)]


def write_oci_archive(workdir: Path, files: dict[str, Path], ref: str, *,
                      entrypoint: list[str]) -> Path:
    """A one-layer OCI image archive holding ``files`` (name in the image -> path here),
    tagged ``ref``: what ``ctr images import`` loads. Written with tarfile and hashlib."""
    import gzip
    import hashlib
    import io
    import tarfile

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (layout / "blobs" / "sha256" / digest).write_bytes(data)
        return f"sha256:{digest}", len(data)

    layout = workdir / "oci"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, path in files.items():
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with path.open("rb") as f:
                tar.addfile(info, f)
    diff_id = "sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()
    layer_digest, layer_size = blob(gzip.compress(raw.getvalue(), mtime=0))
    config_digest, config_size = blob(json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode())
    manifest_digest, manifest_size = blob(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest, "size": layer_size}],
    }).encode())
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (layout / "index.json").write_text(json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": manifest_size,
                       "annotations": {"io.containerd.image.name": ref,
                                       "org.opencontainers.image.ref.name": ref}}],
    }))
    archive = workdir / "image.tar"
    with tarfile.open(archive, "w") as tar:
        for path in sorted(layout.rglob("*")):
            tar.add(str(path), arcname=str(path.relative_to(layout)), recursive=False)
    return archive
