"""The transformers runtime: a Hugging Face model whose loader is ``load_state_dict``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from dcr.errors import DcrError
from dcr.runtimes.base import RequestGate


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
