"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and kube-controller-manager.

The operator's tests need the genuine API machinery (admission, RBAC, resourceVersions, watches,
garbage collection), not a mock, so this module starts the real binaries built by
``tools/controlplane/build.sh`` as local processes bound to 127.0.0.1 and tears them down again.
There is no scheduler and no kubelet: Pod objects can be created and their status set by hand,
but no container ever runs.

It is a plain module (no pytest inside) so scripts can use it too::

    with ControlPlane(build_binaries()) as cp:
        print(cp.kubeconfig)          # admin kubeconfig (O=system:masters client certificate)
        cp.request("GET", "/api/v1/namespaces")

Certificates come from the ``openssl`` command line (ECDSA P-256 keys: quick to make); every
process logs to a file in the temporary directory, and a startup failure raises
``ControlPlaneError`` whose message ends with the tail of the failing process's log.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "tools" / "controlplane" / "build.sh"

# Controllers a namespaced operator's tests lean on: Jobs and their Pods, ownerReference garbage
# collection, namespace deletion, default ServiceAccounts (Pod admission needs them), Deployments.
DEFAULT_CONTROLLERS: tuple[str, ...] = (
    "job-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "deployment-controller",
    "replicaset-controller",
    "ttl-after-finished-controller",
)

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
_FIRST_SERVICE_IP = "10.0.0.1"
_STOP_GRACE_S = 10.0
_LOG_TAIL_LINES = 40
# Proxy settings from the developer's shell must never route loopback traffic elsewhere.
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached; the message says which part."""


@dataclass(frozen=True, kw_only=True)
class Binaries:
    """Paths of the executables; ``kube_controller_manager`` None runs without controllers."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path | None = None
    helm: Path | None = None


@dataclass(frozen=True, kw_only=True)
class ApiResult:
    """One HTTP exchange with the apiserver: status code and the decoded JSON body (or text)."""

    status: int
    body: Any


_BUILD_LINE = re.compile(r"^(?:built|reused) (?P<component>\S+) (?P<version>\S+) (?P<path>\S+)")


def go_available() -> bool:
    """Whether a Go toolchain is here to build the binaries that are not cached yet."""
    return shutil.which("go") is not None or os.access("/usr/local/go/bin/go", os.X_OK)


_BUILDING = re.compile(r"\bbuilding (?P<what>\S+)")


def run_reporting(argv: Sequence[str], *, progress: Callable[[str], None] | None = None,
                  tick_s: float = 30.0, timeout_s: float | None = None,
                  name: str = "") -> tuple[int, str]:
    """Run a long setup command, passing its stderr lines to ``progress`` while it runs.

    Returns the exit status and everything it printed, stdout and stderr in the order the
    lines arrived (stdout lines are what callers parse; stderr is the command's progress).
    Lines of stdout that start with "built " are passed on too, and while the command is
    silent for ``tick_s`` seconds ``progress`` gets "still <doing what its last stderr line
    said> (<N> s)". ``progress`` runs on the calling thread. The command runs in its own
    process group, killed whole on timeout or interrupt.
    """
    name = name or Path(argv[0]).name
    say = progress or (lambda _line: None)
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()

    def pump(stream: IO[str], kind: str) -> None:
        with contextlib.suppress(ValueError, OSError), stream:  # or closed by _kill_group
            for line in stream:
                lines.put((kind, line.rstrip("\n")))
        lines.put((kind, None))

    assert proc.stdout is not None
    assert proc.stderr is not None
    pumps = [threading.Thread(target=pump, args=(stream, kind), daemon=True)
             for stream, kind in ((proc.stdout, "out"), (proc.stderr, "err"))]
    for t in pumps:
        t.start()
    started = last_said = time.monotonic()
    deadline = None if timeout_s is None else started + timeout_s
    doing, open_streams = f"running {name}", 2
    output: list[str] = []
    try:
        while open_streams:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise subprocess.TimeoutExpired(list(argv), timeout_s or 0.0)
            wait_s = max(0.0, last_said + tick_s - now)
            if deadline is not None:
                wait_s = min(wait_s, max(0.0, deadline - now))
            try:
                kind, line = lines.get(timeout=wait_s)
            except queue.Empty:
                if time.monotonic() - last_said >= tick_s:
                    say(f"{name}: still {doing} ({time.monotonic() - started:.0f} s)")
                    last_said = time.monotonic()
                continue
            if line is None:
                open_streams -= 1
                continue
            output.append(line)
            if kind == "err" or line.startswith("built "):
                say(line if kind == "err" else f"{name}: {line}")
                last_said = time.monotonic()
                if kind == "err" and (m := _BUILDING.search(line)):
                    doing = f"building {m['what']}"
        proc.wait()
    except BaseException:
        _kill_group(proc, name)
        raise
    for t in pumps:
        t.join()
    return proc.returncode, "\n".join(output)


def build_binaries(script: Path = BUILD_SCRIPT, *, timeout_s: float | None = None,
                   progress: Callable[[str], None] | None = None,
                   tick_s: float = 30.0) -> Binaries:
    """Run ``build.sh`` (a no-op of well under 2 s once the cache is warm) and return the paths.

    The script runs in its own process group, so an interrupted first build (tens of minutes)
    does not leave ``go build`` children behind. ``progress`` gets, as they happen, the
    script's stderr lines ("build.sh: building etcd ..."), its "built" lines, and every
    ``tick_s`` seconds a "still building <component> (<N> s)" line.
    """
    returncode, output = run_reporting(["bash", str(script)], progress=progress,
                                       tick_s=tick_s, timeout_s=timeout_s, name="build.sh")
    if returncode != 0:
        raise ControlPlaneError(
            f"{script} exited with status {returncode}:\n{_tail(output.splitlines())}"
        )
    found = {
        m["component"]: Path(m["path"])
        for line in output.splitlines()
        if (m := _BUILD_LINE.match(line))
    }
    missing = {"etcd", "kube-apiserver"} - found.keys()
    if missing:
        raise ControlPlaneError(f"{script} did not report {sorted(missing)}; it printed:\n{output}")
    return Binaries(
        etcd=found["etcd"],
        kube_apiserver=found["kube-apiserver"],
        kube_controller_manager=found.get("kube-controller-manager"),
        helm=found.get("helm"),
    )


def built(*components: str, progress: Callable[[str], None] | None = None) -> dict[str, Path]:
    """``build.sh COMPONENT...`` (cached; minutes the first time): each component's path."""
    code, output = run_reporting(["bash", str(BUILD_SCRIPT), *components], progress=progress,
                                 name=f"build.sh {' '.join(components)}")
    found = {m["component"]: Path(m["path"])
             for line in output.splitlines() if (m := _BUILD_LINE.match(line))}
    if code != 0 or not set(components) <= found.keys():
        raise ControlPlaneError(f"build.sh {' '.join(components)} exited with status {code}:"
                                f"\n{_tail(output.splitlines())}")
    return found


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) on free loopback ports; a context manager.

    Attributes valid after ``start()``: ``server`` (https URL), ``kubeconfig`` (admin kubeconfig
    path), ``ca_path``, ``workdir`` (certificates, data, one ``<process>.log`` per process).
    """

    def __init__(
        self,
        binaries: Binaries,
        *,
        controllers: Sequence[str] | None = DEFAULT_CONTROLLERS,
        startup_timeout_s: float = 60.0,
        keep_workdir: bool = False,
        extra_apiserver_args: Sequence[str] = (),
        address: str = "127.0.0.1",
        workdir_prefix: str = "dcr-controlplane-",
    ) -> None:
        """Configure; nothing starts before ``start()`` / ``with``.

        ``controllers``: kube-controller-manager's ``--controllers``; None or empty (or a
        ``binaries`` without the controller-manager) runs etcd and the apiserver alone.
        ``startup_timeout_s``: limit for each process to become ready, in seconds.
        ``keep_workdir``: leave certificates, data and logs behind after ``stop()``.
        ``extra_apiserver_args``: appended to kube-apiserver's command line (last one wins).
        ``address``: where kube-apiserver listens and what it advertises as the ``kubernetes``
        Service's endpoint. Loopback (the default) is enough for processes on this machine;
        Pods of a real node (tests/deploy) need an address they can route to, such as their
        bridge's gateway, and then the Service gets that endpoint.
        ``workdir_prefix``: the name prefix of its temporary directory.
        """
        self._binaries = binaries
        self._controllers = (
            tuple(controllers)
            if controllers and binaries.kube_controller_manager is not None
            else ()
        )
        self._startup_timeout_s = startup_timeout_s
        self._keep_workdir = keep_workdir
        self._extra_apiserver_args = tuple(extra_apiserver_args)
        self._address = address
        self._workdir_prefix = workdir_prefix
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._workdir: Path | None = None
        self._server: str | None = None
        self._ports: dict[str, int] = {}

    # -- public surface ---------------------------------------------------------------------

    @property
    def binaries(self) -> Binaries:
        return self._binaries

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise ControlPlaneError("the control plane is not started")
        return self._workdir

    @property
    def server(self) -> str:
        if self._server is None:
            raise ControlPlaneError("the control plane is not started")
        return self._server

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def ca_path(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @property
    def admin_cert_path(self) -> Path:
        return self.workdir / "pki" / "admin.crt"

    @property
    def admin_key_path(self) -> Path:
        return self.workdir / "pki" / "admin.key"

    @property
    def address(self) -> str:
        return self._address

    @property
    def has_controller_manager(self) -> bool:
        return bool(self._controllers)

    def log_path(self, process: str) -> Path:
        """The log file of ``etcd``, ``kube-apiserver`` or ``kube-controller-manager``."""
        return self.workdir / f"{process}.log"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._workdir is not None:
            raise ControlPlaneError("the control plane is already started")
        self._workdir = Path(tempfile.mkdtemp(prefix=self._workdir_prefix))
        try:
            _make_pki(self.workdir / "pki", controller_manager=bool(self._controllers),
                      address=self._address)
            self._start_etcd()
            self._start_apiserver()
            self._write_admin_kubeconfig()
            if self._controllers:
                self._start_controller_manager()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every process (newest first, whole process groups) and remove the workdir."""
        for name in reversed(list(self._processes)):
            _kill_group(self._processes.pop(name), name)
        if self._workdir is not None and not self._keep_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None
        self._server = None

    def restart_apiserver(self, while_down: Callable[[], None] | None = None, *,
                          hard: bool = False) -> None:
        """Kill kube-apiserver and start it again on the same port (etcd keeps every
        object); ``while_down`` runs in between. Clients see refused connections and
        dropped watches, as in an API server's rolling restart; with ``hard``, a kill -9
        (no graceful shutdown: requests in flight are cut, as in a crash)."""
        process = self._processes.pop("kube-apiserver")
        if hard:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        _kill_group(process, "kube-apiserver")
        if while_down is not None:
            while_down()
        self._start_apiserver(self._ports["apiserver"])

    def write_kubeconfig_for_token(
        self, token: str, path: Path, *, namespace: str | None = None
    ) -> Path:
        """Write a kubeconfig that authenticates with a bearer token (e.g. a ServiceAccount's)."""
        user = {"token": token}
        _write_kubeconfig(path, self.server, self.ca_path, user, namespace=namespace)
        return path

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        token: str | None = None,
        query: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> ApiResult:
        """One HTTPS call to the apiserver as admin (client certificate) or with ``token``."""
        context = ssl.create_default_context(cafile=str(self.ca_path))
        headers = {"Accept": "application/json"}
        if token is None:
            context.load_cert_chain(self.admin_cert_path, self.admin_key_path)
        else:
            headers["Authorization"] = f"Bearer {token}"
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if query:
            path = f"{path}?{urllib.parse.urlencode(query)}"
        return _https(self._address, self._ports["apiserver"], method, path, payload, headers,
                      context, timeout_s)

    def service_account_token(
        self, namespace: str, name: str, *, expiration_seconds: int = 3600,
        bound_secret: str | None = None,
    ) -> str:
        """A bound token for an existing ServiceAccount, from the TokenRequest API; with
        ``bound_secret``, valid only while that Secret of ``namespace`` exists (deleting it
        revokes the token, as ``kubectl create token --bound-object-kind Secret`` does)."""
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if bound_secret is not None:
            secret = self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{bound_secret}")
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Secret", "name": bound_secret,
                                      "uid": secret.body["metadata"]["uid"]}
        result = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        if result.status != 201:
            raise ControlPlaneError(
                f"TokenRequest for ServiceAccount {namespace}/{name}: HTTP {result.status}: "
                f"{result.body}"
            )
        token: str = result.body["status"]["token"]
        return token

    # -- processes ---------------------------------------------------------------------------

    def _start_etcd(self) -> None:
        client, peer = _free_port(), _free_port()
        self._ports["etcd"] = client
        client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        self._spawn(
            "etcd",
            [
                str(self._binaries.etcd),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--initial-cluster-state=new",
                "--unsafe-no-fsync",  # test data: durability buys nothing, fsync costs seconds
                "--log-level=warn",
            ],
        )
        self._wait_until("etcd", lambda: _http_ok("127.0.0.1", client, "/health", tls=None))

    def _start_apiserver(self, port: int | None = None) -> None:
        port = port or _free_port()
        self._ports["apiserver"] = port
        self._server = f"https://{self._address}:{port}"
        pki = self.workdir / "pki"
        args = [
            str(self._binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{self._ports['etcd']}",
            f"--bind-address={self._address}",
            f"--advertise-address={self._address}",
            f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--allow-privileged=true",
            # kubectl logs/exec through a real kubelet (tests/deploy), which trusts this CA.
            f"--kubelet-client-certificate={pki / 'admin.crt'}",
            f"--kubelet-client-key={pki / 'admin.key'}",
            # The 'kubernetes' Service would get 127.0.0.1 endpoints, which validation refuses.
            "--endpoint-reconciler-type=" + ("none" if self._address == "127.0.0.1" else "lease"),
            "--profiling=false",
        ]
        if not self._controllers:
            # Without the ServiceAccount controller no namespace gets its 'default' account,
            # and the ServiceAccount admission plugin would then refuse every Pod.
            args.append("--disable-admission-plugins=ServiceAccount")
        args.extend(self._extra_apiserver_args)
        self._spawn("kube-apiserver", args)
        context = _client_context(pki)
        self._wait_until("kube-apiserver",
                         lambda: _http_ok(self._address, port, "/readyz", tls=context))

    def _start_controller_manager(self) -> None:
        assert self._binaries.kube_controller_manager is not None
        port = _free_port()
        pki = self.workdir / "pki"
        kubeconfig = self.workdir / "controller-manager.kubeconfig"
        _write_kubeconfig(
            kubeconfig,
            self.server,
            self.ca_path,
            {
                "client-certificate-data": _b64(pki / "controller-manager.crt"),
                "client-key-data": _b64(pki / "controller-manager.key"),
            },
        )
        self._spawn(
            "kube-controller-manager",
            [
                str(self._binaries.kube_controller_manager),
                f"--kubeconfig={kubeconfig}",
                # No --authentication/authorization-kubeconfig: its own endpoints need no
                # delegated auth here (/healthz is always allowed), and without an apiserver
                # front-proxy CA the delegated authenticator only logs errors.
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'controller-manager-certs'}",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                f"--controllers={','.join(self._controllers)}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--profiling=false",
            ],
        )
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # its self-signed serving cert; loopback only
        self._wait_until(
            "kube-controller-manager",
            lambda: _http_ok("127.0.0.1", port, "/healthz", tls=insecure)
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _PROXY_VARIABLES}
        logger.info("Starting %s: %s", name, " ".join(args))
        with self.log_path(name).open("wb") as log:
            self._processes[name] = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,  # its own process group, killed whole on stop()
            )

    def _wait_until(self, name: str, ready: Callable[[], bool]) -> None:
        started = time.monotonic()
        deadline = started + self._startup_timeout_s
        process = self._processes[name]
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with status {process.returncode} during startup; "
                    f"last lines of its log:\n{self._log_tail(name)}"
                )
            if ready():
                logger.info("%s ready after %.1f s", name, time.monotonic() - started)
                return
            time.sleep(0.2)
        raise ControlPlaneError(
            f"{name} not ready within {self._startup_timeout_s:.0f} s; "
            f"last lines of its log:\n{self._log_tail(name)}"
        )

    def _log_tail(self, name: str) -> str:
        try:
            lines = self.log_path(name).read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(log unreadable: {e})"
        return _tail(lines)

    def _write_admin_kubeconfig(self) -> None:
        pki = self.workdir / "pki"
        _write_kubeconfig(
            self.kubeconfig,
            self.server,
            self.ca_path,
            {
                "client-certificate-data": _b64(pki / "admin.crt"),
                "client-key-data": _b64(pki / "admin.key"),
            },
        )


# -- helpers ----------------------------------------------------------------------------------


def _tail(lines: Sequence[str]) -> str:
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _kill_group(process: subprocess.Popen[Any], name: str) -> None:
    """SIGTERM the process group, SIGKILL it after a grace period, and reap the leader."""
    for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, _STOP_GRACE_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) ignored %s", name, process.pid, sig.name)
            continue
        break
    for stream in (process.stdout, process.stderr, process.stdin):
        if stream is not None:
            stream.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _client_context(pki: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    return context


def _https(
    host: str,
    port: int,
    method: str,
    path: str,
    payload: bytes | None,
    headers: Mapping[str, str],
    context: ssl.SSLContext | None,
    timeout_s: float,
) -> ApiResult:
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    else:
        conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=context)
    try:
        conn.request(method, path, body=payload, headers=dict(headers))
        response = conn.getresponse()
        raw = response.read()
        content_type = response.getheader("Content-Type", "")
    finally:
        conn.close()
    body: Any = raw.decode(errors="replace")
    if content_type.startswith("application/json") and raw:
        body = json.loads(raw)
    return ApiResult(status=response.status, body=body)


def _http_ok(host: str, port: int, path: str, *, tls: ssl.SSLContext | None) -> bool:
    try:
        result = _https(host, port, "GET", path, None, {}, tls, timeout_s=5.0)
    except (OSError, http.client.HTTPException):
        return False
    return result.status == 200


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _write_kubeconfig(
    path: Path,
    server: str,
    ca_path: Path,
    user: Mapping[str, str],
    *,
    namespace: str | None = None,
) -> None:
    """Kubeconfig as JSON (valid YAML), credentials embedded so the file stands alone."""
    context: dict[str, str] = {"cluster": "dcr-test", "user": "dcr-test-user"}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "dcr-test",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_path)},
            }
        ],
        "users": [{"name": "dcr-test-user", "user": dict(user)}],
        "contexts": [{"name": "dcr-test", "context": context}],
        "current-context": "dcr-test",
    }
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)


# -- certificates (openssl CLI) -----------------------------------------------------------------

# name -> (subject, extensions); every leaf is signed by the test CA.
_SERVER_SANS = ",".join(
    [
        "IP:127.0.0.1",
        f"IP:{_FIRST_SERVICE_IP}",
        "DNS:localhost",
        "DNS:kubernetes",
        "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ]
)
_LEAVES: dict[str, tuple[str, str]] = {
    "apiserver": (
        "/CN=kube-apiserver",
        f"extendedKeyUsage=serverAuth\nsubjectAltName={_SERVER_SANS}\n",
    ),
    "admin": ("/O=system:masters/CN=dcr-test-admin", "extendedKeyUsage=clientAuth\n"),
    # system:masters too: with --use-service-account-credentials=false every controller acts as
    # the controller-manager itself, and the bootstrap role for that user is not enough.
    "controller-manager": (
        "/O=system:masters/CN=system:kube-controller-manager",
        "extendedKeyUsage=clientAuth\n",
    ),
}
_LEAF_COMMON = (
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
)


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ControlPlaneError("the openssl command is needed to make test certificates")
    result = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ControlPlaneError(
            f"openssl {' '.join(args)} failed with status {result.returncode}: {result.stderr}"
        )


def _ec_key(path: Path) -> None:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-out", path.name, cwd=path.parent,
    )  # fmt: skip


def _make_pki(pki: Path, *, controller_manager: bool, address: str = "127.0.0.1") -> None:
    """A CA, leaf certificates signed by it, and the service-account signing key pair."""
    pki.mkdir(mode=0o700)
    _ec_key(pki / "ca.key")
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-out", "ca.crt", "-days", "7",
        "-subj", "/CN=dcr-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=pki,
    )  # fmt: skip
    for name, (subject, extensions) in _LEAVES.items():
        if name == "controller-manager" and not controller_manager:
            continue
        _ec_key(pki / f"{name}.key")
        _openssl("req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
                 cwd=pki)  # fmt: skip
        if name == "apiserver" and address != "127.0.0.1":
            extensions = extensions.replace("subjectAltName=", f"subjectAltName=IP:{address},")
        (pki / f"{name}.ext").write_text(_LEAF_COMMON + extensions)
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "7", "-extfile", f"{name}.ext",
            cwd=pki,
        )  # fmt: skip
    _ec_key(pki / "sa.key")
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
