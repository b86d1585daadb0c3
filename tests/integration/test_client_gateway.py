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
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import ClientSession, TCPConnector, web
from aiohttp.test_utils import BaseTestServer, TestServer

from dcr.http.admission import CLIENT_ROUTES
from dcr.http.gateway import MAX_SPAN, MIN_VERSION, DoorCounters, make_gateway, parse_routes
from dcr.http.prometheus import render, sample

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
        return web.json_response({"path": request.path, "headers": list(request.headers)})

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


# --- a door that costs nothing: no cap, chunks as they come, hop headers, metrics ---------

HELD = 150  # more than the 100 connections aiohttp's default connector allows
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def door_before(completions: Handler, **door: Any
                      ) -> AsyncIterator[tuple[ClientSession, BaseTestServer]]:
    """A client, and the door (``make_gateway(**door)``) before a stub engine whose
    ``/v1/completions`` is ``completions``."""
    stub = web.Application()
    stub.router.add_post("/v1/completions", completions)
    async with (TestServer(stub, host="127.0.0.1") as up,
                TestServer(make_gateway(str(up.make_url("")), CLIENT_ROUTES, **door),
                           host="127.0.0.1") as gw,
                ClientSession(connector=TCPConnector(limit=0)) as http):
        yield http, gw


def test_more_than_a_hundred_requests_reach_the_engine_at_once() -> None:
    async def go() -> None:
        arrived, release = asyncio.Event(), asyncio.Event()
        in_engine = [0]

        async def hold(request: web.Request) -> web.StreamResponse:
            in_engine[0] += 1
            if in_engine[0] == HELD:
                arrived.set()
            await release.wait()  # each request stays in the engine until all have come
            return web.json_response({"ok": True})

        async with door_before(hold) as (http, gw):
            async def one() -> int:
                async with http.post(gw.make_url("/v1/completions"), json={}) as r:
                    return r.status

            calls = [asyncio.ensure_future(one()) for _ in range(HELD)]
            try:
                await asyncio.wait_for(arrived.wait(), 45)
            except TimeoutError:
                pytest.fail(f"only {in_engine[0]} of {HELD} requests reached the engine")
            release.set()
            assert await asyncio.gather(*calls) == [200] * HELD
    asyncio.run(go())


def test_each_streamed_chunk_reaches_the_client_before_the_answer_ends() -> None:
    async def go() -> None:
        seen_by_client = asyncio.Event()

        async def stream(request: web.Request) -> web.StreamResponse:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b"data: first\n\n")
            await seen_by_client.wait()  # the rest only once the first has arrived
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out

        async with (door_before(stream) as (http, gw),
                    http.post(gw.make_url("/v1/completions"), json={}) as r):
            first = await asyncio.wait_for(r.content.readline(), 45)
            assert first == b"data: first\n"
            seen_by_client.set()
            assert (await r.read()).strip() == b"data: [DONE]"
    asyncio.run(go())


def test_per_connection_headers_and_those_connection_names_stop_at_the_door() -> None:
    async def test(http: ClientSession, url: str, seen: list[str]) -> None:
        sent = {"Connection": "keep-alive, X-Secret-Hop", "X-Secret-Hop": "1",
                "Keep-Alive": "timeout=5", "Proxy-Authorization": "Basic eA==",
                "Upgrade": "h2c", "TE": "trailers", "X-Kept": "yes"}
        async with http.get(f"{url}/v1/models", headers=sent) as r:
            got = {k.lower() for k in (await r.json())["headers"]}
        assert "x-kept" in got
        assert not got & {"x-secret-hop", "keep-alive", "proxy-authorization", "upgrade",
                          "te"}
    run(test)


def test_a_request_with_both_framings_is_refused_before_the_engine() -> None:
    async def test(http: ClientSession, url: str, seen: list[str]) -> None:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nPOST /collective_rpc "
                     b"HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 45)
        writer.close()
        assert answer.split(b"\r\n")[0].split()[1] == b"400"
        assert seen == []
    run(test)


def test_the_engines_metrics_are_reachable_through_the_door() -> None:
    async def test(http: ClientSession, url: str, seen: list[str]) -> None:
        async with http.get(f"{url}/metrics") as r:
            assert r.status == 200
        assert seen == ["GET /metrics"]
    run(test)


def test_the_door_counts_requests_in_flight_errors_and_bytes() -> None:
    async def go() -> None:
        counters = DoorCounters()
        async with TestServer(engine([]), host="127.0.0.1") as up:
            door = make_gateway(str(up.make_url("")), CLIENT_ROUTES, counters=counters)
            async with TestServer(door, host="127.0.0.1") as gw, ClientSession() as http:
                async with http.post(gw.make_url("/v1/completions"),
                                     json={"prompt": "hi"}) as r:
                    answer = await r.read()
                async with http.post(gw.make_url("/collective_rpc"), json={}) as r:
                    assert r.status == 404
        text = render(counters.families())
        assert sample(text, "dcr_door_requests_total", outcome="forwarded") == 1
        assert sample(text, "dcr_door_requests_total", outcome="not_served") == 1
        assert sample(text, "dcr_door_errors_total") == 1
        assert sample(text, "dcr_door_requests_in_flight") == 0
        assert sample(text, "dcr_door_bytes_total", direction="out") == len(answer)
        assert sample(text, "dcr_door_bytes_total", direction="in") == len(
            json.dumps({"prompt": "hi"}))
    asyncio.run(go())


# --- staleness a trainer can bound ------------------------------------------------------

def test_a_request_for_a_newer_version_than_the_engine_holds_is_a_409_naming_both() -> None:
    async def go() -> None:
        seen: list[str] = []
        async with TestServer(engine(seen), host="127.0.0.1") as up:
            door = make_gateway(str(up.make_url("")), CLIENT_ROUTES, version=lambda: 4)
            async with TestServer(door, host="127.0.0.1") as gw, ClientSession() as http:
                async with http.post(gw.make_url("/v1/completions"), json={"prompt": "x"},
                                     headers={MIN_VERSION: "5"}) as r:
                    assert r.status == 409
                    body = await r.json()
                assert body["kind"] == "StaleVersion"
                assert "committed version is 4" in body["error"]
                assert "5 or newer" in body["error"]
                async with http.post(gw.make_url("/v1/completions"), json={"prompt": "x"},
                                     headers={MIN_VERSION: "4"}) as r:
                    assert r.status == 200
                    await r.read()
                async with http.post(gw.make_url("/v1/completions"), json={"prompt": "x"},
                                     headers={MIN_VERSION: "four"}) as r:
                    assert r.status == 400
                    assert "'four'" in (await r.json())["error"]
        assert seen == ["POST /v1/completions"]  # the refused ones never reached it
    asyncio.run(go())


def test_a_stream_a_keep_refit_takes_past_its_span_is_ended_with_the_reason() -> None:
    async def go() -> None:
        committed = [7]
        refit, engine_saw_leave = asyncio.Event(), asyncio.Event()

        async def stream(request: web.Request) -> web.StreamResponse:
            assert MAX_SPAN.lower() not in {k.lower() for k in request.headers}
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b'data: {"token": "before"}\n\n')
            await refit.wait()  # frozen under keep while the weights change
            try:
                for _ in range(1000):
                    await out.write(b'data: {"token": "after"}\n\n')
                    await asyncio.sleep(0.01)
            except (asyncio.CancelledError, ConnectionResetError):  # as the door left
                engine_saw_leave.set()
                raise
            return out

        async with door_before(stream, keep=True, version=lambda: committed[0]) as (http, gw):
            async with http.post(gw.make_url("/v1/completions"), json={},
                                 headers={MAX_SPAN: "1"}) as r:
                assert await r.content.readline() == b'data: {"token": "before"}\n'
                committed[0] = 9  # two versions on: more than the span of 1
                refit.set()
                rest = [line async for line in r.content if line.startswith(b"data: ")]
            await asyncio.wait_for(engine_saw_leave.wait(), 45)
        assert len(rest) == 1
        assert b"after" not in rest[0]
        error = json.loads(rest[0][6:])["error"]
        assert error["type"] == "VersionSpanExceeded"
        assert "from 7 to 9" in error["message"]
    asyncio.run(go())


def test_a_keep_refit_within_the_span_passes_the_stream_whole() -> None:
    async def go() -> None:
        committed = [7]

        async def stream(request: web.Request) -> web.StreamResponse:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b"data: before\n\n")
            committed[0] = 8  # the refit lands between two tokens
            await out.write(b"data: after\n\ndata: [DONE]\n\n")
            await out.write_eof()
            return out

        async with (door_before(stream, keep=True, version=lambda: committed[0]) as (http, gw),
                    http.post(gw.make_url("/v1/completions"), json={},
                              headers={MAX_SPAN: "1"}) as r):
            lines = [line async for line in r.content if line.startswith(b"data: ")]
        assert lines[-1] == b"data: [DONE]\n"
    asyncio.run(go())
