"""FSDP2 training ranks as processes (:mod:`fsdp2_rank`), each serving its shards as an owner.

:meth:`TrainerRanks.start` starts ``world`` gloo ranks from a checkpoint and waits for
each rank's endpoint URL; :meth:`TrainerRanks.step` has every rank take an optimizer step
and offer the version (together: the step is collective); leaving the ``with`` block
ends them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from stubs import free_port_on

WORKER = Path(__file__).resolve().parent / "fsdp2_rank.py"


def _line(stream: IO[str] | None, logs: Path) -> str:
    assert stream is not None
    line = stream.readline()
    assert line, f"a rank exited; its log is under {logs}"
    return line


@dataclass
class TrainerRanks:
    procs: list[subprocess.Popen[str]]
    urls: list[str]
    out: Path  # rank 0 writes each version's dense export here, for the test alone

    @classmethod
    def start(cls, world: int, checkpoint: Path, version: int, store: str, token: str,
              workdir: Path, layout: str = "fsdp", worker: Path = WORKER) -> TrainerRanks:
        """``layout``: as :mod:`fsdp2_rank` takes it (``fsdp``, ``hsdp``, ``fsdp-tp``);
        ``worker``: a rank script taking :mod:`fsdp2_rank`'s arguments."""
        token_file = workdir / "rank-token"
        token_file.write_text(token)
        port = free_port_on("127.0.0.1")
        procs = []
        for r in range(world):
            with (workdir / f"rank{r}.log").open("w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(worker), str(r), str(world), str(port),
                     str(checkpoint), str(version), store, str(token_file), str(workdir),
                     layout],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True))
        ranks = cls(procs=procs, urls=[], out=workdir)
        try:
            ranks.urls = [json.loads(_line(p.stdout, workdir))["url"] for p in procs]
        except BaseException:
            ranks.close()
            raise
        return ranks

    def step(self, version: int) -> list[int]:
        """Every rank steps and offers ``version``; the elements each offer changed."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"step": version}) + "\n")
            p.stdin.flush()
        return [int(json.loads(_line(p.stdout, self.out))["changed"]) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()

    def __enter__(self) -> TrainerRanks:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
