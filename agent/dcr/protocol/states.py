"""Every state status speaks of: one documented constant each, said once.

* :class:`AttemptState`: where an agent's current attempt stands (its ``GET /v1/status``,
  and a RolloutFleet's ``status.receivers[].state``); the transitions are ``state.py``'s.
* :class:`ReceiverStep` and :data:`REFIT_RECEIVER_STATES`: what a WeightRefit's
  ``status.receivers[].state`` says of a receiver after each call the operator made to it.
* :class:`Phase`: a WeightRefit's ``status.phase``.
* :class:`AttemptOutcome`: ``status.attempts[].outcome`` of a WeightRefit.

The agent, the operator and the CRDs' descriptions and printer columns
(``dcr_operator/api``) all take the words from here, and tests/unit/test_states.py holds
the CRD text to them. The operator imports this module, so it imports only the standard
library.
"""

from __future__ import annotations

import enum
from typing import Final


class AttemptState(enum.Enum):
    """Where an agent's current attempt stands (docs/protocol.md); unset between attempts."""

    PREPARED = "prepared"
    """The agent knows the attempt id; other attempts' payloads are dropped."""
    STREAMING = "streaming"
    """Owners send payloads; the agent validates and stages them."""
    STAGED = "staged"
    """Every expected payload is staged (asynchronous RL waits here for the gate)."""
    GATE_CLOSED = "gate_closed"
    """The engine takes no new generation requests; its weights may change."""
    APPLYING = "applying"
    """The engine applies the staged payloads in their declared order."""
    FLUSHED = "flushed"
    """Every payload applied, the devices synchronized and the fingerprints checked."""
    COMMITTED = "committed"
    """The commit record names the attempt's target version (final)."""
    OBSOLETE = "obsolete"
    """Abandoned (final): none of its writes may still happen once it is stopped."""


class ReceiverStep:
    """What a WeightRefit's status says of a receiver besides the attempt states its
    agent's answers imply (:data:`REFIT_RECEIVER_STATES` lists them all)."""

    STOPPED: Final = "stopped"
    """The operator stopped the receiver's attempt (its agent holds it as obsolete)."""
    REJOINING: Final = "rejoining"
    """The receiver restores the committed version by a dense load."""
    REJOINED: Final = "rejoined"
    """The receiver restored the committed version by a dense load."""

    @staticmethod
    def failed(call: str) -> str:
        """The state of a receiver whose agent call ``call`` failed (its error beside it)."""
        return f"{call} failed"


REFIT_RECEIVER_STATES: Final = (
    AttemptState.PREPARED.value, AttemptState.STAGED.value, AttemptState.APPLYING.value,
    AttemptState.FLUSHED.value, AttemptState.COMMITTED.value,
    ReceiverStep.STOPPED, ReceiverStep.REJOINING, ReceiverStep.REJOINED,
)
"""Every state a WeightRefit's status gives a receiver but :meth:`ReceiverStep.failed`'s."""


class Phase(enum.StrEnum):
    """A WeightRefit's phase: the first true of its Committed, Failed, Encoding and Applying
    conditions (``api/conditions.py``), Pending while none is."""

    PENDING = "Pending"
    """No attempt runs yet: the refit waits for its base version, receivers or profile."""
    ENCODING = "Encoding"
    """The encoders publish an attempt's payloads (receivers may apply meanwhile)."""
    APPLYING = "Applying"
    """An attempt runs on the receivers; every payload is published."""
    COMMITTED = "Committed"
    """The fleet's commit record names the target version (final)."""
    FAILED = "Failed"
    """The refit gave up; its Failed condition says why (final)."""


FINAL_PHASES: Final = frozenset({Phase.COMMITTED, Phase.FAILED})
"""The phases a WeightRefit never leaves."""


class AttemptOutcome(enum.StrEnum):
    """How one attempt of a WeightRefit ended, or that it has not."""

    RUNNING = "Running"
    """The attempt has started and not ended."""
    COMMITTED = "Committed"
    """The attempt wrote the fleet's commit record: the fleet holds the target version."""
    FAILED = "Failed"
    """The attempt ended without a commit; its reason says why (the next one overwrites)."""
    CONFLICT = "Conflict"
    """Another writer changed the fleet's commit record during the attempt."""
    ABANDONED = "Abandoned"
    """The operator restarted during the attempt; the protocol makes it obsolete."""
