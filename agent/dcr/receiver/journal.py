"""The agent's local journal: its attempt, whether it wrote, and its engine instance.

One small JSON file, replaced atomically (write, fsync, rename, fsync the directory) before
every step that matters (docs/protocol.md, "What the weights hold").
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from dcr.errors import ExternalError


class JournalError(ExternalError):
    """The journal cannot be read or written."""


@dataclass(frozen=True, kw_only=True)
class JournalEntry:
    version: int | None  # the version the weights held when written; None: unknown
    dirty: tuple[int, int] | None  # (base, target) of writes not settled by commit or dense
    attempt: str | None
    state: str | None  # an AttemptState value
    instance: str | None = None  # the engine instance the weights hold ``version`` under


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> JournalEntry | None:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise JournalError(f"Journal {self.path} is unreadable: {e}.") from e
        try:
            dirty = raw["dirty"]
            instance = raw.get("instance")
            if instance is not None and not isinstance(instance, str):
                raise TypeError(f"instance is a {type(instance).__name__}")
            return JournalEntry(version=raw["version"], attempt=raw["attempt"],
                                state=raw["state"], instance=instance,
                                dirty=None if dirty is None else (int(dirty[0]), int(dirty[1])))
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise JournalError(f"Journal {self.path} is malformed: {e!r}.") from e

    def save(self, entry: JournalEntry) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(entry), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
