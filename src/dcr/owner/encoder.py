"""The training-side owner: holds the committed baseline, publishes attempts, advances.

Two forms of the same ``OwnerHandle``:

* :class:`Encoder`, the in-process API a trainer calls: the baseline and the candidate
  are canonical tensors in memory (``ArrayCheckpoint``) or memory-mapped checkpoints.
* :class:`ProcessOwner`, which runs ``dcr encode`` as a separate process per attempt
  (what an encoder Job is on Kubernetes); its baseline is the committed version's
  checkpoint directory.

Both compare the candidate with the committed baseline only. A retry recomputes the
complete changed set from the same candidate and the unchanged baseline as absolute
overwrites (``mode="overwrite"``). The baseline advances only for a commit record that
names the candidate's version and an attempt this owner published. Several owners
split the tensors by a stable hash of their names (``dcr.format.layout.owner_of``).
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

from dcr.checkpoint import TensorSource
from dcr.errors import BaselineError, ConfigError, DcrError
from dcr.format.manifest import Manifest
from dcr.format.profile import ReceiverProfile
from dcr.owner.diff import DiffSettings, diff_checkpoints
from dcr.protocol.records import Attempt, CommitRecord
from dcr.transport.store import Store

log = logging.getLogger(__name__)


def _check_advance(record: CommitRecord, candidate: int | None, published: set[str],
                   who: str) -> None:
    if record.committed_version != candidate or record.attempt not in published:
        raise BaselineError(
            f"{who}: the commit record names version {record.committed_version} by attempt "
            f"{record.attempt!r}; this owner published {sorted(published)} for candidate "
            f"{candidate}. The baseline stays."
        )


@dataclass(kw_only=True)
class Encoder:
    """In-process owner ``owner`` of ``owners``."""

    store: Store
    baseline: TensorSource
    version: int  # the committed version ``baseline`` holds
    owner: int = 0
    owners: int = 1
    profile: ReceiverProfile | None = None
    threads: int = 2
    bucket_bytes: int = 256 << 20  # dense source bytes per payload (DESIGN: 64-512 MiB)
    candidate: TensorSource | None = None
    candidate_version: int | None = None
    manifests: list[Manifest] = field(default_factory=list)
    _published: set[str] = field(default_factory=set)

    def set_candidate(self, candidate: TensorSource, version: int) -> None:
        if version <= self.version:
            raise ConfigError(f"Candidate version {version} is not after the baseline "
                              f"{self.version}.")
        self.candidate, self.candidate_version = candidate, version
        self._published = set()

    def publish(self, attempt: Attempt) -> None:
        t = attempt.transition
        if self.candidate is None or (t.base_version, t.target_version) != (
                self.version, self.candidate_version):
            raise BaselineError(
                f"Owner {self.owner}: attempt {attempt.id} is {t.base_version} -> "
                f"{t.target_version}; this owner holds baseline {self.version} and "
                f"candidate {self.candidate_version}."
            )
        self._published.add(attempt.id)
        self.manifests.append(diff_checkpoints(self.baseline, self.candidate, self.store,
                                               DiffSettings(
            version=t.target_version, base_version=t.base_version, mode=attempt.mode,
            attempt=attempt.id, owner=self.owner, owners=self.owners, profile=self.profile,
            threads=self.threads, bucket_bytes=self.bucket_bytes, attempt_manifest=True)))

    def advance_baseline(self, record: CommitRecord) -> None:
        if record.committed_version == self.version and self.candidate is None:
            return  # already advanced (a coordinator finishing after failover)
        _check_advance(record, self.candidate_version, self._published, f"owner {self.owner}")
        assert self.candidate is not None
        assert self.candidate_version is not None
        self.baseline, self.version = self.candidate, self.candidate_version
        self.candidate = self.candidate_version = None


@dataclass(kw_only=True)
class ProcessOwner:
    """Runs ``dcr encode`` per attempt; ``checkpoints(v)`` is version ``v``'s directory."""

    store_uri: str
    checkpoints: Callable[[int], Path]
    version: int  # committed baseline version
    owner: int = 0
    owners: int = 1
    profile_path: Path | None = None
    bucket_mib: int = 256  # dense source MiB per payload
    env: dict[str, str] = field(default_factory=dict)  # added to the process environment
    timeout_s: float = 600.0
    candidate_version: int | None = None
    summaries: dict[str, dict[str, object]] = field(default_factory=dict)  # by attempt
    _published: set[str] = field(default_factory=set)

    def command(self, attempt: Attempt) -> list[str]:
        t = attempt.transition
        if t.base_version != self.version:
            raise BaselineError(f"Owner {self.owner}: attempt {attempt.id} is for base "
                                f"{t.base_version}; the committed baseline is {self.version}.")
        cmd = [sys.executable, "-m", "dcr", "encode",
               str(self.checkpoints(t.base_version)), str(self.checkpoints(t.target_version)),
               "--store", self.store_uri, "--base-version", str(t.base_version),
               "--version", str(t.target_version), "--attempt", attempt.id,
               "--mode", attempt.mode, "--owner", str(self.owner),
               "--owners", str(self.owners), "--bucket-mib", str(self.bucket_mib), "--json"]
        if self.profile_path is not None:
            cmd += ["--profile", str(self.profile_path)]
        return cmd

    def publish(self, attempt: Attempt) -> None:
        cmd = self.command(attempt)
        self.candidate_version = attempt.transition.target_version
        self._published.add(attempt.id)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s,
                                  check=False, env={**os.environ, **self.env})
        except subprocess.TimeoutExpired as e:
            raise DcrError(f"Encoder {self.owner} for {attempt.id} ran past "
                           f"{self.timeout_s} s.") from e
        if done.returncode != 0:
            tail = (done.stderr or "").strip().splitlines()[-3:]
            raise DcrError(f"Encoder {self.owner} for {attempt.id} exited "
                           f"{done.returncode}: {' | '.join(tail)}")
        self.summaries[attempt.id] = json.loads(done.stdout)
        log.debug("encoder %s: %s", self.owner, self.summaries[attempt.id])

    def advance_baseline(self, record: CommitRecord) -> None:
        if record.committed_version == self.version:
            return
        _check_advance(record, self.candidate_version, self._published,
                       f"encoder {self.owner}")
        self.version = record.committed_version
        self._published = set()
