"""Running the apply engine inside vLLM's worker processes.

vLLM loads weights with each model's own ``load_weights(iter[(hf_name, tensor)])``,
which fuses, shards and quantizes canonical tensors into the worker's storage. DCR
calls exactly that method, so the adapter is small:

* :class:`VllmRuntime` adapts any module with a vLLM-style ``load_weights`` (vLLM's
  models, and :mod:`dcr.runtimes.vllm_reference`, whose tests exercise this class) to
  the :class:`~dcr.runtimes.base.Runtime` protocol.
* :class:`DcrWorkerExtension` is a worker extension: pass
  ``worker_extension_cls="dcr.runtimes.vllm.DcrWorkerExtension"`` to ``vllm.LLM`` and call
  ``llm.collective_rpc("dcr_prewarm", args=(tensors,))`` once, then
  ``llm.collective_rpc("dcr_apply", args=(payloads,))`` per refit. Each worker applies
  in place to its own shard; the returned profiles are merged by the sender.

Nothing here imports vLLM; the extension only relies on the worker's
``model_runner.model`` attribute, which vLLM's GPU workers provide.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from dcr.apply.engine import ApplyEngine, CanonicalTensor
from dcr.runtimes.base import RequestGate


class VllmStyleModel(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class VllmRuntime:
    """A module whose ``load_weights`` follows vLLM's contract (returns loaded names)."""

    def __init__(self, model: VllmStyleModel) -> None:
        self.model = model
        self.gate = RequestGate()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return set(self.model.load_weights(weights))

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()

    def close_gate(self) -> None:
        self.gate.close()

    def open_gate(self) -> None:
        self.gate.open()


class DcrWorkerExtension:
    """Mixed into vLLM's worker class; methods are reached through ``collective_rpc``."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    _dcr_engine: ApplyEngine

    def dcr_prewarm(self, tensors: Sequence[tuple[str, str, Sequence[int]]]) -> dict[str, str]:
        """Reserve scratch, classify every canonical tensor; returns this rank's profile."""
        model = self.model_runner.model
        device = next(model.parameters()).device
        self._dcr_engine = ApplyEngine(VllmRuntime(model), device=device)
        profile = self._dcr_engine.prewarm(
            CanonicalTensor(name=n, dtype=d, shape=tuple(s)) for n, d, s in tensors
        )
        return dict(profile.tensors)

    def dcr_apply(self, payloads: Sequence[bytes]) -> dict[str, Any]:
        """Apply a set of payloads in place; returns the apply report as a dict."""
        report = self._dcr_engine.apply_payloads(payloads)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return vars(report)
