"""The agent's guard over real HTTP: any ``Authorization`` header but the exact one is a 401.

The agent's aiohttp app (:func:`dcr.receiver.server.make_app`) listens on loopback in
this process, in front of a service that fails the test if any call reaches it. Headers
are sent as raw bytes (``http.client`` with ``bytes`` values), as a hostile client would.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from dcr.receiver.server import make_app

TOKEN = "agent-auth-token-5a1c9e"


class _Unreachable:
    """Stands in for the service: the guard must answer before any method runs."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*_: Any, **__: Any) -> Any:
            raise AssertionError(f"service.{name} was reached past the guard")

        return call


@pytest.fixture(scope="module")
def agent_port() -> Iterator[int]:
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(_Unreachable(), TOKEN), access_log=None)  # type: ignore[arg-type]

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return int(runner.addresses[0][1])

    thread = threading.Thread(target=loop.run_forever, daemon=True, name="agent-app")
    thread.start()
    port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield port
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _get(port: int, path: str, authorization: bytes | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path)
        if authorization is not None:
            conn.putheader("Authorization", authorization)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", "Bearer t\u00f6k\u00e9n".encode(),
                                   b"\xc3\x28", f"Bearer {TOKEN}\u2603".encode(),
                                   TOKEN.encode(), None],
                         ids=["latin1", "utf8", "bad-utf8", "token-and-snowman", "no-bearer",
                              "absent"])
def test_any_header_but_the_exact_bearer_token_is_a_401_never_a_500(
        agent_port: int, value: bytes | None, caplog: pytest.LogCaptureFixture) -> None:
    """Fails on 5b0b0ae: the guard encoded the header to compare it; bytes that are not
    UTF-8 (which aiohttp keeps as surrogates) raised, and the agent answered 500 with a
    traceback, unauthenticated."""
    with caplog.at_level(logging.ERROR):
        status, body = _get(agent_port, "/v1/status", value)
    assert status == 401, (status, body)
    assert json.loads(body) == {"error": "Missing or wrong bearer token.",
                                "kind": "Unauthorized"}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text

