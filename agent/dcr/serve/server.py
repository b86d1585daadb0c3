"""The reference server's HTTP API on aiohttp, in vLLM's dialect.

The endpoints, bodies and errors are vLLM's (docs/engines.md, "The reference engine"),
streamed completions included (server-sent events in vLLM's chunk shape), but stricter:
every path but ``/health`` and ``/metrics`` needs the API key, and ``/collective_rpc``
runs only the plugin's methods, one at a time under the model lock. Completions honour the
staleness headers as the client door does (:mod:`dcr.http.admission`; docs/client-door.md,
"Staleness a trainer can bound"), so clients can call it directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr.errors import DcrError, Invalid, TryLater, first_validation_error
from dcr.http.admission import (
    BadVersionHeader,
    Bound,
    StaleVersion,
    admit,
    ended_message,
    label_version,
    span_event,
)
from dcr.http.direct import excerpt
from dcr.http.edge import Statuses, guard, json_error
from dcr.http.prometheus import Family, render
from dcr.serve.completions import DONE, Stream, greedy, parse_completion, response
from dcr.serve.gate import Mode, PauseGate
from dcr.serve.settings import ServeSettings
from dcr.serve.workers import Workers

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no secret
MODES: tuple[Mode, ...] = ("abort", "wait", "keep")
MESSAGE_CHARS = 500  # characters of an error message
# Beside each Refused's own status (ServeRefused, BadCompletion, UnknownMethod 400;
# Unavailable, Paused 503), as vLLM answers: any other DCR error or ValueError is the
# request's (400), a route this runtime lacks is 501.
STATUS = Statuses(rows=((DcrError, 400), (ValueError, 400), (NotImplementedError, 501)))
ERROR_TYPES = {400: "BadRequestError", 501: "NotImplementedError",
               503: "ServiceUnavailableError"}  # vLLM's error "type" by status


class RpcBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    method: Annotated[str, Field(min_length=1, max_length=128)]
    args: list[str] = []
    kwargs: dict[str, str] = {}
    timeout: Annotated[float, Field(gt=0)] | None = None


class VersionBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    new_version: Annotated[str, Field(max_length=256)]


class ServeRefused(Invalid, ValueError):
    """A request the server refuses (400)."""


class Unavailable(TryLater):
    """Not now (503): busy."""


def _error(status: int, message: str, _: str) -> web.Response:
    """An error in vLLM's (OpenAI's) shape; its ``type`` says the status, not the class."""
    kind = ERROR_TYPES.get(status, "InternalServerError")
    return web.json_response({"error": {"message": excerpt(message, MESSAGE_CHARS),
                                        "type": kind, "param": None, "code": status}},
                             status=status)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise ServeRefused(f"{model.__name__}: {first_validation_error(e, 'body')}") from None


class State:
    """What the handlers share: the workers, the gate, the label, the thread pools."""

    def __init__(self, s: ServeSettings, workers: Workers) -> None:
        self.settings = s
        self.workers = workers
        self.gate = PauseGate()
        self.label: str = s.weight_version
        self.keep = False  # the last pause asked for keep: X-DCR-Max-Version-Span applies
        self.running = 0
        self.pools: dict[str, Executor] = {
            "rpc": ThreadPoolExecutor(1, thread_name_prefix="serve-rpc"),
            "pause": ThreadPoolExecutor(2, thread_name_prefix="serve-pause"),
            "generate": ThreadPoolExecutor(s.max_running, thread_name_prefix="serve-gen"),
        }

    def past(self, bound: Bound) -> str | None:
        """Why a completion under ``bound`` must end now: a refit under keep took the label
        past it (under wait and abort no completion spans a refit)."""
        return bound.exceeded(label_version(self.label)) if self.keep else None

    async def run(self, pool: str, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pools[pool], fn, *args)


def make_app(s: ServeSettings, workers: Workers, api_key: str | None) -> web.Application:
    st = State(s, workers)

    async def collective_rpc(request: web.Request) -> web.StreamResponse:
        body: RpcBody = _parse(RpcBody, await request.read())
        job = st.run("rpc", workers.call, body.method, body.args, body.kwargs,
                     body.timeout or 600.0)
        try:
            results = await asyncio.wait_for(job, body.timeout)
        except TimeoutError:
            raise TimeoutError(f"{body.method} did not finish within {body.timeout} s; it "
                               "goes on, and later calls wait for it.") from None
        return web.json_response({"results": [
            r if r is None or isinstance(r, dict | list) else str(r) for r in results]})

    async def pause(request: web.Request) -> web.StreamResponse:
        mode = request.query.get("mode", "abort")
        if mode not in MODES:
            raise ServeRefused(f"pause: mode {mode[:32]!r} is not one of {list(MODES)}.")
        await st.run("pause", st.gate.pause, mode)
        st.keep = mode == "keep"
        log.info("paused (%s)", mode)
        return web.json_response({"status": "paused"})

    async def resume(_: web.Request) -> web.StreamResponse:
        st.gate.resume()
        log.info("resumed")
        return web.json_response({"status": "resumed"})

    async def is_paused(_: web.Request) -> web.StreamResponse:
        return web.json_response({"is_paused": st.gate.paused})

    async def update_weight_version(request: web.Request) -> web.StreamResponse:
        body: VersionBody = _parse(VersionBody, await request.read())
        st.label = body.new_version
        log.info("weight version %s", body.new_version)
        return web.json_response({"success": True, "new_version": body.new_version})

    async def weight_info(_: web.Request) -> web.StreamResponse:
        return web.json_response({"weight_version": st.label})

    async def health(_: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def metrics(_: web.Request) -> web.StreamResponse:
        label = {"model_name": s.model.name}
        text = render([
            Family("vllm:num_requests_running", "gauge", "Completions in flight.",
                   [(label, st.gate.running)]),
            Family("vllm:num_requests_waiting", "gauge", "Completions held by a pause (keep).",
                   [(label, st.gate.waiting)]),
        ])
        return web.Response(text=text, content_type="text/plain")

    async def completions(request: web.Request) -> web.StreamResponse:
        forward = workers.forward
        if forward is None:
            raise NotImplementedError(f"Runtime {s.runtime} has no forward pass; completions "
                                      "need --runtime hf.")
        try:
            bound = admit(request.headers.get, lambda: label_version(st.label), True)
        except (BadVersionHeader, StaleVersion) as e:
            return json_error(e.status, str(e), e.kind)
        body = parse_completion(await request.read(), vocab=workers.vocab,
                                max_input=s.max_input_tokens, max_tokens=s.max_tokens)
        if st.running >= s.max_running:
            raise Unavailable(f"{s.max_running} completions are running; retry later.")
        st.running += 1
        try:
            if body.stream:
                return await _stream(request, st, Stream(body, s.model.name), forward, bound)
            done = await st.run("generate", lambda: greedy(
                forward, body.prompt, body.max_tokens, gate=st.gate, lock=workers.lock,
                label=lambda: st.label, min_step_s=s.min_step_s,
                temperature=body.temperature, seed=body.seed,
                gone=lambda: st.past(bound) is not None))
        finally:
            st.running -= 1
        reason = st.past(bound)
        if reason is not None:
            return json_error(409, ended_message(reason), "VersionSpanExceeded")
        return web.json_response(response(body, done, s.model.name))

    async def shutdown(_: web.Application) -> None:
        st.gate.resume()  # parked completions end instead of holding their threads
        for pool in st.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application(middlewares=[guard(api_key, STATUS, open_paths=OPEN_PATHS,
                                             render=_error)],
                          client_max_size=s.max_body_bytes)
    app.on_cleanup.append(shutdown)
    app.add_routes([
        web.post("/collective_rpc", collective_rpc),
        web.post("/pause", pause),
        web.post("/resume", resume),
        web.get("/is_paused", is_paused),
        web.post("/update_weight_version", update_weight_version),
        web.get("/weight_info", weight_info),
        web.get("/health", health),
        web.get("/metrics", metrics),
        web.post("/v1/completions", completions),
    ])
    return app


async def _stream(request: web.Request, st: State, sse: Stream,
                  forward: Callable[[Any], Any], bound: Bound) -> web.StreamResponse:
    """Server-sent events as the tokens are made. The status and headers wait for the first
    token (or the end), so a completion the gate refuses is the same JSON error as
    unstreamed; a client that leaves ends the completion at its next step, and so does a
    refit that takes the label past ``bound`` (its reason the last event, no ``[DONE]``)."""
    loop = asyncio.get_running_loop()
    tokens: asyncio.Queue[int] = asyncio.Queue()
    left = threading.Event()
    body = sse.body
    job = asyncio.ensure_future(st.run("generate", lambda: greedy(
        forward, body.prompt, body.max_tokens, gate=st.gate, lock=st.workers.lock,
        label=lambda: st.label, min_step_s=st.settings.min_step_s, gone=left.is_set,
        temperature=body.temperature, seed=body.seed,
        on_token=lambda t: loop.call_soon_threadsafe(tokens.put_nowait, t))))
    try:
        first = await _next(tokens, job)
        if first is None:
            await job  # refused before any token: the error answers as JSON
        reason = st.past(bound)
        if reason is not None:
            return json_error(409, ended_message(reason), "VersionSpanExceeded")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "Cache-Control": "no-cache"})
        await out.prepare(request)
        while first is not None:
            reason = st.past(bound)
            if reason is not None:
                await out.write(span_event(reason))
                await out.write_eof()
                return out
            await out.write(sse.token(first))
            first = await _next(tokens, job)
        try:
            await out.write(sse.last(await job))
        except Exception as e:  # the status is sent: the error goes in the stream
            log.exception("streamed completion %s failed", sse.id)
            await out.write(b"data: " + json.dumps({"error": {
                "message": excerpt(f"{type(e).__name__}: {e}", MESSAGE_CHARS),
                "type": "InternalServerError", "param": None, "code": 500}}).encode()
                + b"\n\n")
        await out.write(DONE)
        await out.write_eof()
        return out
    finally:
        left.set()  # a no-op once generation ended; else the client has left


async def _next(tokens: asyncio.Queue[int], job: asyncio.Future[Any]) -> int | None:
    """The next token made, or None once generation has ended and every token was
    taken (a token is queued before its job can end: both come through the loop in
    order)."""
    if tokens.empty() and not job.done():
        get = asyncio.ensure_future(tokens.get())
        await asyncio.wait({get, job}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
    return None if tokens.empty() else tokens.get_nowait()


def new_workers(s: ServeSettings, api_key: str | None = None) -> Workers:
    """The workers of ``s``, loaded, behind one model lock, with its peers (called with
    this server's API key)."""
    from dcr.drivers.vllm import VllmDriver
    from dcr.serve.workers import build_workers

    peers = tuple(VllmDriver(url, api_key) for url in s.peers)
    return Workers(build_workers(s), threading.Lock(), peers)


__all__ = ["make_app", "new_workers"]
