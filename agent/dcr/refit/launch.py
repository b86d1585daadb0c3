"""Start, kill and restart ``dcr agent``, ``dcr serve`` and ``dcr encoder`` on loopback.

Each :class:`Process` keeps its port and directory across restarts, as a pod keeps its
address and volumes, and prints one JSON line once it listens.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, ClassVar

from dcr.drivers.vllm import VllmDriver
from dcr.errors import DcrError
from dcr.http.tls import TlsSettings
from dcr.http.tokens import write_token_file
from dcr.protocol.agent_api import AgentClient
from dcr.protocol.encoder_api import EncoderClient

START_TIMEOUT_S = 120.0  # a server loads its model before it listens


LOW_PORT = 10000  # the lowest port free_port hands out


def _ephemeral_floor() -> int:
    """The first port the kernel hands to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port for a server, below the kernel's ephemeral range when there is
    room: a port taken from that range (bind to 0) can become an outgoing connection's
    source port between being chosen and bound, or while a killed process restarts on it,
    and the main job's agents open many connections to the store meanwhile."""
    floor = _ephemeral_floor()
    rng = random.SystemRandom()
    for _ in range(64 if floor - LOW_PORT >= 1000 else 0):
        port = rng.randrange(LOW_PORT, floor)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(kw_only=True)
class Process:
    """One ``dcr <command>`` process, restartable on the same port and directory."""

    command: ClassVar[str]  # the dcr subcommand
    name: str
    args: list[str]  # its arguments after those the launcher passes itself (``argv``)
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"  # any loopback address: tests give pods 127.0.0.2, .3, ...
    env: dict[str, str] = field(default_factory=dict)  # added to its environment, every start
    proc: subprocess.Popen[str] | None = None
    restarts: int = 0

    @property
    def directory(self) -> Path:
        """Where its log (and whatever else it keeps) lives."""
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.command}.log"

    @property
    def url(self) -> str:
        """``https`` when its environment gives it a certificate (:mod:`dcr.http.tls`)."""
        scheme = TlsSettings.from_env({**os.environ, **self.env}).scheme
        return f"{scheme}://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        """The arguments the launcher passes before ``args`` (written files included)."""
        return ["--listen", f"{self.host}:{self.port}"]

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        log: IO[str] = open(self.log_path, "a")  # noqa: SIM115 (owned by proc)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcr", self.command, *self.argv(), *self.args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
            env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        )
        log.close()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, object]:
        """Block until the process prints its listening line; it answers from then on."""
        assert self.proc is not None
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text().splitlines()[-5:]
                raise DcrError(f"{self.command} {self.name} exited {self.proc.returncode} "
                               f"while starting: {' | '.join(tail)}")
            if time.monotonic() > deadline:
                raise DcrError(f"{self.command} {self.name} not listening after "
                               f"{timeout_s} s.")
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


@dataclass(kw_only=True)
class AgentProcess(Process):
    """``dcr agent``: ``args`` after --name/--listen/--state-dir/--token-file."""

    command: ClassVar[str] = "agent"
    state_dir: Path
    token: str

    @property
    def directory(self) -> Path:
        return self.state_dir

    def client(self, timeout_s: float = 30.0) -> AgentClient:
        return AgentClient(self.name, self.url, self.token, timeout_s=timeout_s)

    def argv(self) -> list[str]:
        token_file = write_token_file(self.state_dir / "token", self.token)  # 0600 at birth
        return ["--name", self.name, *super().argv(), "--state-dir", str(self.state_dir),
                "--token-file", str(token_file)]


@dataclass(kw_only=True)
class ServeProcess(Process):
    """``dcr serve``, the reference engine: ``args`` after --listen (and --api-key-file
    when it has an ``api_key``); its log in ``workdir``."""

    command: ClassVar[str] = "serve"
    workdir: Path
    api_key: str | None = None

    @property
    def directory(self) -> Path:
        return self.workdir

    def engine(self) -> VllmDriver:
        """The agent's adapter to it (``dcr serve`` speaks vLLM's dialect)."""
        return VllmDriver(self.url, self.api_key)

    def argv(self) -> list[str]:
        if self.api_key is None:
            return super().argv()
        key_file = write_token_file(self.workdir / "api-key", self.api_key)
        return [*super().argv(), "--api-key-file", str(key_file)]


@dataclass(kw_only=True)
class EncoderProcess(Process):
    """``dcr encoder``, a warm owner endpoint: ``args`` after --listen/--token-file (the
    store and the checkpoint roots); its log and token file in ``workdir``."""

    command: ClassVar[str] = "encoder"
    workdir: Path
    token: str

    @property
    def directory(self) -> Path:
        return self.workdir

    def client(self) -> EncoderClient:
        return EncoderClient(self.url, self.token, name=self.name)

    def argv(self) -> list[str]:
        token_file = write_token_file(self.workdir / "token", self.token)  # 0600 at birth
        return [*super().argv(), "--token-file", str(token_file)]


__all__ = ["AgentProcess", "EncoderProcess", "Process", "ServeProcess", "free_port"]
