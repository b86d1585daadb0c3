"""The client guard inside the engine (``dcr.http.engine_guard``), driven as uvicorn drives
an ASGI app, in front of a tiny engine that records what reaches it: client routes pass,
everything else is the door's 404 without the engine admin token, and the staleness
headers answer as the door's do (tests/integration/test_client_gateway.py)."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dcr.errors import ConfigError
from dcr.http.admission import CLIENT_ROUTES
from dcr.http.engine_guard import ROUTES_ENV, TOKEN_FILE_ENV, EngineGuard, admin_token
from dcr.http.prometheus import sample

TOKEN = "engine-admin-token-0123456789abcdef"
ADMIN = [(b"authorization", f"Bearer {TOKEN}".encode())]


def sync(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """A test body run on its own event loop."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


@dataclass
class Engine:
    """An ASGI app standing in for vLLM: it records each scope, answers a label update,
    and streams ``/v1/completions`` as events, one chunk per ``step``."""

    seen: list[dict[str, Any]] = field(default_factory=list)
    label_status: int = 200
    step: asyncio.Event = field(default_factory=asyncio.Event)
    left: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.seen.append(dict(scope))
        body = (await receive()).get("body", b"")
        if scope["path"] == "/v1/completions":
            return await self.stream(receive, send)
        status = self.label_status if scope["path"] == "/update_weight_version" else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body or b"ok"})
        return None

    async def stream(self, receive: Any, send: Any) -> None:
        """As Starlette's StreamingResponse streams: the chunks in one task, cancelled when
        a receive says the client left."""
        async def chunks() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for chunk in (b"data: {\"n\": 1}\n\n", b"data: {\"n\": 2}\n\n"):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await self.step.wait()
                self.step.clear()
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.left.set()

        streaming, listening = asyncio.ensure_future(chunks()), asyncio.ensure_future(listen())
        await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        for task in (streaming, listening):
            task.cancel()


@dataclass
class Answer:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    closed: int | None = None  # a websocket's close code
    first: asyncio.Event = field(default_factory=asyncio.Event)  # body bytes arrived

    def json(self) -> Any:
        return json.loads(self.body)


async def call(app: Any, method: str, path: str, *, headers: Sequence[tuple[bytes, bytes]] = (),
               body: bytes = b"", root_path: str = "", raw_path: bytes | None = None,
               kind: str = "http", query: bytes = b"", answer: Answer | None = None) -> Answer:
    """One request as uvicorn hands it to the app (``path`` decoded; ``raw_path`` as sent)."""
    out = answer or Answer()
    done = asyncio.Event()
    sent = [False]

    async def receive() -> dict[str, Any]:
        if kind == "websocket":
            return {"type": "websocket.connect"}
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(m: dict[str, Any]) -> None:
        if m["type"] == "http.response.start":
            out.status, out.headers = m["status"], list(m.get("headers", []))
        elif m["type"] == "http.response.body":
            out.body += m.get("body", b"")
            out.first.set()
            if not m.get("more_body", False):
                done.set()
        elif m["type"] == "websocket.close":
            out.closed = m["code"]

    scope = {"type": kind, "method": method, "path": path, "root_path": root_path,
             "raw_path": raw_path if raw_path is not None else path.encode(),
             "query_string": query, "headers": list(headers)}
    await app(scope, receive, send)
    done.set()
    return out


def guarded(engine: Engine, registry: CollectorRegistry | None = None) -> EngineGuard:
    return EngineGuard(engine, token=TOKEN, routes=CLIENT_ROUTES, registry=registry)


async def never_reaches_the_engine(method: str, path: str, **request: Any) -> None:
    """The request is the door's 404, and the engine never sees it."""
    engine = Engine()
    answer = await call(guarded(engine), method, path, **request)
    assert (answer.status, answer.json()["kind"]) == (404, "NotServed")
    assert engine.seen == []


async def label(guard: EngineGuard, version: str, *, mode: str = "keep") -> Answer:
    await call(guard, "POST", "/pause", headers=ADMIN, query=f"mode={mode}".encode())
    return await call(guard, "POST", "/update_weight_version", headers=ADMIN,
                      body=json.dumps({"new_version": version}).encode())


@sync
async def test_client_routes_pass_without_a_token_and_the_admin_routes_do_not() -> None:
    engine = Engine()
    guard = guarded(engine)
    assert (await call(guard, "GET", "/health")).status == 200
    assert (await call(guard, "GET", "/v1/models")).status == 200
    for method, path in [("POST", "/collective_rpc"), ("POST", "/pause"),
                         ("POST", "/update_weight_version"), ("GET", "/weight_info")]:
        answer = await call(guard, method, path)
        assert (answer.status, answer.json()) == (404, {
            "error": f"{method} {path} is not served to clients here", "kind": "NotServed"})
    assert [s["path"] for s in engine.seen] == ["/health", "/v1/models"]


@pytest.mark.parametrize(("method", "path", "root"), [
    ("POST", "/v1/completions/", ""), ("POST", "//v1/completions", ""),
    ("HEAD", "/health", ""), ("OPTIONS", "/v1/completions", ""),
    ("GET", "/v1/completions", ""), ("POST", "/V1/completions", ""),
    ("POST", "/collective_rpc/", ""), ("GET", "/metrics/", ""),
    ("POST", "/api/collective_rpc", "/api"), ("GET", "/apihealth", "/api"),
])
@sync
async def test_only_the_exact_route_the_app_would_route_passes(method: str, path: str,
                                                               root: str) -> None:
    await never_reaches_the_engine(method, path, root_path=root)


@sync
async def test_the_guard_matches_the_decoded_path_as_the_app_routes_it_not_raw_path() -> None:
    engine = Engine()
    guard = guarded(engine)
    # an encoded slash decodes to a client route, which is where the app routes it
    assert (await call(guard, "GET", "/v1/models", raw_path=b"/v1%2Fmodels")).status == 200
    # a raw path that names a client route does not open the admin route it decodes to
    answer = await call(guard, "POST", "/collective_rpc", raw_path=b"/v1/completions")
    assert answer.status == 404
    # under a root path, the route is what follows it
    assert (await call(guard, "GET", "/api/health", root_path="/api")).status == 200
    assert [s["path"] for s in engine.seen] == ["/v1/models", "/api/health"]


@pytest.mark.parametrize("auth", [f"Bearer {TOKEN}x", f"bearer {TOKEN}", f"Bearer  {TOKEN}",
                                  TOKEN, f"Bearer {TOKEN[:-1]}", "Bearer \xe9" + TOKEN])
@sync
async def test_a_wrong_token_reaches_no_admin_route(auth: str) -> None:
    await never_reaches_the_engine("POST", "/collective_rpc",
                                   headers=[(b"authorization", auth.encode("latin-1"))])


@sync
async def test_the_agent_reaches_the_admin_routes_and_its_token_stops_at_the_guard() -> None:
    engine = Engine()
    guard = guarded(engine)
    answer = await call(guard, "POST", "/collective_rpc", body=b"{}",
                        headers=[*ADMIN, (b"x-dcr-min-version", b"9")])
    assert answer.status == 200
    assert engine.seen[0]["headers"] == []  # neither the token nor a DCR header
    # a websocket needs the token too: no client route is one
    closed = await call(guard, "GET", "/v1/realtime", kind="websocket")
    assert closed.closed == 1008
    assert len(engine.seen) == 1


@sync
async def test_min_version_is_refused_until_the_agent_commits_it() -> None:
    engine = Engine()
    guard = guarded(engine)
    want = [(b"x-dcr-min-version", b"3")]
    answer = await call(guard, "GET", "/v1/models", headers=want)
    assert (answer.status, answer.json()["kind"]) == (409, "StaleVersion")
    assert "committed version is unknown; the request accepts 3 or newer" in \
        answer.json()["error"]
    engine.label_status = 500  # a label the engine refused is not committed
    await label(guard, "3")
    assert (await call(guard, "GET", "/v1/models", headers=want)).status == 409
    engine.label_status = 200
    await label(guard, "2")
    answer = await call(guard, "GET", "/v1/models", headers=want)
    assert (answer.status, answer.json()["kind"]) == (409, "StaleVersion")
    assert "committed version is 2; the request accepts 3 or newer" in answer.json()["error"]
    await label(guard, "3")
    assert (await call(guard, "GET", "/v1/models", headers=want)).status == 200
    assert engine.seen[-1]["headers"] == []  # the header stops at the guard
    bad = await call(guard, "GET", "/v1/models", headers=[(b"x-dcr-max-version-span", b"-1")])
    assert (bad.status, bad.json()["kind"]) == (400, "BadRequest")


async def across_a_refit(mode: str, body: bytes) -> tuple[Engine, CollectorRegistry, Answer]:
    """A stream bounded by X-DCR-Max-Version-Span: 0 through a guard, frozen after its first
    chunk while the agent pauses in ``mode`` and moves the label from 1 to 2, then let go
    to its end (or the guard's)."""
    engine, registry = Engine(), CollectorRegistry()
    guard = guarded(engine, registry)
    await label(guard, "1", mode=mode)
    answer = Answer()
    flight = asyncio.ensure_future(call(
        guard, "POST", "/v1/completions", answer=answer, body=body,
        headers=[(b"x-dcr-max-version-span", b"0")]))
    await answer.first.wait()
    await label(guard, "2", mode=mode)  # a refit while the stream is frozen
    while not flight.done():  # every chunk, to the end
        engine.step.set()
        await asyncio.sleep(0.01)
    await call(guard, "POST", "/collective_rpc")  # one not served, for the counters
    return engine, registry, answer


@sync
async def test_a_stream_a_refit_takes_past_its_span_ends_with_the_reason() -> None:
    engine, registry, answer = await across_a_refit("keep", b"{}")
    events = answer.body.decode().split("\n\n")
    assert events[0] == 'data: {"n": 1}'
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("VersionSpanExceeded", 409)
    assert "from 1 to 2, more than the 0 versions" in error["message"]
    assert "[DONE]" not in answer.body.decode()
    await asyncio.wait_for(engine.left.wait(), 10)  # the engine saw its client leave
    text = generate_latest(registry).decode()
    assert sample(text, "dcr_guard_requests_total", outcome="span_exceeded") == 1
    assert sample(text, "dcr_guard_requests_in_flight") == 0


@sync
async def test_a_span_under_wait_is_not_bounded_and_the_counters_count() -> None:
    _, registry, answer = await across_a_refit("wait", b'{"p": 1}')
    assert answer.body.endswith(b"data: [DONE]\n\n")
    text = generate_latest(registry).decode()
    assert sample(text, "dcr_guard_requests_total", outcome="forwarded") == 1
    assert sample(text, "dcr_guard_requests_total", outcome="not_served") == 1
    assert sample(text, "dcr_guard_errors_total") == 1
    assert sample(text, "dcr_guard_bytes_total", direction="in") == len(b'{"p": 1}')
    assert sample(text, "dcr_guard_bytes_total", direction="out") == len(answer.body)


def test_the_token_comes_from_its_file_and_a_guard_without_one_refuses_to_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    assert admin_token() is None
    with pytest.raises(ConfigError, match=TOKEN_FILE_ENV):
        EngineGuard(Engine(), registry=None)
    (tmp_path / "token").write_text("short")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    with pytest.raises(ConfigError, match="5 characters") as e:
        EngineGuard(Engine(), registry=None)
    assert "short" not in str(e.value)
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv(ROUTES_ENV, "POST /v1/completions, GET health")
    with pytest.raises(ConfigError, match="'GET health'"):
        EngineGuard(Engine(), registry=None)
    monkeypatch.setenv(ROUTES_ENV, "POST /v1/completions")
    guard = EngineGuard(Engine(), registry=None)
    assert guard.allowed == {("POST", "/v1/completions")}
    assert TOKEN not in repr(guard)


def test_a_guard_on_a_new_registry_never_replaces_a_collector_a_gone_one_held() -> None:
    """A registry's id is reused once it is garbage: a guard built on the new one registers
    its counters there, and does not try to take a gone registry's collector out of it."""
    for _ in range(20):
        registry = CollectorRegistry()
        guarded(Engine(), registry)
        assert sample(generate_latest(registry).decode(), "dcr_guard_requests_in_flight") == 0
        del registry
        gc.collect()
