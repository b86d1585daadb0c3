"""The life of an attempt, as a table of allowed transitions (docs/protocol.md).

Synchronous RL closes the gate while payloads stream (``streaming -> gate_closed``),
asynchronous RL once all are staged (``staged -> gate_closed``). Any state before
``committed`` may become ``obsolete``; both are final.
"""

from __future__ import annotations

import enum

from dcr.errors import DcrError


class AttemptState(enum.Enum):
    PREPARED = "prepared"  # receivers know the attempt id; other attempts' payloads dropped
    STREAMING = "streaming"  # owners send payloads; receivers validate and stage them
    STAGED = "staged"  # every expected payload is staged (asynchronous RL waits here)
    GATE_CLOSED = "gate_closed"  # no new generation requests; weights may change
    APPLYING = "applying"  # open_apply: payloads applied in declared order
    FLUSHED = "flushed"  # every receiver acknowledged: all applied, devices synced, checked
    COMMITTED = "committed"  # the commit record names the target version
    OBSOLETE = "obsolete"  # abandoned; none of its writes may still happen once stopped


class IllegalTransition(DcrError):
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
