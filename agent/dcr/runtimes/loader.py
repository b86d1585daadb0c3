"""Modules that follow vLLM's ``load_weights`` contract, as a :class:`~dcr.runtimes.base.Runtime`.

vLLM's model classes and SGLang's (which copied the contract) both load canonical tensors
through ``load_weights`` and hold their weights as parameters and buffers, so one adapter
serves both engines; each engine's plugin module builds on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from dcr.runtimes.base import RequestGate
from dcr.runtimes.derived import DerivedLayers


class VllmStyleModel(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class VllmRuntime:
    """A module whose ``load_weights`` follows vLLM's contract (returns loaded names).

    Layers whose compute form vLLM derived after loading are seen through
    :class:`~dcr.runtimes.derived.DerivedLayers`: their kept loading form stands in the
    layer while DCR loads, and in place of what the engine left there in
    :meth:`named_tensors`.
    """

    def __init__(self, model: VllmStyleModel) -> None:
        self.model = model
        self.gate = RequestGate()
        self.derived = DerivedLayers(model)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        with self.derived.loading():
            return set(self.model.load_weights(weights))

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.derived.named_tensors(
            itertools.chain(self.model.named_parameters(), self.model.named_buffers()))

    def close_gate(self) -> None:
        self.gate.close()

    def open_gate(self) -> None:
        self.gate.open()


__all__ = ["VllmRuntime", "VllmStyleModel"]
