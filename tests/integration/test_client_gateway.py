"""The agent's client gateway: clients reach the engine's inference routes and nothing else.

A stand-in engine on loopback serves dev mode's admin routes beside the completions, as
vLLM does with ``VLLM_SERVER_DEV_MODE=1``; the gateway (``dcr agent --client-listen``)
is the only way in for clients. Allowed requests arrive as they were sent (body, query,
headers, streamed answers chunk by chunk); every other route, and every spelling that
tries to reach one through an allowed prefix, is a 404 the engine never sees. Without the
gateway (the vLLM example's engine listening on the pod IP), ``/collective_rpc`` was one
request away for any client the NetworkPolicy admits.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from dcr.http.gateway import make_gateway, parse_routes
from dcr.receiver.settings import CLIENT_ROUTES

pytestmark = pytest.mark.timeout(60)


def engine(seen: list[str]) -> web.Application:
    app = web.Application()

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(f"{request.method} {request.path_qs}")
        body = await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "X-Engine": request.headers.get("X-Client", "")})
        await out.prepare(request)
        for i in range(3):
            await out.write(f"data: {json.dumps({'i': i, 'prompt': body['prompt']})}\n\n"
                            .encode())
            await asyncio.sleep(0.01)
        await out.write_eof()
        return out

    async def anything(request: web.Request) -> web.StreamResponse:
        seen.append(f"{request.method} {request.path_qs}")
        return web.json_response({"path": request.path})

    app.router.add_post("/v1/completions", completions)
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


async def _run(test: Any) -> None:
    seen: list[str] = []
    async with TestServer(engine(seen), host="127.0.0.1") as up:
        gateway = make_gateway(str(up.make_url("")), CLIENT_ROUTES)
        async with TestServer(gateway, host="127.0.0.1") as gw, ClientSession() as http:
            await test(http, str(gw.make_url("")).rstrip("/"), seen)


def run(test: Any) -> None:
    asyncio.run(_run(test))


def test_an_inference_request_and_its_streamed_answer_pass_as_they_are() -> None:
    async def test(http: ClientSession, url: str, seen: list[str]) -> None:
        async with http.post(f"{url}/v1/completions?stream=1", json={"prompt": "hi"},
                             headers={"X-Client": "c1"}) as r:
            assert r.status == 200
            assert r.headers["X-Engine"] == "c1"
            events = [line async for line in r.content if line.startswith(b"data: ")]
        assert [json.loads(e[6:])["i"] for e in events] == [0, 1, 2]
        async with http.get(f"{url}/v1/models") as r:
            assert (r.status, (await r.json())["path"]) == (200, "/v1/models")
        assert seen == ["POST /v1/completions?stream=1", "GET /v1/models"]
    run(test)


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/collective_rpc"), ("POST", "/pause"), ("POST", "/resume"),
    ("POST", "/update_weights"), ("GET", "/is_paused"), ("POST", "/v1/load_lora_adapter"),
    ("GET", "/v1/completions"), ("POST", "/v1/models"),
    ("POST", "/v1/completions/../../collective_rpc"), ("POST", "//collective_rpc"),
    ("POST", "/v1/completions/extra"), ("POST", "/V1/completions"),
])
def test_every_other_route_is_a_404_the_engine_never_sees(method: str, path: str) -> None:
    async def test(http: ClientSession, url: str, seen: list[str]) -> None:
        async with http.request(method, url + path, json={"method": "dcr_load_dense"}) as r:
            assert r.status == 404
            assert (await r.json())["kind"] == "NotServed"
        assert seen == []
    run(test)


def test_an_engine_that_does_not_answer_is_a_502_in_the_gateways_words() -> None:
    async def go() -> None:
        gateway = make_gateway("http://127.0.0.1:9", CLIENT_ROUTES)
        async with (TestServer(gateway, host="127.0.0.1") as gw, ClientSession() as http,
                    http.get(gw.make_url("/health")) as r):
            assert r.status == 502
            assert (await r.json())["kind"] == "EngineUnreachable"
    asyncio.run(go())


@pytest.mark.parametrize("route", ["/v1/completions", "post /v1/x", "POST v1/x",
                                   "POST /v1/x?y=1", "POST /a b"])
def test_a_route_that_is_not_method_and_exact_path_is_refused(route: str) -> None:
    with pytest.raises(ValueError, match="is not 'METHOD /path'"):
        parse_routes([route])
