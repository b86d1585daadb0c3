"""In-process owner and receivers: the coordinator's parties on one machine.

The embedded default for the demo and tests: an owner holds its baseline and a
candidate as canonical tensors in memory and publishes attempts to a store; each
receiver applies through an :class:`~dcr.apply.engine.ApplyEngine`, receiving the
attempt's payloads as they land. The agent's HTTP API and the encoder Job will stand
behind the same ``ReceiverHandle`` and ``OwnerHandle`` calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dcr.apply.engine import ApplyEngine
from dcr.checkpoint import TensorSource
from dcr.files.diff import DiffSettings, diff_checkpoints
from dcr.format.payload import Payload
from dcr.format.profile import ReceiverProfile
from dcr.protocol.records import Attempt, CommitRecord
from dcr.transport.receive import StoreSource, receive
from dcr.transport.store import Store


@dataclass(kw_only=True)
class InProcessOwner:
    """Compares the candidate with the committed baseline; advances only on commit."""

    store: Store
    baseline: TensorSource
    candidate: TensorSource
    profile: ReceiverProfile | None = None

    def publish(self, attempt: Attempt) -> None:
        t = attempt.transition
        diff_checkpoints(self.baseline, self.candidate, self.store, DiffSettings(
            version=t.target_version, base_version=t.base_version, mode=attempt.mode,
            attempt=attempt.id, profile=self.profile))

    def advance_baseline(self, record: CommitRecord) -> None:
        self.baseline = self.candidate


@dataclass(kw_only=True)
class InProcessReceiver:
    """A rank applying through its runtime's loader; ``obsolete`` drops late attempts."""

    name: str
    engine: ApplyEngine
    store: Store
    current: str | None = None
    obsolete: set[str] = field(default_factory=set)

    def prepare(self, attempt: Attempt) -> None:
        self.current = attempt.id

    def close_gate(self) -> None:
        self.engine.runtime.close_gate()

    def apply(self, attempt: Attempt) -> None:
        if attempt.id != self.current or attempt.id in self.obsolete:
            raise RuntimeError(f"{self.name}: attempt {attempt.id} is not the prepared one.")
        source = StoreSource(store=self.store, version=attempt.transition.target_version,
                             attempt=attempt.id)

        def apply_one(payload: Payload) -> None:
            self.engine.apply_payloads([bytes(payload.data)])

        receive(source, attempt.id, apply_one, timeout_s=max(1.0, attempt.deadline - time.time()))

    def stop_and_wait(self, attempt: Attempt) -> None:
        # In process, apply returns only after its last write: nothing is still running.
        self.obsolete.add(attempt.id)
        self.current = None

    def open_gate(self) -> None:
        self.engine.runtime.open_gate()
