"""Bearer tokens: one strength check for every token, and token files born 0600.

The agent's token, the relay's read and publish tokens and the tokens the main job makes
go through :mod:`dcr.http.tokens`. A weak or placeholder token is refused with a sentence that
names where it came from and never the token; a token file is created with mode 0600
(never written and then ``chmod``-ed) and a link planted at its path is replaced, not
written through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from dcr.errors import ConfigError
from dcr.http.edge import UNAUTHORIZED, host_port
from dcr.http.tokens import bearer_matches, check_token, read_token, write_token_file
from dcr.owner.server import EncoderService
from dcr.owner.server import make_app as encoder_app
from dcr.receiver.main import _token
from dcr.receiver.member import MemberService, make_member_app
from dcr.receiver.server import make_app as agent_app
from dcr.refit import launch
from dcr.transport.relay import RelayNode, RelaySettings

GOOD = "0123456789abcdef0123"
PLACEHOLDER = "change-me-to-a-long-random-token"  # charts/dcr/examples/rolloutfleet.yaml


@pytest.mark.parametrize(("token", "needle"), [
    ("", "0 characters"),
    ("0123456789abcde", "15 characters"),
    ("0123456789 abcdef", "whitespace"),
    ("0123456789abcdef\x07", "control"),
    ("0123456789abcdef\u00e9", "non-ASCII"),
    (PLACEHOLDER, "placeholder"),
    ("CHANGE-ME-please-0123456789", "placeholder"),
])
def test_weak_tokens_are_refused_naming_the_source_never_the_token(token: str,
                                                                     needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        check_token(token, "relay read token from '/etc/dcr/read'")
    assert "relay read token from '/etc/dcr/read'" in str(e.value)
    if token:
        assert token not in str(e.value)


def test_a_random_token_passes() -> None:
    assert check_token(GOOD, "x") == GOOD
    assert check_token("!~" * 8, "x") == "!~" * 8  # printable ASCII, 16 characters


def test_the_agent_refuses_the_documented_placeholder_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on 5b0b0ae: the example token passed the agent's 16-character check."""
    path = tmp_path / "token"
    path.write_text(PLACEHOLDER + "\n")
    with pytest.raises(ConfigError, match="placeholder") as e:
        _token(path, "DCR_AGENT_TOKEN")
    assert str(path) in str(e.value)
    assert PLACEHOLDER not in str(e.value)
    monkeypatch.setenv("DCR_RELAY_TOKEN", PLACEHOLDER)
    with pytest.raises(ConfigError, match=r"relay read token from \$DCR_RELAY_TOKEN"):
        _token(None, "DCR_RELAY_TOKEN")


def test_read_token_strips_the_file_and_names_an_unreadable_one(tmp_path: Path) -> None:
    (tmp_path / "t").write_text(f"  {GOOD}\n")
    assert read_token("agent token", tmp_path / "t") == GOOD
    with pytest.raises(ConfigError, match="Cannot read the agent token file"):
        read_token("agent token", tmp_path / "missing")
    with pytest.raises(ConfigError, match="No file was given"):
        read_token("relay publish token", None)


def _relay(tmp_path: Path, read: str, publish: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "read").write_text(read)
    (tmp_path / "publish").write_text(publish)
    return subprocess.run(
        [sys.executable, "-m", "dcr", "relay", "--listen", "127.0.0.1:1", "--members",
         "127.0.0.1:1", "--index", "0", "--token-file", str(tmp_path / "read"),
         "--publish-token-file", str(tmp_path / "publish")],
        capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("read", "publish", "needle"), [
    ("short", GOOD, "relay read token from"),
    (GOOD, "tiny", "relay publish token from"),
    (GOOD, PLACEHOLDER, "placeholder"),
    (GOOD, GOOD, "read and publish tokens are the same"),
])
def test_dcr_relay_refuses_weak_or_shared_tokens(tmp_path: Path, read: str, publish: str,
                                                 needle: str) -> None:
    """Fails on 5b0b0ae: a relay token had no minimum length (one character did), and
    there was one token for reading and pushing alike."""
    r = _relay(tmp_path, read, publish)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr.startswith("dcr: error: "), r.stderr
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    for secret in (read, publish):
        assert secret not in r.stderr


def test_an_owner_refuses_a_weak_publish_token_before_it_connects(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dcr.transport.relay.publish import RelayPublisher

    monkeypatch.setenv("DCR_RELAY_TOKEN", PLACEHOLDER + "\n")
    with pytest.raises(ConfigError, match=r"relay publish token from \$DCR_RELAY_TOKEN"):
        RelayPublisher("relay+http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="6 characters"):
        RelayPublisher("relay+http://127.0.0.1:9", token="abcdef")


@pytest.mark.parametrize("header", [None, "", GOOD, f"bearer {GOOD}", f"Bearer {GOOD} ",
                                    "Bearer \udcff\udcfe", f"Bearer {GOOD}\u00e9"])
def test_only_the_exact_bearer_header_matches_and_nothing_raises(header: str | None) -> None:
    assert not bearer_matches(header, GOOD)
    assert bearer_matches(f"Bearer {GOOD}", GOOD)


# --- the servers' guard ------------------------------------------------------------------


def _guarded(app: web.Application, path: str, header: str | None) -> web.StreamResponse:
    """What ``app``'s guard answers a GET of ``path`` (its handler: a 200)."""
    async def ok(_: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    headers = {} if header is None else {"Authorization": header}
    request = make_mocked_request("GET", path, headers=headers, app=app)
    return asyncio.run(app.middlewares[0](request, ok))


def _apps(tmp_path: Path) -> dict[str, web.Application]:
    store: Any = mock.Mock()  # the guard answers before any call reaches a service
    members = MemberService("m0", lambda _: store, staging_dir=tmp_path, staging_bytes=1)
    return {"agent": agent_app(store, GOOD), "member": make_member_app(members, GOOD),
            "encoder": encoder_app(EncoderService(store, store), GOOD),
            "relay": RelayNode(RelaySettings(index=0, members=("127.0.0.1:1",), token=GOOD,
                                             publish_token=GOOD[::-1])).app()}


@pytest.mark.parametrize("header", [None, f"Bearer {GOOD}x", "Bearer t\u00f6k"])
def test_every_server_answers_one_401_with_the_bearer_challenge(
        tmp_path: Path, header: str | None) -> None:
    for name, app in _apps(tmp_path).items():
        r = _guarded(app, "/v1/status", header)
        assert isinstance(r, web.Response), name
        assert (r.status, r.headers.get("WWW-Authenticate")) == (401, "Bearer"), name
        assert json.loads(r.text or "") == UNAUTHORIZED, name
        assert _guarded(app, "/healthz", header).status == 200, name
    assert _guarded(_apps(tmp_path)["agent"], "/v1/status", f"Bearer {GOOD}").status == 200


@pytest.mark.parametrize(("text", "want"), [
    ("0.0.0.0:8471", ("0.0.0.0", 8471)), (":0", ("127.0.0.1", 0)),
    ("[::1]:80", ("[::1]", 80)), (" relay-0.dcr:8470 ", ("relay-0.dcr", 8470))])
def test_host_port_reads_a_listen_address(text: str, want: tuple[str, int]) -> None:
    assert host_port(text, "--listen") == want


@pytest.mark.parametrize("text", ["8471", "host:", "host:http", "host:65536", "host:-1"])
def test_host_port_refuses_anything_else_naming_the_value(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"--listen {re.escape(repr(text))} is not HOST:PORT"):
        host_port(text, "--listen")
    with pytest.raises(ConfigError, match="Relay address ':80'"):
        host_port(":80", "Relay address", default_host=None)


# --- token files ------------------------------------------------------------------------


@contextlib.contextmanager
def _no_chmod_and_umask_0(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Permissions must be right at creation: chmod fails the test, and the umask hides
    nothing."""
    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a token file was chmod-ed after it was written")

    monkeypatch.setattr(os, "chmod", refuse)
    monkeypatch.setattr(Path, "chmod", refuse)
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _assert_private_file(path: Path, token: str) -> None:
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode), "a link at the token's path was followed"
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert path.read_text() == token


def test_write_token_file_creates_0600_and_replaces_a_planted_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_text("do not touch")
    (tmp_path / "token").symlink_to(victim)
    with _no_chmod_and_umask_0(monkeypatch):
        write_token_file(tmp_path / "token", GOOD)
        write_token_file(tmp_path / "token", GOOD + "x")  # again, as a restart does
    _assert_private_file(tmp_path / "token", GOOD + "x")
    assert victim.read_text() == "do not touch"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token", "victim"]


class _NoProcess:
    """Stands in for ``subprocess.Popen``: records the argv, starts nothing."""

    started: ClassVar[list[list[str]]] = []

    def __init__(self, args: list[str], **_: Any) -> None:
        self.args = args
        self.stdout = None
        _NoProcess.started.append(args)

    def poll(self) -> int | None:
        return None


def test_agent_process_writes_its_token_file_0600_from_the_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on 5b0b0ae: the file was written with the umask's bits, then chmod-ed, and a
    link planted at ``<state>/token`` was written through."""
    victim = tmp_path / "victim"
    victim.write_text("do not touch")
    state = tmp_path / "state"
    state.mkdir()
    (state / "token").symlink_to(victim)
    monkeypatch.setattr(launch.subprocess, "Popen", _NoProcess)
    agent = launch.AgentProcess(name="a", args=[], state_dir=state, token=GOOD)
    with _no_chmod_and_umask_0(monkeypatch):
        agent.start()
    _assert_private_file(state / "token", GOOD)
    assert victim.read_text() == "do not touch"
    argv = _NoProcess.started[-1]
    assert argv[argv.index("--token-file") + 1] == str(state / "token")


def test_the_main_jobs_relay_tree_gets_two_private_token_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on 5b0b0ae: one token file, written then chmod-ed, went to every node and
    agent and to the owner alike."""
    from dcr.refit import job as refit

    monkeypatch.setattr(refit.subprocess, "Popen", _NoProcess)
    monkeypatch.setattr(refit.OPENER, "open", lambda *a, **k: contextlib.nullcontext())
    _NoProcess.started.clear()
    with _no_chmod_and_umask_0(monkeypatch):
        tree = refit.start_relays(tmp_path / "relay", 3)
    read, publish = tree.read_token_file, tree.publish_token_file
    _assert_private_file(read, read.read_text())
    _assert_private_file(publish, publish.read_text())
    assert read.read_text() != publish.read_text()
    for argv in _NoProcess.started:
        assert argv[argv.index("--token-file") + 1] == str(read)
        assert argv[argv.index("--publish-token-file") + 1] == str(publish)
    assert len(_NoProcess.started) == len(tree.urls) == 3
