"""Parts of the fault campaign's fleet beyond the main job's pods: a relay tree of ``dcr
relay`` processes that can be killed and restarted one node at a time, and each pod's
staging volume as a small filesystem of its own (a tmpfs with ``size=``, as a pod's
``emptyDir`` with ``medium: Memory`` and a ``sizeLimit``) that a filler file can fill.

``dcr relay`` prints no listening line, so a node is ready once its ``/healthz`` answers
(``dcr.refit.job.start_relays`` waits the same way). docs/faults.md.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from dcr.errors import DcrError
from dcr.http.direct import OPENER
from dcr.http.tokens import write_token_file
from dcr.refit.launch import START_TIMEOUT_S, Process, free_port

FILLER = "campaign-filler"  # no staged file's shape: the agent never removes it


@dataclass(kw_only=True)
class RelayNode(Process):
    """``dcr relay``, one member of the tree: ``args`` after --listen."""

    command: ClassVar[str] = "relay"
    workdir: Path

    @property
    def directory(self) -> Path:
        return self.workdir

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, object]:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with OPENER.open(self.url + "/healthz", timeout=2):
                    return {"url": self.url}
            except OSError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise DcrError(f"Relay node {self.name} ({self.url}) did not start: "
                                   f"{e}.") from e
                time.sleep(0.05)


@dataclass(frozen=True, kw_only=True)
class RelayTree:
    """The nodes (the first is the root) and the token files: agents get the read token,
    the owners the publish token."""

    nodes: list[RelayNode]
    read_token_file: Path
    publish_token_file: Path = field(repr=False)

    def publish_uri(self, store: str) -> str:
        """Where owners publish: the root, every object written through to ``store`` (the
        fleet's history, docs/relay.md, "History and catch-up")."""
        return f"relay+{self.nodes[0].url}?through={store}"


def relay_tree(work: Path, n: int) -> RelayTree:
    """``n`` relay nodes in one tree (fan-out 2: with 4, the root, an intermediate node
    and two leaves), not yet started."""
    work.mkdir(parents=True, exist_ok=True)
    read = write_token_file(work / "read-token", secrets.token_hex(16))
    publish = write_token_file(work / "publish-token", secrets.token_hex(16))
    ports = [free_port() for _ in range(n)]
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    nodes = [RelayNode(name=f"relay-{i}", port=p, workdir=work / f"relay-{i}",
                       args=["--members", members, "--index", str(i), "--token-file", str(read),
                             "--publish-token-file", str(publish),
                             "--spool", str(work / f"relay-{i}" / "spool")])
             for i, p in enumerate(ports)]
    for node in nodes:
        (node.workdir / "spool").mkdir(parents=True, exist_ok=True)
    return RelayTree(nodes=nodes, read_token_file=read, publish_token_file=publish)


@contextlib.contextmanager
def small_volume(path: Path, size_bytes: int) -> Iterator[bool]:
    """Mount a tmpfs of ``size_bytes`` at ``path`` for the block; unmounted on the way out,
    even after a failure (lazily if a process still holds it). Yields whether it is
    mounted: mounting needs root (and a container that lets root mount), and without it
    the directory stays as it was."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)],
            check=False, capture_output=True).returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        if subprocess.run(["umount", str(path)], check=False,
                          capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill(volume: Path, leave_bytes: int) -> int:
    """Fill ``volume`` with a filler file until ``leave_bytes`` (or less) stay free; the
    filler's size."""
    st = os.statvfs(volume)
    size = max(0, st.f_bavail * st.f_frsize - leave_bytes)
    with open(volume / FILLER, "wb") as f:
        if size:
            os.posix_fallocate(f.fileno(), 0, size)
    return size


def free(volume: Path) -> None:
    (volume / FILLER).unlink(missing_ok=True)


__all__ = ["FILLER", "RelayNode", "RelayTree", "fill", "free", "relay_tree", "small_volume"]
