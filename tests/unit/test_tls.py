"""TLS on DCR's servers and clients (:mod:`dcr.http.tls`), against a real CA.

A server started through :func:`dcr.http.edge.start` with a certificate serves HTTPS and
nothing else; each client family (urllib's opener, the agent client's urllib3 pools, the
relay client's aiohttp) verifies the peer against ``DCR_TLS_CA``, refuses one it cannot
verify with a sentence naming the address, refuses to send a token to a plain ``http://``
peer once TLS is configured, and checks ``DCR_TLS_SERVER_NAME`` when peers are reached by
address. A renewed certificate is served at the next handshake.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError
from tlsca import Authority, Leaf, plain_get

from dcr.errors import ConfigError, RelayError
from dcr.http import edge
from dcr.http.direct import OPENER
from dcr.http.tls import TlsSettings, client_context, server_context
from dcr.protocol import agent_api
from dcr.protocol.agent_api import AgentClient, AgentError
from dcr.protocol.encoder_api import EncoderClient, EncoderError
from dcr.receiver.peers import PeerClient
from dcr.transport.relay import RelayClient

TOKEN = "tls-test-token-5b8e0c1d2f"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority.mint(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority.mint(tmp_path_factory.mktemp("other-ca"), "someone-elses-ca")


class Served:
    """An app behind ``edge.start`` on an event loop of its own thread."""

    def __init__(self, tls: TlsSettings) -> None:
        self.seen: list[str] = []
        app = web.Application(middlewares=[edge.guard(TOKEN, edge.Statuses())])
        app.router.add_get("/v1/status", self._status)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.listening = self._call(edge.start(app, "127.0.0.1:0", "The test server",
                                               tls=tls))
        self.url = self.listening.url

    async def _status(self, request: web.Request) -> web.Response:
        self.seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"counters": {"served": 1}})

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        agent_api._POOL.clear()  # kept-alive client connections end before the server's
        self._call(self.listening.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def leaf(ca: Authority, tmp_path: Path) -> Leaf:
    return ca.leaf(tmp_path / "server")


@pytest.fixture
def served(leaf: Leaf) -> Iterator[Served]:
    s = Served(TlsSettings(cert=leaf.cert, key=leaf.key))
    yield s
    s.close()


def _get(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
    with OPENER.open(req, timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _relay_status(url: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with RelayClient(url, TOKEN) as c:
            return await c.status()
    return asyncio.run(go())


def test_a_server_given_a_certificate_serves_https_that_each_client_verifies(
        served: Served, leaf: Leaf, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without edge.start's ssl context the URL is http:// and no handshake happens."""
    monkeypatch.setenv("DCR_TLS_CA", str(leaf.ca))
    assert served.url.startswith("https://127.0.0.1:")
    assert _get(served.url) == {"counters": {"served": 1}}
    assert _relay_status(served.url) == {"counters": {"served": 1}}
    with pytest.raises((AgentError, ValidationError)) as e:  # TLS holds; this is no agent
        AgentClient("r0", served.url, TOKEN, timeout_s=10).status()
    assert "unreachable" not in str(e.value)
    assert served.seen == [f"Bearer {TOKEN}"] * 3


def test_a_client_with_another_ca_is_refused_naming_the_address(
        served: Served, other_ca: Authority, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without verification the token reaches the server (``seen``); without
    :func:`dcr.http.tls.refusal` the sentence says only ``SSLCertVerificationError``."""
    monkeypatch.setenv("DCR_TLS_CA", str(other_ca.path))
    with pytest.raises(AgentError) as agent:
        AgentClient("r0", served.url, TOKEN, timeout_s=10).status()
    with pytest.raises(EncoderError) as encoder:
        EncoderClient(served.url, TOKEN, name="e0").stop("a-0123456789ab", timeout_s=10)
    with pytest.raises(RelayError) as relay:
        _relay_status(served.url)
    for said in (agent, encoder, relay):
        assert served.url in str(said.value)
        assert "TLS certificate did not verify" in str(said.value)
        assert "DCR_TLS_CA" in str(said.value)
    assert served.seen == []  # no token reached the server


def test_a_plain_http_client_gets_no_answer_from_a_tls_server(served: Served) -> None:
    """A server that also listened in plain would answer 200 and see the token."""
    with pytest.raises((http.client.HTTPException, OSError)):
        plain_get(served.listening.port, "/v1/status", TOKEN)
    assert served.seen == []


def test_with_tls_configured_no_client_sends_a_token_to_a_plain_http_peer(
        leaf: Leaf, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without :func:`dcr.http.tls.check_peer_url` each client is built and would send
    its token in clear at its first call."""
    monkeypatch.setenv("DCR_TLS_CA", str(leaf.ca))
    with socket.socket() as listener:  # a plain peer that would read what it is sent
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        for make in (lambda: AgentClient("r0", url, TOKEN),
                     lambda: EncoderClient(url, TOKEN, name="e0"),
                     lambda: RelayClient(url, TOKEN), lambda: PeerClient(url, TOKEN)):
            with pytest.raises(ConfigError, match="is plain HTTP, but DCR_TLS_CA is set"):
                make()
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected


def test_peers_reached_by_address_are_checked_against_the_server_name(
        ca: Authority, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without DCR_TLS_SERVER_NAME a peer at a pod IP never verifies; a client that
    skipped the name check would accept the wrong name at the end."""
    named = ca.leaf(tmp_path / "named", dns=("agent.dcr.internal",), ips=())
    s = Served(TlsSettings(cert=named.cert, key=named.key))
    try:
        monkeypatch.setenv("DCR_TLS_CA", str(named.ca))
        with pytest.raises(urllib.error.URLError, match="IP address mismatch"):
            _get(s.url)
        with pytest.raises(RelayError, match="did not verify"):
            _relay_status(s.url)
        monkeypatch.setenv("DCR_TLS_SERVER_NAME", "agent.dcr.internal")
        assert _get(s.url)["counters"] == {"served": 1}
        assert _relay_status(s.url)["counters"] == {"served": 1}
        with pytest.raises((AgentError, ValidationError)) as e:  # past TLS: no agent here
            AgentClient("r0", s.url, TOKEN, timeout_s=10).status()
        assert "did not verify" not in str(e.value)
        monkeypatch.setenv("DCR_TLS_SERVER_NAME", "encoder.dcr.internal")
        with pytest.raises(AgentError, match="did not verify"):
            AgentClient("r0", s.url, TOKEN, timeout_s=10).status()
    finally:
        s.close()


def test_a_renewed_certificate_is_served_at_the_next_handshake(
        ca: Authority, other_ca: Authority, served: Served, leaf: Leaf, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the reload (the SNI callback's swap) the old certificate stays served
    and the first call after the renewal still verifies against the old CA."""
    monkeypatch.setenv("DCR_TLS_CA", str(ca.path))
    assert _get(served.url)["counters"] == {"served": 1}
    renewed = other_ca.leaf(tmp_path / "renewed")
    shutil.copy(renewed.cert, tmp_path / "tls.crt.new")  # kubelet swaps whole files
    shutil.copy(renewed.key, tmp_path / "tls.key.new")
    (tmp_path / "tls.crt.new").replace(leaf.cert)
    (tmp_path / "tls.key.new").replace(leaf.key)
    with pytest.raises(urllib.error.URLError, match="certificate verify failed"):
        _get(served.url)
    monkeypatch.setenv("DCR_TLS_CA", str(other_ca.path))
    assert _get(served.url)["counters"] == {"served": 1}


def test_a_half_written_pair_keeps_the_previous_one(served: Served, leaf: Leaf,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that failed without keeping the old pair would fail the handshake."""
    monkeypatch.setenv("DCR_TLS_CA", str(leaf.ca))
    leaf.key.write_text("-----BEGIN PRIVATE KEY-----\ntruncated")
    assert _get(served.url)["counters"] == {"served": 1}


def test_bad_tls_settings_are_errors_that_name_the_variable(leaf: Leaf, tmp_path: Path
                                                            ) -> None:
    with pytest.raises(ConfigError, match="needs both DCR_TLS_CERT and DCR_TLS_KEY"):
        TlsSettings.from_env({"DCR_TLS_CERT": str(leaf.cert)})
    missing = tmp_path / "nowhere.crt"
    with pytest.raises(ConfigError, match=f"DCR_TLS_CERT='{missing}'.*do not load"):
        server_context(TlsSettings(cert=missing, key=leaf.key))
    with pytest.raises(ConfigError, match=f"DCR_TLS_CA='{missing}' does not load"):
        client_context(TlsSettings(ca=missing))
    assert TlsSettings.from_env({}).scheme == "http"
    assert TlsSettings.from_env({"DCR_TLS_CERT": str(leaf.cert),
                                 "DCR_TLS_KEY": str(leaf.key)}).scheme == "https"


def test_a_ca_bundle_given_as_data_verifies_like_a_file(
        served: Served, leaf: Leaf, other_ca: Authority, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    monkeypatch.setenv("DCR_TLS_CA_DATA", leaf.ca.read_text())  # an encoder Job's relay CA
    assert _relay_status(served.url) == {"counters": {"served": 1}}
    with pytest.raises(ConfigError, match="is plain HTTP, but DCR_TLS_CA_DATA is set"):
        RelayClient("http://127.0.0.1:1", TOKEN)
    monkeypatch.setenv("DCR_TLS_CA_DATA", other_ca.path.read_text())
    with pytest.raises(RelayError, match="TLS certificate did not verify"):
        _relay_status(served.url)
    monkeypatch.setenv("DCR_TLS_CA", str(leaf.ca))
    with pytest.raises(ConfigError, match="Set one of DCR_TLS_CA and DCR_TLS_CA_DATA"):
        TlsSettings.from_env()
