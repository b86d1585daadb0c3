"""The in-process owner a trainer calls: holds the committed baseline, publishes, advances.

:class:`Encoder` is an ``OwnerHandle`` whose baseline and candidate are canonical tensors
in memory (``ArrayCheckpoint``) or memory-mapped checkpoints. Its process form, which runs
``dcr encode`` per attempt, is :class:`dcr.owner.process.ProcessOwner`.

Every owner compares the candidate with the committed baseline only. A retry recomputes
the complete changed set from the same candidate and the unchanged baseline as absolute
overwrites (``mode="overwrite"``). The baseline advances only for a commit record that
names the candidate's version and an attempt this owner published
(:class:`~dcr.owner.state.OwnerState`). Several owners split the tensors by a stable hash
of their names (``dcr.format.layout.owner_of``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr.checkpoint import TensorSource
from dcr.format.manifest import Manifest
from dcr.format.profile import ReceiverProfile
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.owner.state import OwnerState
from dcr.protocol.records import Attempt
from dcr.transport.store import Store


@dataclass(kw_only=True)
class Encoder(OwnerState[TensorSource]):
    """In-process owner ``owner`` of ``owners``."""

    store: Store
    owners: int = 1
    profile: ReceiverProfile | None = None
    threads: int = EncodeSettings.threads
    bucket_bytes: int = EncodeSettings.bucket_bytes  # dense source bytes per payload
    manifests: list[Manifest] = field(default_factory=list)

    def publish(self, attempt: Attempt) -> None:
        candidate = self.check_publish(attempt)
        t = attempt.transition
        settings = EncodeSettings(
            version=t.target_version, base_version=t.base_version, mode=attempt.mode,
            attempt=attempt.id, owner=self.owner, owners=self.owners, profile=self.profile,
            threads=self.threads, bucket_bytes=self.bucket_bytes, attempt_manifest=True)
        self.manifests.append(diff_checkpoints(self.baseline, candidate, self.store, settings))


__all__ = ["Encoder"]
