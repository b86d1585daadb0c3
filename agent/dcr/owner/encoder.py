"""The in-process owner a trainer calls: holds the committed baseline, publishes, advances.

:class:`Encoder` is an ``OwnerHandle`` over canonical tensors in memory or memory-mapped
checkpoints; when it may publish and advance is :class:`~dcr.owner.state.OwnerState`'s.
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
    threads: int | None = EncodeSettings.threads  # None: the cores this process may use
    bucket_bytes: int = EncodeSettings.bucket_bytes  # dense source bytes per payload
    manifests: list[Manifest] = field(default_factory=list)

    def publish(self, attempt: Attempt) -> None:
        candidate = self.check_publish(attempt)
        t = attempt.transition
        settings = EncodeSettings(
            target_version=t.target_version, base_version=t.base_version, mode=attempt.mode,
            attempt=attempt.id, owner=self.owner, owners=self.owners, profile=self.profile,
            threads=self.threads, bucket_bytes=self.bucket_bytes, attempt_manifest=True)
        self.manifests.append(diff_checkpoints(self.baseline, candidate, self.store, settings))


__all__ = ["Encoder"]
