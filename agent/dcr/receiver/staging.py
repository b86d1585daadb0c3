"""The staging directory the agent shares with its serving engine.

A file appears whole (a dot-prefixed temporary name, then a rename) under a name made only
from the payload's ids, and only files of the staged shape are ever removed: the engine's own
live here too (docs/engines.md, "The staging volume"). A write the volume cannot take (full,
or not writable) leaves no part of the file behind and fails the attempt naming the directory.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from dcr.drivers.base import staged_name
from dcr.errors import AttemptError
from dcr.format.payload import Payload

STAGED_FILE = re.compile(r"\.?(?P<attempt>[A-Za-z0-9][A-Za-z0-9._-]*)-o\d{4,}-s\d{6,}\.dcrp"
                         r"(\.tmp)?")


class StagingError(AttemptError):
    """The staging directory cannot take a payload (its volume is full, or it is not
    writable); nothing of the payload stays there."""


class StagingDir:
    """Payload files in one directory, written atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)

    def write(self, payload: Payload) -> str:
        """Write a verified payload; its file name."""
        h = payload.header
        name = staged_name(h.attempt, h.owner, h.seq)
        tmp = self.path / f".{name}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(payload.data)
                f.flush()
            os.replace(tmp, self.path / name)
        except OSError as e:  # a write's ENOSPC names no file: say which directory
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StagingError(
                f"The staging directory {self.path} cannot take payload {name} "
                f"({payload.size} bytes; {self.free_bytes()} bytes free): "
                f"{e.strerror or e}. Free space on its volume (a pod's sizeLimit), or "
                "lower --staging-mib below it.") from e
        return name

    def free_bytes(self) -> int | None:
        """What the directory's volume has free for this user, or None if unreadable."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / name).unlink()

    def clear(self, attempt: str | None = None) -> int:
        """Remove every staged file (of ``attempt`` only, when given); how many."""
        removed = 0
        for p in self.path.iterdir():
            m = STAGED_FILE.fullmatch(p.name)
            if m and (attempt is None or m["attempt"] == attempt) and not p.is_dir():
                self.remove(p.name)
                removed += 1
        return removed


__all__ = ["STAGED_FILE", "StagingDir", "StagingError"]
