"""The seam between the DCR agent and a serving engine: what the agent needs of one.

:class:`Driver` has one method per thing the protocol needs (docs/engines.md, "The calls").
What crosses it is plain and torch-free: tensors as :class:`TensorSpec`, staged payloads by
file name (:func:`check_staged_name`), checkpoints by a path under the engine's checkpoint
root (:func:`check_checkpoint_path`), an apply as each rank's :class:`ApplyOutcome`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal, Protocol

from dcr.errors import ConfigError
from dcr.format.profile import ReceiverProfile

PauseMode = Literal["abort", "wait", "keep"]
"""How a pause treats generation in flight: ``abort`` ends it at once, ``wait`` lets it
finish (the sync-RL gate: every rollout ends on one version), ``keep`` freezes it where
it is and continues it after ``resume`` (partial rollouts). New requests are refused
(vLLM: 503) under ``abort`` and ``wait`` and held under ``keep``."""

STAGED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # a file in the staging dir


class TensorSpec(Protocol):
    """A canonical tensor as a checkpoint or manifest names it (``CanonicalTensor`` and
    the manifest's ``TensorEntry`` are both one)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...  # safetensors name: "BF16", "F32", ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, kw_only=True)
class CanonicalSpec:
    """A :class:`TensorSpec` as a value (the agent reads them from a checkpoint's
    headers, without torch)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Prewarmed:
    """What prewarm found on every rank."""

    profile: ReceiverProfile  # the ranks' profiles merged
    # Layers some rank computes from a form the engine derived after loading and whose
    # loading form DCR keeps only from a dense load through it, not made yet: until one
    # is, the engine can be refit only densely (docs/derived-weights.md, "Weights an engine
    # derives after loading").
    unfilled: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ApplyOutcome:
    """What every rank reported for one apply, in rank order, as the plugin sent it
    (``docs/engines.md`` lists the fields)."""

    reports: tuple[Mapping[str, Any], ...]

    @property
    def seconds(self) -> float:
        """The slowest rank's time inside the apply (the sum of its ``*_s`` fields)."""
        return max((sum(float(v) for k, v in r.items()
                        if k.endswith("_s") and isinstance(v, int | float))
                    for r in self.reports), default=0.0)

    @property
    def names(self) -> frozenset[str]:
        """The canonical tensors any rank wrote."""
        return frozenset(n for r in self.reports for n in r.get("names", ()))


class Driver(Protocol):
    """A serving engine as the agent drives it. Every call blocks until the engine has
    done it (or raises :class:`~dcr.drivers.errors.EngineError`, which names the call)."""

    def instance(self) -> str:
        """An id of the running engine that changes whenever any rank's process
        restarts: a new id means the weights are unknown (dense rejoin)."""
        ...

    def prewarm(self, tensors: Iterable[TensorSpec]) -> Prewarmed:
        """Reserve scratch and classify every canonical tensor on every rank: the ranks'
        profiles merged (the most demanding class of any rank wins), and the layers
        that need a dense load first."""
        ...

    def apply(self, payloads: Sequence[str]) -> ApplyOutcome:
        """Apply staged payload files (names in the shared staging directory), as one
        set in the order given, on every rank."""
        ...

    def sync(self) -> None:
        """Return once every rank's device has finished every write."""
        ...

    def fingerprint(self) -> list[dict[str, str]]:
        """Per rank (index = rank): xxh3-128 of every parameter and buffer's bits."""
        ...

    def check_targets(self, expect: Mapping[str, str]) -> dict[str, str]:
        """The tensors among ``expect`` (canonical name -> fingerprint) that some rank
        holds whole on a bit-preserving path and whose bits differ, each with the
        fingerprint a rank holds; the other tensors are not checked (no rank can
        recompute their canonical bits)."""
        ...

    def load_dense(self, checkpoint: str, expect: Mapping[str, str] | None = None) -> None:
        """Load a whole checkpoint (a path relative to the engine's checkpoint root)
        through the same loader; with ``expect`` (canonical name -> fingerprint) a rank
        refuses the checkpoint before writing anything if a tensor differs."""
        ...

    def check_dense(self, checkpoint: str, expect: Mapping[str, str] | None = None) -> None:
        """Every check :meth:`load_dense` makes, on every rank, and no write: a refusal
        here leaves the weights certainly as they were."""
        ...

    def pause(self, mode: PauseMode = "wait") -> None:
        """Close the request gate (see :data:`PauseMode`); returns once it is closed."""
        ...

    def resume(self) -> None:
        """Open the request gate."""
        ...

    def set_version(self, label: str) -> None:
        """Set the weight-version label the engine reports with its outputs."""
        ...

    def version(self) -> str | None:
        """The engine's weight-version label."""
        ...

    def health(self) -> bool:
        """Whether the engine answers its health check (False when unreachable)."""
        ...


def check_staged_name(name: str) -> str:
    """``name`` if it is a plain file name in the staging directory (no separator, no
    leading dot, no ``..``, at most 255 characters of ``[A-Za-z0-9._-]``), else
    :class:`ConfigError`."""
    if not STAGED_NAME.fullmatch(name) or ".." in name:
        raise ConfigError(f"Staged payload name {name[:80]!r} is not a plain file name "
                          "(letters, digits, '.', '_', '-'; no leading dot, '/' or '..').")
    return name


def staged_name(attempt: str, owner: int, seq: int) -> str:
    """The file name a payload is staged under: its attempt, owner and sequence
    (``a-7f2c...-o0000-s000003.dcrp``), checked as :func:`check_staged_name` does."""
    return check_staged_name(f"{attempt}-o{owner:04d}-s{seq:06d}.dcrp")


def merge_fingerprints(ranks: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """One mapping for an engine's per-rank fingerprints: a single rank's as it is; with
    several, each name prefixed by its rank (``rank1/model.norm.weight``), because the
    ranks hold different shards under the same names."""
    if len(ranks) == 1:
        return dict(ranks[0])
    return {f"rank{r}/{name}": fp for r, held in enumerate(ranks) for name, fp in held.items()}


def check_checkpoint_path(path: str) -> str:
    """``path`` if it is relative with no empty, ``.`` or ``..`` segment, else
    :class:`ConfigError`: the engine resolves it under its own checkpoint root."""
    if (not path or PurePosixPath(path).is_absolute() or "\\" in path or "\x00" in path
            or any(part in ("", ".", "..") for part in path.split("/"))):
        raise ConfigError(f"Checkpoint {path[:120]!r} must be a relative path without '.', "
                          "'..' or empty segments (the engine resolves it under its "
                          "checkpoint root).")
    return path


__all__ = ["ApplyOutcome", "CanonicalSpec", "Driver", "PauseMode", "TensorSpec",
           "check_checkpoint_path", "check_staged_name", "merge_fingerprints", "staged_name"]
