"""The seam between DCR and a serving runtime.

A runtime exposes its native loader, the tensors that hold its weights, and the request
gate. DCR never learns how a runtime lays weights out: placement is the loader's job.
"""

from __future__ import annotations

import threading
from typing import Protocol

from dcr.apply.applier import Loader


class Runtime(Loader, Protocol):
    """A serving runtime: its native loader (what the applier needs) and its gate."""

    def close_gate(self) -> None:
        """Stop admitting new generation requests and wait for running ones."""
        ...

    def open_gate(self) -> None: ...


class RequestGate:
    """A switch that generation requests pass through; closed while weights change."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._open.wait(timeout)
