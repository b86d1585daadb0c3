"""The WAN link emulator (``python -m dcr.refit.linkemu``, and ``bench/linkemu.py`` as a
script): bytes cross it intact both ways and its report counts them."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.mark.parametrize("command",
                         [["-m", "dcr.refit.linkemu"], [str(ROOT / "bench" / "linkemu.py")]],
                         ids=["module", "bench-script"])
def test_bytes_cross_the_link_intact_and_the_report_counts_them(command: list[str]) -> None:
    srv, t = _echo_server()
    port = srv.getsockname()[1]
    link = subprocess.Popen(
        [sys.executable, *command, "--listen", "127.0.0.1:0", "--to", f"127.0.0.1:{port}",
         "--mbit", "100", "--rtt-ms", "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert link.stdout is not None
        first = link.stdout.readline().strip()
        assert re.fullmatch(r"listening 127\.0\.0\.1:\d+", first), first
        data = bytes(range(256)) * 1024  # 256 KiB
        with socket.create_connection(("127.0.0.1", int(first.rsplit(":", 1)[1]))) as c:
            c.sendall(data)
            c.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := c.recv(65536):
                got += chunk
        assert got == data
    finally:
        link.terminate()
        out, _ = link.communicate(timeout=30)
        srv.close()
        t.join(5)
    assert f"bytes up {len(data)} down {len(data)}" in out
