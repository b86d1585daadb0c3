"""The warm owner form: an in-process encoder over memory-mapped checkpoint directories.

:class:`WarmOwner` is an :class:`~dcr.owner.encoder.Encoder` over checkpoints named by
version, the candidate opened at its first publish (a retry reuses it); ``dcr refit`` runs
its owners this way by default. A checkpoint's maps are dropped once it is neither baseline
nor candidate, since drivers delete old versions: no deleted file stays mapped.
``summaries`` holds what ``dcr encode --json`` prints, so drivers read both forms alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcr.checkpoint import Checkpoint, TensorSource
from dcr.errors import BaselineError
from dcr.owner.encoder import Encoder
from dcr.protocol.records import Attempt, CommitRecord
from dcr.transport.store import Store

log = logging.getLogger(__name__)


def close_source(source: TensorSource | None) -> None:
    """Drop a checkpoint's memory maps (their files close once no view is left)."""
    if isinstance(source, Checkpoint):
        source.close()


@dataclass(kw_only=True)
class WarmOwner(Encoder):
    """An in-process owner whose baseline and candidate are checkpoint directories,
    memory-mapped; ``summaries`` holds what ``dcr encode --json`` would print, by attempt."""

    checkpoints: Callable[[int], Path]
    summaries: dict[str, dict[str, object]] = field(default_factory=dict)  # by attempt

    @classmethod
    def open(cls, *, checkpoints: Callable[[int], Path], version: int, store: Store,
             **kw: Any) -> WarmOwner:
        """An owner whose baseline is ``checkpoints(version)``, committed."""
        return cls(baseline=Checkpoint(checkpoints(version)), version=version, store=store,
                   checkpoints=checkpoints, **kw)

    def publish(self, attempt: Attempt) -> None:
        t = attempt.transition
        if t.base_version != self.version:
            raise BaselineError(f"{self.who}: attempt {attempt.id} is for base "
                                f"{t.base_version}; the committed baseline is {self.version}.")
        if self.candidate_version != t.target_version:
            close_source(self.candidate)  # a candidate whose refit failed is never published again
            self.candidate = self.candidate_version = None
            self.set_candidate(Checkpoint(self.checkpoints(t.target_version)), t.target_version)
        super().publish(attempt)
        m = self.manifests[-1]
        self.summaries[attempt.id] = {
            **m.stats.model_dump(), "payloads": len(m.payloads), "attempt": m.attempt,
            "base_version": m.base_version, "version": m.target_version, "mode": m.mode}
        log.debug("warm owner %s: %s", self.owner, self.summaries[attempt.id])

    def advance_baseline(self, record: CommitRecord) -> None:
        old = self.baseline
        super().advance_baseline(record)
        if self.baseline is not old:
            close_source(old)

    def close(self) -> None:
        close_source(self.baseline)
        close_source(self.candidate)
