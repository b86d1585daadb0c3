"""The owner as a process per attempt: ``dcr encode``, what an encoder Job is on Kubernetes.

Each ``publish`` of :class:`ProcessOwner` runs ``python -m dcr encode`` on the attempt's base
and target checkpoints, with the command line of
:meth:`EncodeSettings.argv <dcr.owner.settings.EncodeSettings.argv>`, and waits for its JSON
summary; its rules are :class:`~dcr.owner.state.OwnerState`'s.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from dcr.errors import BaselineError, DcrError
from dcr.owner.settings import EncodeSettings
from dcr.owner.state import OwnerState
from dcr.protocol.records import Attempt
from dcr.settings import MiB

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ProcessOwner(OwnerState[Path]):
    """Runs ``dcr encode`` per attempt; ``checkpoints(v)`` is version ``v``'s directory."""

    role: ClassVar[str] = "encoder"

    store_uri: str
    checkpoints: Callable[[int], Path]
    baseline: Path = field(init=False)  # checkpoints(version)
    owners: int = 1
    profile_path: Path | None = None
    bucket_mib: int = EncodeSettings.bucket_bytes // MiB  # dense source MiB per payload
    env: dict[str, str] = field(default_factory=dict)  # added to the process environment
    timeout_s: float = 600.0
    summaries: dict[str, dict[str, object]] = field(default_factory=dict)  # by attempt

    def __post_init__(self) -> None:
        self.baseline = self.checkpoints(self.version)

    def command(self, attempt: Attempt) -> list[str]:
        """The ``dcr encode`` process that publishes this owner's part of ``attempt``."""
        t = attempt.transition
        if t.base_version != self.version:
            raise BaselineError(f"{self.who}: attempt {attempt.id} is for base "
                                f"{t.base_version}; the committed baseline is {self.version}.")
        settings = EncodeSettings(
            target_version=t.target_version, base_version=t.base_version, mode=attempt.mode,
            attempt=attempt.id, owner=self.owner, owners=self.owners,
            bucket_bytes=self.bucket_mib * MiB, profile_path=self.profile_path)
        return [sys.executable, "-m", "dcr",
                *settings.argv(str(self.baseline), str(self.checkpoints(t.target_version)),
                               store=self.store_uri)]

    def publish(self, attempt: Attempt) -> None:
        cmd = self.command(attempt)
        target = attempt.transition.target_version
        if self.candidate_version != target:
            self.set_candidate(self.checkpoints(target), target)
        self.check_publish(attempt)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s,
                                  check=False, env={**os.environ, **self.env})
        except subprocess.TimeoutExpired as e:
            raise DcrError(f"{self.who} for {attempt.id} ran past {self.timeout_s} s.") from e
        if done.returncode != 0:
            tail = (done.stderr or "").strip().splitlines()[-3:]
            raise DcrError(f"{self.who} for {attempt.id} exited {done.returncode}: "
                           f"{' | '.join(tail)}")
        self.summaries[attempt.id] = json.loads(done.stdout)
        log.debug("encoder %s: %s", self.owner, self.summaries[attempt.id])


__all__ = ["ProcessOwner"]
