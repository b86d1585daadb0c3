"""The agent API's one table: the docstring, routes, client and service all follow it.

A recording service (torch-free, at our own seam) is served by the real aiohttp app on
loopback and called through the real ``AgentClient``, so every row is checked in both
directions: handle arguments -> body -> the service method's arguments, and the
response model back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from aiohttp import web

import dcr.protocol.agent_api as api
from dcr import __version__
from dcr.protocol.agent_api import (
    DENSE_S,
    DRAIN_S,
    AgentApi,
    AgentClient,
    AgentError,
    AgentStatus,
    AttemptDeadline,
    AttemptSpec,
    FlushAck,
)
from dcr.protocol.records import Attempt, Transition
from dcr.receiver.server import make_app
from dcr.receiver.service import AgentConflict, AgentService
from dcr.versions import AGENT_API, RELEASE_HEADER

TOKEN = "t0ken-for-the-api-table-tests"
STATUS = AgentStatus(name="r0", version=1, dirty=None, unknown=None, attempt=None, state=None,
                     error=None, gate_open=True, payloads_staged=0, payloads_applied=0,
                     bytes_staged=0)


class Recording:
    """Every call of the table as the service sees it: (name, arguments)."""

    name = "r0"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        if name not in {c.name for c in AgentApi.calls()}:
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            if name == "committed" and args == ("a-late",):
                raise AgentConflict("r0: attempt a-late is not current; current: none.")
            if name == "flush":
                return FlushAck(attempt=args[0].id, payloads=2, bytes=10, apply_s=0.5,
                                wait_s=0.0)
            return {"profile": {"tensors": {"w": "xor"}},
                    "fingerprint": {"w": "00ff"}}.get(name, STATUS)
        return call


@contextmanager
def serving(service: Recording, port: int = 0) -> Iterator[tuple[str, list[int]]]:
    """The real app over ``service`` on loopback: its URL, and the client port of every
    answered request (one per connection the client opened)."""
    peers: list[int] = []

    async def note_peer(request: web.Request, _: web.StreamResponse) -> None:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername")[1])

    app = make_app(service, TOKEN)  # type: ignore[arg-type]
    app.on_response_prepare.append(note_peer)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", peers
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture
def served() -> Iterator[tuple[Recording, str]]:
    service = Recording()
    with serving(service) as (url, _):
        yield service, url


def attempt() -> Attempt:
    return Attempt(transition=Transition(base_version=1, target_version=2), mode="mixed",
                   receivers=("r0",), deadline=time.time() + 60, id="a-table")


def test_the_module_docstring_lists_the_table() -> None:
    assert api.__doc__ is not None
    assert textwrap.indent(AgentApi.describe(), "    ") in api.__doc__


def positional(f: Callable[..., object]) -> list[tuple[str, bool]]:
    """(name, optional) of every positional parameter but ``self``."""
    return [(p.name, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(f).parameters.values()
            if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]


def test_every_row_is_a_service_method_with_the_handle_signature() -> None:
    for call in AgentApi.calls():
        assert positional(getattr(AgentService, call.name)) == positional(call.encode), call


def test_every_row_travels_from_client_to_service_and_back(
        served: tuple[Recording, str]) -> None:
    service, url = served
    client = AgentClient("r0", url, TOKEN)
    a = attempt()
    assert client.status() == STATUS
    assert client.prepare(a) == STATUS
    client.close_gate()
    client.open_gate()
    client.open_apply(a)
    client.wait_staged(a)
    assert client.flush(a) == FlushAck(attempt=a.id, payloads=2, bytes=10, apply_s=0.5,
                                       wait_s=0.0)
    client.committed(a.id)
    client.stop_and_wait(a.id)
    client.rejoin(1, "/ckpt/v1")
    assert client.profile() == {"tensors": {"w": "xor"}}
    assert client.fingerprint() == {"w": "00ff"}

    names = [name for name, _ in service.calls]
    assert names == [c.name for c in AgentApi.calls()]
    args = dict(service.calls)
    assert args["prepare"] == (AttemptSpec.of(a),)
    for name in ("open_apply", "wait_staged", "flush"):
        (key,) = args[name]
        assert isinstance(key, AttemptDeadline)
        assert key.id == a.id
        assert key.deadline == pytest.approx(a.deadline, abs=5)
    assert args["committed"] == args["stop_and_wait"] == (a.id,)
    assert args["rejoin"] == (1, "/ckpt/v1")
    assert args["status"] == args["close_gate"] == args["profile"] == ()


def test_a_refits_calls_share_one_connection_that_outlives_no_agent() -> None:
    """Fails on bc57880, whose client opened a connection per call (~7 per receiver per
    refit, ~7,000 at 1,000 receivers): every call of one agent goes over one kept-alive
    connection; once that agent's process is gone, the next call at its address opens
    a new one instead of failing on the closed one."""
    service = Recording()
    client = AgentClient("r0", "http://127.0.0.1:1", TOKEN)
    a = attempt()
    with serving(service) as (url, peers):
        client.url = url
        client.prepare(a)
        client.wait_staged(a)
        client.close_gate()
        client.open_apply(a)
        client.flush(a)
        client.committed(a.id)
        client.open_gate()
        AgentClient("r0", url, TOKEN).status()  # the fleet poll's own client
        assert len(peers) == 8
        assert len(set(peers)) == 1, peers
    port = int(url.rsplit(":", 1)[1])
    with serving(service, port) as (_, peers):  # the agent restarted at its address
        assert client.status() == STATUS
        assert client.status() == STATUS
        assert len(peers) == 2
        assert len(set(peers)) == 1


def test_a_refusal_comes_back_as_an_agent_error_with_its_status_and_sentence(
        served: tuple[Recording, str]) -> None:
    _, url = served
    with pytest.raises(AgentError, match="attempt a-late is not current") as refused:
        AgentClient("r0", url, TOKEN).committed("a-late")
    assert (refused.value.status, refused.value.kind) == (409, "AgentConflict")
    with pytest.raises(AgentError) as unauthorized:
        AgentClient("r0", url, "not-the-token-0123456789").status()
    assert unauthorized.value.status == 401


def test_client_timeouts_follow_each_rows_rule() -> None:
    a, own = attempt(), 30.0

    def wait(name: str, *args: Any) -> float:
        call = getattr(AgentApi, name)
        return float(call.wait(own, call.encode(*args)))

    assert wait("status") == wait("open_gate") == wait("prepare", a) == own
    assert wait("close_gate") == own + DRAIN_S
    assert wait("flush", a) == pytest.approx(own + 60, abs=5)
    assert wait("wait_staged", a) == pytest.approx(own + 60, abs=5)
    assert wait("stop_and_wait", a.id) == 2 * own
    assert wait("rejoin", 1, "/ckpt") == own + DENSE_S


def test_the_token_never_shows_in_a_clients_repr() -> None:
    client = AgentClient("r0", "http://127.0.0.1:1", TOKEN)
    assert TOKEN not in repr(client)


def test_every_answer_names_the_agent_api_version_and_the_release(
        served: tuple[Recording, str]) -> None:
    _, url = served
    client = AgentClient("r0", url, TOKEN)
    assert client.status() == STATUS
    assert client.release == __version__
    req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as resp:  # no version header: version 1
        assert (resp.headers[AGENT_API.header], resp.headers[RELEASE_HEADER]) == (
            str(AGENT_API.writes), __version__)


def test_an_agent_of_the_next_api_version_is_refused_naming_both_versions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dcr.receiver.server.AGENT_API",
                        dataclasses.replace(AGENT_API, writes=2, reads=(2,)))
    service = Recording()
    skew = (rf"Agent r0's answer \(GET /v1/status\) has agent API version 2, but this DCR "
            f"{__version__} reads agent API version 1")
    with serving(service) as (url, _), pytest.raises(AgentError, match=skew) as e:
        AgentClient("r0", url, TOKEN).status()
    assert (e.value.kind, service.calls) == ("VersionSkew", [])  # refused before its handler


def test_an_agent_refuses_a_request_of_the_next_api_version_before_its_handler(
        served: tuple[Recording, str]) -> None:
    service, url = served
    req = urllib.request.Request(url + "/v1/gate/close", data=b"", method="POST", headers={
        "Authorization": f"Bearer {TOKEN}", AGENT_API.header: "2"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    with e.value:
        body = json.loads(e.value.read())
    assert (e.value.code, body["kind"], service.calls) == (400, "VersionSkew", [])
    assert body["error"] == AGENT_API.refusal("The request", 2)
