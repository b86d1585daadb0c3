"""The clients' door to the engine: its inference routes, and nothing else.

An engine in dev mode (vLLM's ``VLLM_SERVER_DEV_MODE=1``, which the refit needs) serves
``/collective_rpc``, ``/pause`` and its weight routes beside the completions, on the same
port, none guarded by its API key: a client that reaches that port can change the weights
without the agent knowing. So the engine listens on loopback and the agent's
``--client-listen`` serves the pod's clients: each request whose method and path are an
exact entry of the route list is forwarded to the engine as it came (body and answer
streamed, so server-sent events pass as they are produced); any other is a 404 that
never reaches the engine. docs/engines.md, "Deploying"; docs/security.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable

from aiohttp import ClientError, ClientSession, ClientTimeout, web

log = logging.getLogger(__name__)

# Per-connection headers (RFC 9110, 7.6.1) are the hop's own; Host names the engine.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
_CHUNK = 64 << 10


def parse_routes(routes: Iterable[str]) -> frozenset[tuple[str, str]]:
    """``"METHOD /path"`` entries as (method, path) pairs; ValueError naming a bad one."""
    out = set()
    for route in routes:
        method, _, path = route.partition(" ")
        if not method.isalpha() or not method.isupper() or not path.startswith("/") or (
                " " in path or "?" in path or "#" in path):
            raise ValueError(f"client route {route!r} is not 'METHOD /path' (an exact path)")
        out.add((method, path))
    return frozenset(out)


def make_gateway(upstream: str, routes: Iterable[str], *,
                 timeout_s: float = 3600.0) -> web.Application:
    """An app forwarding exactly ``routes`` to ``upstream`` (the engine's loopback URL)."""
    allowed = parse_routes(routes)
    base = upstream.rstrip("/")
    app = web.Application(client_max_size=0)  # bodies stream through; the engine bounds them

    sessions: list[ClientSession] = []  # one, made on the server's event loop

    async def session(_: web.Application) -> AsyncIterator[None]:
        sessions.append(ClientSession(timeout=ClientTimeout(total=timeout_s),
                                      auto_decompress=False))
        yield
        await sessions.pop().close()

    async def forward(request: web.Request) -> web.StreamResponse:
        if (request.method, request.path) not in allowed:
            return web.json_response({"error": f"{request.method} {request.path} is not "
                                      "served to clients here", "kind": "NotServed"},
                                     status=404)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        query = f"?{request.query_string}" if request.query_string else ""
        try:  # the path matched, as decoded: that is what the engine is asked for
            up = await sessions[0].request(
                request.method, base + request.path + query, headers=headers,
                allow_redirects=False, data=request.content if request.body_exists else None)
        except (ClientError, OSError) as e:
            log.warning("client gateway: %s %s: the engine did not answer: %s",
                        request.method, request.path, e)
            return web.json_response({"error": "the engine did not answer",
                                      "kind": "EngineUnreachable"}, status=502)
        async with up:
            out = web.StreamResponse(status=up.status, reason=up.reason, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP})
            await out.prepare(request)
            async for chunk in up.content.iter_chunked(_CHUNK):
                await out.write(chunk)
            await out.write_eof()
            return out

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


__all__ = ["make_gateway", "parse_routes"]
