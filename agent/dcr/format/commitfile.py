"""The commit file: the committed version and the digest of the history its commit wrote,
as the operator publishes them to a fleet's pods.

The operator keeps one ConfigMap per RolloutFleet holding this file under
:data:`COMMIT_FILE_KEY`, written wherever it writes ``status.commit``; rollout pods mount
it (an ``optional`` volume: no API token) and ``dcr materialize`` and ``dcr mirror`` take
it as ``--commit-file``, so whoever writes the store cannot choose the version they build
nor the history that vouches for it. One file, so a reader never pairs a version with
another commit's digest (a kubelet swaps a ConfigMap volume's files in one rename).
docs/two-clusters.md, "What a pod is told".
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr.errors import ConfigError, first_validation_error
from dcr.format.names import DIGEST_PATTERN
from dcr.versions import COMMIT_FILE

COMMIT_FILE_KEY = "commit.json"  # the ConfigMap's key, so the file's name in its volume
MAX_COMMIT_FILE_BYTES = 1024  # the file is ~120 bytes; anything larger is not ours
MAX_VERSION = (1 << 63) - 1  # what the commit record's integer holds


class CommitFile(BaseModel):
    """What the fleet's commit record says was committed last."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format: Literal["dcr-commit"] = "dcr-commit"
    format_version: Literal[1] = 1
    committed_version: Annotated[int, Field(ge=0, le=MAX_VERSION)]
    # None: the record carries no digest (its commit wrote no history, or it is the
    # fleet's initial record); the version is still pinned.
    history_digest: Annotated[str | None, Field(pattern=DIGEST_PATTERN)] = None

    def pack(self) -> str:
        return self.model_dump_json()

    @classmethod
    def parse(cls, data: bytes, where: str) -> CommitFile:
        """``data`` as a commit file; :class:`ConfigError` naming ``where`` and the first
        thing wrong otherwise."""
        if len(data) > MAX_COMMIT_FILE_BYTES:
            raise ConfigError(f"Commit file {where} is over {MAX_COMMIT_FILE_BYTES} bytes: "
                              "it is not one the operator wrote.")
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            COMMIT_FILE.refuse_invalid(e, f"Commit file {where}", ConfigError)
            got = repr(e.errors()[0].get("input"))[:80]
            raise ConfigError(f"Commit file {where}: {first_validation_error(e)} (got "
                              f"{got}).") from e


def read_commit_file(path: Path) -> CommitFile | None:
    """The commit file at ``path``; None when there is none (an optional volume before the
    operator wrote it). Reads at most one byte past the bound."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_COMMIT_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"Cannot read the commit file {path}: {e}") from e
    return CommitFile.parse(data, str(path))
