"""Toxiproxy on loopback: TCP proxies whose faults a test or the fault campaign sets.

Toxiproxy (Shopify, a Go module built by ``tools/controlplane/build.sh toxiproxy``) sits
between a party and the S3 server: one proxy per link. Its toxics cover the store's TCP
faults: ``latency``, ``bandwidth`` (a drop of the link's rate), ``reset_peer``, ``timeout``
(a request that hangs), ``limit_data`` (a body cut short), ``slicer``; disabling a proxy
partitions its link (every connection closed, new ones refused).

The client here speaks Toxiproxy's REST API (``/proxies``, ``/proxies/NAME/toxics``) with
urllib: PyPI's ``toxiproxy-python`` has had no release since 2019, and the API is small.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane import built
from s3server import stop_process
from stubs import free_port_on

TOXICS = ("latency", "bandwidth", "reset_peer", "timeout", "limit_data", "slicer")


def toxiproxy_binary(progress: Callable[[str], None] | None = None) -> Path:
    """toxiproxy-server from ``build.sh toxiproxy`` (cached; seconds to a minute cold)."""
    return built("toxiproxy", progress=progress)["toxiproxy"]


class ToxiproxyError(RuntimeError):
    """The Toxiproxy API refused a call: the message carries its answer."""


@dataclass(frozen=True)
class Toxiproxy:
    """A running toxiproxy-server's API at ``api`` (http://HOST:PORT)."""

    api: str

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.api + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ToxiproxyError(f"toxiproxy {method} {path}: {e.code} "
                                 f"{e.read().decode(errors='replace')[:300]}") from e
        return json.loads(raw) if raw.strip() else None

    def proxy(self, name: str, upstream: str, listen: str = "127.0.0.1:0") -> str:
        """Create proxy ``name`` to ``upstream`` (HOST:PORT); return where it listens."""
        answer = self._call("POST", "/proxies", {"name": name, "listen": listen,
                                                 "upstream": upstream, "enabled": True})
        return str(answer["listen"])

    def toxic(self, proxy: str, kind: str, attributes: dict[str, int], *,
              stream: str = "downstream", name: str | None = None,
              toxicity: float = 1.0) -> str:
        """Add a toxic of ``kind`` to ``proxy``; return its name (to remove it)."""
        if kind not in TOXICS:
            raise ValueError(f"Unknown toxic {kind!r}; known: {', '.join(TOXICS)}.")
        toxic = name or f"{kind}-{stream}-{time.monotonic_ns()}"
        self._call("POST", f"/proxies/{proxy}/toxics", {
            "name": toxic, "type": kind, "stream": stream, "toxicity": toxicity,
            "attributes": attributes})
        return toxic

    def remove(self, proxy: str, toxic: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{toxic}")

    def enable(self, proxy: str, enabled: bool) -> None:
        """Enabled False: a partition (connections closed, new ones refused)."""
        self._call("POST", f"/proxies/{proxy}", {"enabled": enabled})

    def reset(self) -> None:
        """Every proxy enabled, every toxic removed."""
        self._call("POST", "/reset")


@contextlib.contextmanager
def toxiproxy_server(workdir: Path, seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> Iterator[Toxiproxy]:
    """A toxiproxy-server on loopback (``seed``: its toxics' own randomness, jitter and
    toxicity, so a campaign's seed fixes them too); stopped on exit."""
    binary = toxiproxy_binary(progress)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port_on("127.0.0.1")
    with open(workdir / "toxiproxy.log", "ab") as log:
        proc = subprocess.Popen([str(binary), "-host", "127.0.0.1", "-port", str(port),
                                 "-seed", str(seed)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    server = Toxiproxy(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(server.api + "/version", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("toxiproxy-server did not start: see "
                                       f"{workdir / 'toxiproxy.log'}") from None
                time.sleep(0.05)
        yield server
    finally:
        stop_process(proc)
