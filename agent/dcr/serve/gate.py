"""The reference server's request gate: vLLM's ``/pause`` modes, between greedy steps.

A completion is admitted, passes :meth:`PauseGate.step` before every token, and leaves.
:meth:`PauseGate.pause` returns once generation is out of the way: ``wait`` drains those in
flight, ``abort`` stops them at their next step (both refuse new ones), ``keep`` parks them
and holds new ones until :meth:`PauseGate.resume`. A step never holds the gate's lock while
the model runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from dcr.errors import Interrupted, TryLater

Mode = Literal["abort", "wait", "keep"]


class Paused(TryLater):
    """The gate refuses new completions (vLLM answers 503 until /resume)."""


class Aborted(Interrupted):
    """A pause in ``abort`` mode ended this completion."""


@dataclass(kw_only=True)
class Ticket:
    """One completion in flight; ``epoch`` is the abort count when it started."""

    epoch: int
    parked: bool = False


class PauseGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.mode: Mode | None = None  # None: open
        self._epoch = 0  # pauses in abort mode so far
        self._inflight: list[Ticket] = []
        self.waiting = 0  # completions held at admit by a pause in keep mode

    @property
    def paused(self) -> bool:
        return self.mode is not None

    @property
    def running(self) -> int:
        """Completions in flight (parked ones included)."""
        return len(self._inflight)

    def admit(self) -> Ticket:
        """Start a completion: :class:`Paused` under abort or wait, held under keep."""
        with self._cond:
            self.waiting += 1
            try:
                while self.mode == "keep":
                    self._cond.wait()
            finally:
                self.waiting -= 1
            if self.mode is not None:
                raise Paused(f"Generation is paused (mode {self.mode}); retry after /resume.")
            ticket = Ticket(epoch=self._epoch)
            self._inflight.append(ticket)
            return ticket

    def step(self, ticket: Ticket) -> None:
        """Before a token: :class:`Aborted`, or park while paused in keep mode."""
        with self._cond:
            while True:
                if self._epoch != ticket.epoch:
                    raise Aborted("A pause in abort mode ended this completion.")
                if self.mode != "keep":
                    return
                ticket.parked = True
                self._cond.notify_all()
                self._cond.wait()
                ticket.parked = False

    def leave(self, ticket: Ticket) -> None:
        with self._cond:
            self._inflight.remove(ticket)
            self._cond.notify_all()

    def pause(self, mode: Mode) -> None:
        """Close the gate in ``mode``; return once generation is out of the way."""
        with self._cond:
            self.mode = mode
            if mode == "abort":
                self._epoch += 1
            self._cond.notify_all()
            if mode == "keep":
                self._cond.wait_for(lambda: all(t.parked for t in self._inflight))
            else:
                self._cond.wait_for(lambda: not self._inflight)

    def resume(self) -> None:
        with self._cond:
            self.mode = None
            self._cond.notify_all()


__all__ = ["Aborted", "Mode", "PauseGate", "Paused", "Ticket"]
