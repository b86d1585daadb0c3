"""The clients' door to the engine: its inference routes, and nothing else.

An engine in dev mode (vLLM's ``VLLM_SERVER_DEV_MODE=1``, which the refit needs) serves
``/collective_rpc``, ``/pause`` and its weight routes beside the completions, on the same
port, none guarded by its API key: a client that reaches that port can change the weights
without the agent knowing. So the engine listens on loopback and the agent's
``--client-listen`` serves the pod's clients: each request whose method and path are an
exact entry of the route list is forwarded to the engine as it came; any other is a 404
that never reaches the engine. For vLLM, the client guard inside the engine
(:mod:`dcr.http.engine_guard`) does the same without a hop; the door stays for engines
without a middleware hook (SGLang). Both keep the rules of :mod:`dcr.http.admission`.
docs/client-door.md; docs/security.md.

Choices, and why:

- No cap of its own: the connector to the engine allows ``max_connections`` (a setting,
  default far above what an engine batches), so every request a client sends reaches the
  engine's scheduler at once; queueing is the engine's business.
- Bodies and answers stream: each chunk the engine writes is written to the client as it
  is read (server-sent events pass token by token); a small body with a Content-Length is
  read whole and sent with its length, which the engine parses fastest.
- Per-connection headers (RFC 9110, 7.6.1) are the hop's own, in both directions: the
  fixed list and every name the Connection header lists. Framing is aiohttp's: its parser
  refuses a request with both Content-Length and Transfer-Encoding, and the door sets
  the engine-side framing itself, so what the engine parses is what the door parsed.
- Staleness (docs/client-door.md, "Staleness a trainer can bound"): ``X-DCR-Min-Version: N``
  is answered at once with a 409 when the committed version is older;
  ``X-DCR-Max-Version-Span: K`` ends a request, with its reason, at the first chunk read
  after a refit under ``keep`` took the committed version more than K past the version
  it started on, so its answer is never silently mixed beyond the bound.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, TCPConnector, web
from multidict import CIMultiDict, CIMultiDictProxy

from dcr.http.admission import (
    MAX_SPAN,
    MIN_VERSION,
    OURS,
    OUTCOMES,
    BadVersionHeader,
    Bound,
    ClientCounters,
    StaleVersion,
    Version,
    admit,
    ended_message,
    not_served,
    parse_routes,
    span_event,
)
from dcr.http.edge import json_error

log = logging.getLogger(__name__)

# Per-connection headers (RFC 9110, 7.6.1, and Proxy-Connection, which clients still send);
# Host names the engine; the framing headers are set anew on each hop.
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                  "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade",
                  "host", "content-length"})
SMALL_BODY = 1 << 20  # a body up to this many bytes with a Content-Length is read whole
DoorCounters = ClientCounters  # the door's series are dcr_door_* (ClientCounters' default)


def end_to_end(headers: Mapping[str, str], *, drop: frozenset[str] = frozenset()
               ) -> CIMultiDict[str]:
    """``headers`` without the per-connection ones: the fixed list, every name the
    Connection headers list (all of them, comma-separated), and ``drop``."""
    listed = {name.strip().lower() for key, value in headers.items()
              if key.lower() in ("connection", "proxy-connection") for name in value.split(",")}
    gone = _HOP | listed | drop
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in gone)


def make_gateway(upstream: str, routes: Iterable[str], *, timeout_s: float = 3600.0,
                 max_connections: int = 4096, version: Version | None = None,
                 keep: bool = False, counters: DoorCounters | None = None
                 ) -> web.Application:
    """An app forwarding exactly ``routes`` to ``upstream`` (the engine's loopback URL).

    ``max_connections``: connections to the engine at once (0: no bound); ``version``:
    the engine's committed version (None: staleness headers see it unknown); ``keep``:
    the agent pauses with ``keep``, so X-DCR-Max-Version-Span applies; ``counters``: where
    the door counts (the agent's ``/metrics``).
    """
    allowed = parse_routes(routes)
    base = upstream.rstrip("/")
    count = counters if counters is not None else DoorCounters()
    app = web.Application(client_max_size=0)  # bodies stream through; the engine bounds them
    sessions: list[ClientSession] = []  # one, made on the server's event loop

    async def session(_: web.Application) -> AsyncIterator[None]:
        sessions.append(ClientSession(
            connector=TCPConnector(limit=max_connections, limit_per_host=0),
            timeout=ClientTimeout(total=timeout_s), auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding")))
        yield
        await sessions.pop().close()

    async def body(request: web.Request) -> Any:
        if not request.body_exists:
            return None
        if request.content_length is not None and request.content_length <= SMALL_BODY:
            data = await request.read()
            count.bytes_in += len(data)
            return data
        return _counted(request, count)

    async def forward(request: web.Request) -> web.StreamResponse:
        if (request.method, request.path) not in allowed:
            count.ended("not_served")
            status, answer = not_served(request.method, request.path)
            return web.json_response(answer, status=status)
        try:
            bound = admit(request.headers.get, version, keep)
        except (BadVersionHeader, StaleVersion) as e:
            count.ended(e.outcome)
            return json_error(e.status, str(e), e.kind)
        query = f"?{request.query_string}" if request.query_string else ""
        count.in_flight += 1
        try:
            try:  # the path matched, as decoded: that is what the engine is asked for
                up = await sessions[0].request(
                    request.method, base + request.path + query,
                    headers=end_to_end(request.headers, drop=OURS), allow_redirects=False,
                    data=await body(request))
            except (ClientError, OSError) as e:
                log.warning("client door: %s %s: the engine did not answer: %s",
                            request.method, request.path, e)
                count.ended("unreachable")
                return json_error(502, "the engine did not answer", "EngineUnreachable")
            async with up:
                return await _relay(request, up, bound, version, count)
        finally:
            count.in_flight -= 1

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def _counted(request: web.Request, count: DoorCounters) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_any():
        count.bytes_in += len(chunk)
        yield chunk


def _answer_headers(up: ClientResponse) -> CIMultiDict[str]:
    headers = end_to_end(up.headers)
    length = up.headers.get("Content-Length")
    if length is not None and "Transfer-Encoding" not in up.headers:
        headers["Content-Length"] = length  # the bytes pass as they are (no decompression)
    return headers


async def _relay(request: web.Request, up: ClientResponse, bound: Bound,
                 version: Version | None, count: DoorCounters) -> web.StreamResponse:
    """The engine's answer to the client, chunk by chunk; ended with its reason when a
    refit takes the version past the request's bound."""
    def exceeded() -> str | None:
        return bound.exceeded(version()) if version is not None else None

    reason = exceeded()
    if reason is not None:  # nothing sent yet: a plain 409
        count.ended("span_exceeded")
        up.close()
        return json_error(409, ended_message(reason), "VersionSpanExceeded")
    out = web.StreamResponse(status=up.status, reason=up.reason, headers=_answer_headers(up))
    try:
        await out.prepare(request)
        async for chunk in up.content.iter_any():
            reason = exceeded()
            if reason is not None:
                await _end_stream(out, up, reason, _is_events(up.headers))
                count.ended("span_exceeded")
                return out
            count.bytes_out += len(chunk)
            await out.write(chunk)
        await out.write_eof()
    except (ConnectionResetError, ClientError) as e:  # the client, or the engine, left
        log.debug("client door: %s %s ended early: %s", request.method, request.path, e)
        count.ended("client_gone")
        return out
    count.ended("forwarded")
    return out


def _is_events(headers: CIMultiDictProxy[str]) -> bool:
    return headers.get("Content-Type", "").startswith("text/event-stream")


async def _end_stream(out: web.StreamResponse, up: ClientResponse, reason: str,
                      events: bool) -> None:
    """End an answer already under way: an error event with the reason (server-sent
    events; no ``[DONE]``), the engine's request dropped, the connection closed."""
    up.close()  # the engine sees its client leave and aborts the request
    if events:
        await out.write(span_event(reason))
    out.force_close()
    await out.write_eof()


__all__ = ["MAX_SPAN", "MIN_VERSION", "OUTCOMES", "BadVersionHeader", "DoorCounters",
           "StaleVersion", "Version", "end_to_end", "make_gateway", "parse_routes"]
