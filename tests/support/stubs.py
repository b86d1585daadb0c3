"""Hostile stand-ins for agents: HTTP servers on loopback that answer what a test says.

Each :class:`Stub` listens on one address (any of 127.0.0.0/8: Linux routes all of it to
``lo``, so pods of a test can have distinct loopback IPs and share the agent port),
records every request it gets (path, headers with the bearer token among them, and
body), and answers (once :attr:`Stub.hold` is set, if it has one) with
:attr:`Stub.answer`: ``(status, headers, body)``, or raw bytes that are not HTTP at all.
With :attr:`Stub.trickle_s` set, raw bytes are sent one byte per ``trickle_s`` seconds,
then ``a`` every ``trickle_s`` for as long as the client listens (a slow peer's answer
that never ends, each byte well inside any read timeout).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = tuple[int, dict[str, str], bytes] | bytes


def free_port_on(*hosts: str) -> int:
    """A port free on every one of ``hosts`` (so each can listen on it)."""
    while True:
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = int(s.getsockname()[1])
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port


@dataclass
class Stub:
    host: str
    port: int
    answer: Answer = (404, {}, b"")
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)  # request bodies, in order
    hold: threading.Event | None = None  # when set: answer only once it is set
    trickle_s: float | None = None  # raw answers: one byte per this many seconds, forever
    stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def tokens(self) -> list[str]:
        return [h.get("Authorization", "") for _, h in self.seen]


def _handler(stub: Stub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            stub.seen.append((self.path, dict(self.headers.items())))
            length = int(self.headers.get("Content-Length") or 0)
            stub.bodies.append(self.rfile.read(length) if length else b"")
            if stub.hold is not None:
                stub.hold.wait(60)
            if isinstance(stub.answer, bytes) and stub.trickle_s is not None:
                self._trickle(stub.answer, stub.trickle_s)
                return
            if isinstance(stub.answer, bytes):
                self.wfile.write(stub.answer)
                return
            status, headers, body = stub.answer
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _trickle(self, answer: bytes, pause_s: float) -> None:
            rest = iter(answer)
            while not stub.stopped.is_set():
                try:
                    self.wfile.write(bytes([next(rest, ord("a"))]))
                    self.wfile.flush()
                except OSError:  # the client went away
                    return
                time.sleep(pause_s)

        do_GET = do_POST = _any  # noqa: N815 (http.server's names)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


@contextmanager
def stubs(*hosts: str, port: int | None = None) -> Iterator[list[Stub]]:
    """One started :class:`Stub` per host, all on one port; stopped afterwards."""
    port = port or free_port_on(*hosts)
    made = [Stub(host=h, port=port) for h in hosts]
    servers = [ThreadingHTTPServer((s.host, s.port), _handler(s)) for s in made]
    threads = [threading.Thread(target=srv.serve_forever, daemon=True) for srv in servers]
    for t in threads:
        t.start()
    try:
        yield made
    finally:
        for stub in made:
            stub.stopped.set()
        for srv in servers:
            srv.shutdown()
            srv.server_close()
