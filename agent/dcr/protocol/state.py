"""The life of an attempt, as a table of allowed transitions between its states
(:class:`~dcr.protocol.states.AttemptState`, where each is documented; docs/protocol.md).

Synchronous RL closes the gate while payloads stream (``streaming -> gate_closed``),
asynchronous RL once all are staged (``staged -> gate_closed``). Any state before
``committed`` may become ``obsolete``; both are final.
"""

from __future__ import annotations

from dcr.errors import StateConflict
from dcr.protocol.states import AttemptState


class IllegalTransition(StateConflict):
    """An attempt was asked to move to a state it cannot reach from where it is."""


_S = AttemptState
_NEXT: dict[AttemptState, frozenset[AttemptState]] = {
    _S.PREPARED: frozenset({_S.STREAMING, _S.GATE_CLOSED}),  # sync RL closes the gate first
    _S.STREAMING: frozenset({_S.STAGED, _S.GATE_CLOSED}),  # sync RL applies while streaming
    _S.STAGED: frozenset({_S.GATE_CLOSED, _S.APPLYING}),  # the gate may already be closed
    _S.GATE_CLOSED: frozenset({_S.STREAMING, _S.APPLYING}),
    _S.APPLYING: frozenset({_S.FLUSHED}),
    _S.FLUSHED: frozenset({_S.COMMITTED}),
    _S.COMMITTED: frozenset(),
    _S.OBSOLETE: frozenset(),
}
FINAL = frozenset({_S.COMMITTED, _S.OBSOLETE})


def advance(attempt: str, current: AttemptState, to: AttemptState) -> AttemptState:
    """The new state, or :class:`IllegalTransition` naming both ends."""
    if to is _S.OBSOLETE and current not in FINAL:
        return to
    if to not in _NEXT[current]:
        reachable = set(_NEXT[current]) | (set() if current in FINAL else {_S.OBSOLETE})
        allowed = sorted(s.value for s in reachable)
        raise IllegalTransition(
            f"Attempt {attempt} cannot go from {current.value} to {to.value}; "
            f"allowed: {allowed or 'nothing (final)'}."
        )
    return to
