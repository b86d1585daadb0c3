"""The ranks of a vLLM model as separate processes, called all at once.

:class:`Ranks` starts one :mod:`rank_worker` process per rank and sends each call to
every rank before reading any answer, as ``collective_rpc`` does, so ranks that meet in
a collective (the process group's rendezvous) run together. A failed call raises with
the rank's message and the tail of its log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import vllm_cpu

WORKER = Path(__file__).resolve().parent / "rank_worker.py"


class RankError(RuntimeError):
    pass


class Ranks:
    def __init__(self, world: int, model_dir: Path, logs: Path, *, env: dict[str, str],
                 device: str = "cpu") -> None:
        self.world = world
        port = vllm_cpu.free_port()
        self.logs = [logs / f"rank{r}.log" for r in range(world)]
        self._log_files: list[IO[bytes]] = [p.open("wb") for p in self.logs]
        full_env = {**os.environ, **env}
        if device != "cpu":
            full_env["VLLM_TARGET_DEVICE"] = device
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(r), str(world), str(port), str(model_dir),
                 device],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_files[r],
                env=full_env, text=True, bufsize=1)
            for r in range(world)
        ]
        self._read_all("start")

    def call(self, call: str, target: str | None = None, arg: Any = None) -> list[Any]:
        """Every rank's answer to one call, in rank order."""
        line = json.dumps({"call": call, "target": target, "arg": arg}) + "\n"
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line)
            p.stdin.flush()
        return self._read_all(call)

    def _read_all(self, call: str) -> list[Any]:
        answers, errors = [], []
        for r, p in enumerate(self.procs):
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                errors.append(f"rank {r} exited ({p.wait()}) during {call}:\n{self.tail(r)}")
                continue
            answer = json.loads(line)
            if "error" in answer:
                errors.append(f"rank {r}: {answer['error']}")
            answers.append(answer.get("ok"))
        if errors:
            raise RankError("\n".join(errors))
        return answers

    def tail(self, rank: int, lines: int = 40) -> str:
        self._log_files[rank].flush()
        return "\n".join(self.logs[rank].read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None and p.stdin is not None:
                try:
                    p.stdin.write(json.dumps({"call": "exit"}) + "\n")
                    p.stdin.flush()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in self.procs:
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()
        for f in self._log_files:
            f.close()
