"""The seam between DCR and a serving runtime.

A runtime exposes its native loader, the tensors that hold its weights, and the request
gate. DCR never learns how a runtime lays weights out: placement is the loader's job.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from dcr.errors import DcrError


class Runtime(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The runtime's own loader. Returns the names of the tensors it wrote."""
        ...

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter and persistent buffer, tied ones under each of their names."""
        ...

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


class HFRuntime:
    """A Hugging Face transformers model, loaded through ``load_state_dict``.

    The identity path: canonical names are the model's state-dict keys, and
    ``torch.nn.Module.load_state_dict`` copies each tensor into its parameter in place.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.gate = RequestGate()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        state = dict(weights)
        result = self.model.load_state_dict(state, strict=False, assign=False)
        if result.unexpected_keys:
            raise DcrError(f"The model has no tensors named {result.unexpected_keys[:5]}.")
        return set(state)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict(keep_vars=True).items()

    def close_gate(self) -> None:
        self.gate.close()

    def open_gate(self) -> None:
        self.gate.open()
