"""Start, kill and restart ``dcr agent`` processes on loopback (the main job, tests, bench).

Each agent keeps its port and state directory across restarts, as a pod keeps its
address and volume, so a restarted agent finds its journal and its coordinator finds it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dcr.errors import DcrError
from dcr.protocol.agent_api import AgentClient
from dcr.tokens import write_token_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(kw_only=True)
class AgentProcess:
    name: str
    args: list[str]  # ``dcr agent`` arguments after --name/--listen/--state-dir/--token-file
    state_dir: Path
    token: str
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"  # any loopback address: tests give pods 127.0.0.2, .3, ...
    proc: subprocess.Popen[str] | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self, timeout_s: float = 30.0) -> AgentClient:
        return AgentClient(self.name, self.url, self.token, timeout_s=timeout_s)

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        token_file = write_token_file(self.state_dir / "token", self.token)  # 0600 at birth
        log: IO[str] = open(self.state_dir / "agent.log", "a")  # noqa: SIM115 (owned by proc)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcr", "agent", "--name", self.name,
             "--listen", f"{self.host}:{self.port}", "--state-dir", str(self.state_dir),
             "--token-file", str(token_file), *self.args],
            stdout=subprocess.PIPE, stderr=log, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, object]:
        """Block until the agent prints its listening line; its status then answers."""
        assert self.proc is not None
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line:
            if self.proc.poll() is not None:
                tail = (self.state_dir / "agent.log").read_text().splitlines()[-5:]
                raise DcrError(f"Agent {self.name} exited {self.proc.returncode} while "
                               f"starting: {' | '.join(tail)}")
            if time.monotonic() > deadline:
                raise DcrError(f"Agent {self.name} not listening after {timeout_s} s.")
            line = self.proc.stdout.readline().strip()
        return dict(json.loads(line))

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye, as a node loss looks."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()
        self.wait_ready()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipe()
