"""The client guard inside ``vllm serve``: clients reach the engine's port directly, and
only the agent, with its token, reaches the admin routes.

vLLM loads it with ``--middleware dcr.http.engine_guard.EngineGuard`` and builds it with no
arguments, so it reads its settings from the environment: ``DCR_ENGINE_TOKEN_FILE`` (the
file holding the engine admin token, which the agent's driver sends as ``Authorization:
Bearer``) and ``DCR_ENGINE_CLIENT_ROUTES`` (comma-separated ``METHOD /path`` entries;
default :data:`~dcr.http.admission.CLIENT_ROUTES`). It keeps the door's rules
(:mod:`dcr.http.admission`, one copy): docs/client-door.md; docs/security.md.

Choices, and why:

- Pure ASGI, no framework: each message passes as it comes (a BaseHTTPMiddleware would
  buffer streams), and it imports with only vLLM's own dependencies.
- A request is matched on its method and its route path as Starlette routes it (the
  decoded ``path`` less ``root_path``), exactly: no trailing-slash, ``//``, HEAD-for-GET or
  percent-encoded variant of a client route is one, so it is a 404 the app never sees.
- The committed version is the label the agent last set through ``POST
  /update_weight_version`` that answered 2xx, observed here: unknown after a restart until
  the agent sets it. The span bound ends an answer only while the agent's last ``POST
  /pause`` asked for ``keep``, as the door applies it under ``--pause-mode keep``.
- The staleness headers and the admin token's ``Authorization`` stop here.
- Its counters (``dcr_guard_*``) are a collector in prometheus_client's default registry,
  which vLLM's ``/metrics`` serves when it runs one API server process.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from dcr.errors import ConfigError
from dcr.http.admission import (
    CLIENT_ROUTES,
    OURS,
    BadVersionHeader,
    Bound,
    ClientCounters,
    StaleVersion,
    admit,
    ended_message,
    label_version,
    not_served,
    parse_routes,
    span_event,
)
from dcr.http.tokens import bearer_matches, read_token

TOKEN_FILE_ENV = "DCR_ENGINE_TOKEN_FILE"  # the engine admin token's file, engine and agent
ROUTES_ENV = "DCR_ENGINE_CLIENT_ROUTES"  # comma-separated METHOD /path entries
MAX_WATCHED_BODY = 64 << 10  # bytes of an observed admin call's body kept for its label
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
_DISCONNECT: Message = {"type": "http.disconnect"}
_AUTH = b"authorization"
OURS_B = frozenset(name.encode() for name in OURS)  # the staleness headers, as ASGI has them


def admin_token() -> str | None:
    """The engine admin token from ``$DCR_ENGINE_TOKEN_FILE``; None when it is unset."""
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    return read_token(f"engine admin token (${TOKEN_FILE_ENV})", Path(path)) if path else None


def _routes_from_env() -> tuple[str, ...]:
    text = os.environ.get(ROUTES_ENV, "").strip()
    return tuple(r.strip() for r in text.split(",") if r.strip()) if text else CLIENT_ROUTES


def route_path(scope: Scope) -> str:
    """The path Starlette routes ``scope`` by (``starlette._utils.get_route_path``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in headers if k.lower() == name), None)


def _without(scope: Scope, names: frozenset[bytes]) -> Scope:
    return {**scope, "headers": [(k, v) for k, v in scope.get("headers", [])
                                 if k.lower() not in names]}


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class _Counted(Collector):
    def __init__(self, counters: ClientCounters) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        return (f.metric() for f in self.counters.families())


# The collector each registry holds (one guard's), held weakly: a registry's id may be
# reused once it is gone, and a new one holds nothing to replace.
_REGISTERED: weakref.WeakKeyDictionary[CollectorRegistry, Collector] = (
    weakref.WeakKeyDictionary())


def _register(registry: CollectorRegistry, collector: Collector) -> None:
    old = _REGISTERED.pop(registry, None)
    if old is not None:  # a guard built again in one process replaces the last one's
        registry.unregister(old)
    registry.register(collector)
    _REGISTERED[registry] = collector


class EngineGuard:
    """An ASGI middleware: client routes pass without a token, under the staleness
    headers' rules; every other request is the door's 404 unless it carries the engine
    admin token. ``token`` and ``routes`` default to the environment's; ``registry``
    (None: none) is where its counters are scraped."""

    def __init__(self, app: App, *, token: str | None = None,
                 routes: Iterable[str] | None = None,
                 registry: CollectorRegistry | None = REGISTRY) -> None:
        self.app = app
        token = token if token is not None else admin_token()
        if token is None:
            raise ConfigError(f"The engine's client guard needs ${TOKEN_FILE_ENV}: the file "
                              "holding the engine admin token the agent sends.")
        self._token = token
        try:
            self.allowed = parse_routes(routes if routes is not None else _routes_from_env())
        except ValueError as e:
            raise ConfigError(f"${ROUTES_ENV}: {e}.") from None
        self.counters = ClientCounters(prefix="dcr_guard")
        self.committed: int | None = None  # unknown until the agent sets the label
        self.keep = False  # the agent's last pause asked for keep
        if registry is not None:
            _register(registry, _Counted(self.counters))

    def __repr__(self) -> str:  # never the token
        return f"EngineGuard(routes={sorted(self.allowed)!r})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if bearer_matches(_header(headers, _AUTH), self._token):
            return await self._admin(_without(scope, OURS_B | {_AUTH}), receive, send)
        if scope["type"] == "websocket":  # no client route is one
            await send({"type": "websocket.close", "code": 1008})
            return None
        method, path = scope["method"], route_path(scope)
        if (method, path) not in self.allowed:
            self.counters.ended("not_served")
            return await _json(send, *not_served(method, path))
        try:
            bound = admit(lambda name: _header(headers, name.lower().encode()),
                          lambda: self.committed, True)  # the span: while keep, below
        except (BadVersionHeader, StaleVersion) as e:
            self.counters.ended(e.outcome)
            return await _json(send, e.status, {"error": str(e), "kind": e.kind})
        await _Answer(self, bound, receive, send).run(_without(scope, OURS_B))
        return None

    async def _admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The agent's call, passed as it is; a label or pause it sets is noted once the
        app answers it 2xx."""
        note = _NOTED.get((scope.get("method", ""), route_path(scope)))
        if note is None:
            return await self.app(scope, receive, send)
        body, status = bytearray(), 0

        async def rx() -> Message:
            m = await receive()
            if m["type"] == "http.request" and len(body) < MAX_WATCHED_BODY:
                body.extend(m.get("body", b""))
            return m

        async def tx(m: Message) -> None:
            nonlocal status
            if m["type"] == "http.response.start":
                status = int(m["status"])
            await send(m)

        await self.app(scope, rx, tx)
        if 200 <= status < 300:
            note(self, bytes(body), scope)
        return None


def _note_label(guard: EngineGuard, body: bytes, _: Scope) -> None:
    try:
        label = json.loads(body).get("new_version")
    except (ValueError, AttributeError):
        label = None
    guard.committed = label_version(label if isinstance(label, str) else None)


def _note_pause(guard: EngineGuard, _: bytes, scope: Scope) -> None:
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
    guard.keep = query.get("mode", ["abort"])[-1] == "keep"  # vLLM's default is abort


_NOTED: dict[tuple[str, str], Callable[[EngineGuard, bytes, Scope], None]] = {
    ("POST", "/update_weight_version"): _note_label,
    ("POST", "/pause"): _note_pause,
}


class _Answer:
    """One client request through the app: its bytes counted, its answer's start held until
    its first body bytes, and the answer ended with its reason once a refit takes the
    committed version past its bound."""

    def __init__(self, guard: EngineGuard, bound: Bound, receive: Receive, send: Send
                 ) -> None:
        self.guard, self.bound, self.receive, self.send = guard, bound, receive, send
        self.count = guard.counters
        self.start: Message | None = None  # held until the first body bytes
        self.started = False
        self.outcome: str | None = None
        self.ended = asyncio.Event()  # set when the guard ended the answer itself

    async def run(self, scope: Scope) -> None:
        self.count.in_flight += 1
        try:
            await self.guard.app(scope, self.rx, self.tx)
        except Exception:
            if self.outcome != "span_exceeded":
                raise
        finally:
            self.count.in_flight -= 1
            self.count.ended(self.outcome or "client_gone")

    async def rx(self) -> Message:
        if self.bound.span is None:
            return self._counted(await self.receive())
        if self.ended.is_set():
            return _DISCONNECT
        get = asyncio.ensure_future(self.receive())
        stop = asyncio.ensure_future(self.ended.wait())
        await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            stop.cancel()
            return self._counted(get.result())
        get.cancel()  # the guard ended the answer: the app sees its client leave
        return _DISCONNECT

    def _counted(self, m: Message) -> Message:
        if m["type"] == "http.request":
            self.count.bytes_in += len(m.get("body", b""))
        return m

    async def tx(self, m: Message) -> None:
        if self.outcome is not None:
            return  # ended by the guard: the app's last words go nowhere
        if m["type"] == "http.response.start":
            self.start = m
            return
        if m["type"] == "http.response.body":
            reason = self.bound.exceeded(self.guard.committed) if self.guard.keep else None
            if reason is not None:
                return await self._end(reason)
            self.count.bytes_out += len(m.get("body", b""))
            if not m.get("more_body", False):
                self.outcome = "forwarded"
        await self._flush()
        await self.send(m)

    async def _flush(self) -> None:
        if not self.started and self.start is not None:
            self.started = True
            await self.send(self.start)

    async def _end(self, reason: str) -> None:
        """End the answer: a 409 before anything was sent; else an error event for a stream
        (no ``[DONE]``), and the app sees its client leave."""
        self.outcome = "span_exceeded"
        self.ended.set()
        if not self.started:
            return await _json(self.send, 409, {"error": ended_message(reason),
                                                "kind": "VersionSpanExceeded"})
        events = (_header((self.start or {}).get("headers", []), b"content-type") or ""
                  ).startswith("text/event-stream")
        await self.send({"type": "http.response.body",
                         "body": span_event(reason) if events else b"", "more_body": False})
        return None


__all__ = ["ROUTES_ENV", "TOKEN_FILE_ENV", "EngineGuard", "admin_token", "route_path"]
