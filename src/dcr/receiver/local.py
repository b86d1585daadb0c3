"""In-process receivers: the agent's service behind the coordinator's ``ReceiverHandle``.

The HTTP agent (``dcr agent``) and :class:`LocalReceiver` run the same
:class:`~dcr.receiver.service.AgentService`; the local form skips the network, for the
embedded demo, trainers that host rollout ranks in process, and tests. The owner side
needs no adapter: :class:`dcr.owner.encoder.Encoder` is already an ``OwnerHandle``.
"""

from __future__ import annotations

import time

from dcr.protocol.agent_api import AgentStatus, AttemptRef, AttemptSpec, DenseRequest, FlushAck
from dcr.protocol.records import Attempt
from dcr.receiver.service import AgentService


class LocalReceiver:
    """A ``ReceiverHandle`` calling an ``AgentService`` directly."""

    def __init__(self, service: AgentService) -> None:
        self.service = service
        self.name = service.name

    @staticmethod
    def _ref(attempt: Attempt) -> AttemptRef:
        return AttemptRef(attempt=attempt.id, timeout_s=max(0.1, attempt.deadline - time.time()))

    def status(self) -> AgentStatus:
        return self.service.status()

    def prepare(self, attempt: Attempt) -> None:
        self.service.prepare(AttemptSpec.of(attempt))

    def close_gate(self) -> None:
        self.service.close_gate()

    def open_gate(self) -> None:
        self.service.open_gate()

    def open_apply(self, attempt: Attempt) -> None:
        self.service.open_apply(self._ref(attempt))

    def wait_staged(self, attempt: Attempt) -> None:
        self.service.wait_staged(self._ref(attempt))

    def flush(self, attempt: Attempt) -> FlushAck:
        return self.service.flush(self._ref(attempt))

    def committed(self, attempt: str) -> None:
        self.service.committed(AttemptRef(attempt=attempt))

    def stop_and_wait(self, attempt: str) -> None:
        self.service.stop_and_wait(AttemptRef(attempt=attempt))

    def rejoin(self, version: int, checkpoint: str) -> None:
        self.service.dense(DenseRequest(version=version, checkpoint=checkpoint))
