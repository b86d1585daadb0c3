"""The agent client against hostile endpoints: the bearer token reaches the agent only.

The operator sends the fleet's agent token with every call, so whatever answers at an
agent's address must not be able to send it on (a redirect), to a proxy, or to read
local files (a ``file:`` URL); and nothing it answers may leak into the operator's
sentences by way of an exception that quotes it. Nor may it hold the operator's thread:
a call ends at its deadline however slowly the answer comes, and a status answer is small.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from stubs import stubs

from dcr.errors import ConfigError
from dcr.protocol.agent_api import AgentClient, AgentError

TOKEN = "hostile-endpoint-test-token-0123456789"
SECRET = "S3CR3T-FROM-THE-ENDPOINT"
STATUS = {"name": "r0", "version": 1, "dirty": None, "unknown": None, "attempt": None,
          "state": None, "error": None, "gate_open": True, "payloads_staged": 0,
          "payloads_applied": 0, "bytes_staged": 0}


def test_a_redirect_is_an_error_naming_it_and_the_token_goes_nowhere_else() -> None:
    """Fails on 5b0b0ae: urllib followed the 302 and sent the token to the second host."""
    with stubs("127.0.0.2", "127.0.0.3") as (agent, elsewhere):
        elsewhere.answer = (200, {"Content-Type": "application/json"},
                            json.dumps(STATUS).encode())
        for code in (301, 302, 303, 307, 308):
            agent.answer = (code, {"Location": f"{elsewhere.url}/v1/status"}, b"")
            with pytest.raises(AgentError, match=f"answered HTTP {code}, a redirect") as e:
                AgentClient("r0", agent.url, TOKEN).status()
            assert e.value.status == code
        assert agent.tokens() == [f"Bearer {TOKEN}"] * 5
        assert elsewhere.seen == []


def test_only_http_urls_are_opened(tmp_path: Path) -> None:
    """Fails on 5b0b0ae: a ``file:`` URL was opened and its bytes parsed as an answer."""
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({**STATUS, "name": SECRET}))
    for url in (secret.as_uri(), "ftp://127.0.0.1/x", "data:,{}", "127.0.0.1:8471"):
        with pytest.raises(ConfigError, match="not an http:// or https:// URL"):
            AgentClient("r0", url, TOKEN)
    client = AgentClient("r0", "http://127.0.0.1:1", TOKEN)
    client.url = secret.as_uri()  # however a URL came to be, the client opens no file
    with pytest.raises(AgentError, match=r"is unreachable \(GET /v1/status\)") as e:
        client.status()
    assert SECRET not in str(e.value)


def test_proxies_from_the_environment_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on 5b0b0ae: ``http_proxy`` routed the call, token and all, through a proxy."""
    with stubs("127.0.0.2", "127.0.0.4") as (agent, proxy):
        agent.answer = (200, {}, json.dumps(STATUS).encode())
        proxy.answer = (200, {}, json.dumps(STATUS).encode())
        for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
            monkeypatch.setenv(var, proxy.url)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's, built anew
        assert AgentClient("r0", agent.url, TOKEN).status().name == "r0"
        assert proxy.seen == []
        assert len(agent.seen) == 1


def test_an_answer_that_is_not_http_is_unreachable_in_our_words() -> None:
    """Fails on 5b0b0ae: http.client's BadStatusLine escaped the client, quoting the line."""
    with stubs("127.0.0.2") as (agent,):
        agent.answer = f"{SECRET} not an HTTP status line\r\n\r\n".encode()
        with pytest.raises(AgentError, match=r"is unreachable \(GET /v1/status\): "
                           r"BadStatusLine") as e:
            AgentClient("r0", agent.url, TOKEN).status()
    assert SECRET not in str(e.value)
    assert e.value.status is None


def within(bound_s: float, fn: Callable[[], Any]) -> BaseException | None:
    """What ``fn()`` raised (None: it returned), run in a thread waited for ``bound_s`` at
    most, so that a call that never ends fails the test instead of hanging it."""
    raised: list[BaseException | None] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:
            raised.append(e)
        else:
            raised.append(None)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert raised, f"the call was still waiting after {bound_s} s"
    return raised[0]


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("answer", [
    HEAD + b"X-Slow: ",  # headers that never end
    HEAD + b"Content-Length: 1000000\r\n\r\n{",  # a body that never ends
    HEAD + b"Connection: close\r\n\r\n" + json.dumps(STATUS).encode()[:-1],  # no length
], ids=["headers", "body", "body-without-length"])
def test_an_answer_trickled_a_byte_at_a_time_ends_at_the_calls_deadline(answer: bytes) -> None:
    """Fails without the whole-call deadline: each byte comes within the 1 s read timeout,
    so the call never returns (the bound of 60 s here ends the test)."""
    with stubs("127.0.0.2") as (agent,):
        agent.answer, agent.trickle_s = answer, 0.05
        client = AgentClient("r0", agent.url, TOKEN, timeout_s=1.0)
        e = within(60, client.status)
    assert isinstance(e, AgentError)
    assert "Agent r0 (GET /v1/status) did not answer within 1 s" in str(e)
    assert e.status is None


def test_a_status_answer_is_small() -> None:
    """Fails without the bound of fixed-shape answers: 1 MiB of status was read and
    parsed (any answer up to 256 MiB was)."""
    with stubs("127.0.0.2") as (agent,):
        agent.answer = (200, {}, json.dumps({**STATUS, "error": "x" * (1 << 20)}).encode())
        with pytest.raises(AgentError, match=r"\(GET /v1/status\) answered more than "
                           r"65536 bytes"):
            AgentClient("r0", agent.url, TOKEN).status()
        agent.answer = (200, {}, json.dumps({f"t{i}": "0" * 32 for i in range(4096)}).encode())
        assert len(AgentClient("r0", agent.url, TOKEN).fingerprint()) == 4096  # open-ended
