"""The relay's health probe waits as long as ``--health-timeout-s`` says, and no longer.

A member that probes a slow parent with too short a timeout re-attaches to an ancestor
for nothing (seen under CPU load with the old 0.5 s). Here a node built from the
command line, as ``dcr relay`` builds it, probes a stand-in member whose ``/healthz``
answers one second after the request arrives: the probe succeeds when the setting is
longer than that and fails when it is shorter. Both outcomes follow from the order of
the loop's own timers, not from how fast the machine is.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from aiohttp import web

from dcr.cli import build_parser, relay_settings
from dcr.transport.relay.node import RelayNode
from dcr.transport.relay.settings import RelaySettings

ANSWER_AFTER_S = 1.0  # the stand-in's delay: twice the old default timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(tmp_path: Path, slow_member: str, *flags: str) -> RelayNode:
    """Member 0 (the root, so it runs no probe loop of its own) of a two-member tree."""
    (tmp_path / "read").write_text("0123456789abcdef\n")
    (tmp_path / "publish").write_text("fedcba9876543210\n")
    listen = f"127.0.0.1:{_free_port()}"
    args = build_parser("relay").parse_args([
        "relay", "--listen", listen, "--members", f"{listen},{slow_member}", "--index", "0",
        "--token-file", str(tmp_path / "read"), "--publish-token-file",
        str(tmp_path / "publish"), *flags])
    return RelayNode(relay_settings(args))


async def _probe_slow_member(tmp_path: Path, *flags: str) -> tuple[RelayNode, bool]:
    arrived = asyncio.Event()

    async def healthz(_: web.Request) -> web.Response:
        arrived.set()
        await asyncio.sleep(ANSWER_AFTER_S)
        return web.json_response({"status": "ok", "joined": True})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    node = _node(tmp_path, f"127.0.0.1:{port}", *flags)
    await node.start()
    try:
        ok = await node._probe(1)
        assert arrived.is_set(), "the probe never reached the stand-in member"
        return node, ok
    finally:
        await node.stop()
        await runner.cleanup()


@pytest.mark.parametrize(("flags", "answered"), [
    (("--health-timeout-s", "0.3"), False),
    (("--health-timeout-s", "60"), True),
    ((), True),  # the default waits out a member that takes twice the old default
])
def test_the_health_timeout_from_the_command_line_is_what_the_probe_waits(
        tmp_path: Path, flags: tuple[str, ...], answered: bool) -> None:
    node, ok = asyncio.run(_probe_slow_member(tmp_path, *flags))
    want = float(flags[1]) if flags else RelaySettings.health_timeout_s
    assert node.settings.health_timeout_s == want
    assert ok is answered


def test_by_default_a_member_moves_only_after_two_probes_in_a_row_time_out(
        tmp_path: Path) -> None:
    s = _node(tmp_path, "127.0.0.1:9").settings
    assert s.parent_timeout_s > 2 * (s.health_timeout_s + s.health_interval_s)
