"""The reference server's workers: one per tensor-parallel rank, each carrying DCR's plugin.

As vLLM mixes its worker extension into the worker class, :func:`build_workers` makes each
worker of a class based on :class:`ServeWorker` and
:class:`~dcr.runtimes.vllm.DcrWorkerExtension`. :class:`Workers` calls the plugin (the
methods of :class:`~dcr.protocol.engine_api.EngineApi`) on every rank in order under the
model lock, so weights never change under a forward.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from transformers import PreTrainedModel

from dcr.apply.applier import Loader
from dcr.checkpoint import Checkpoint
from dcr.drivers.vllm import VllmDriver
from dcr.errors import Invalid
from dcr.protocol.engine_api import METHODS
from dcr.runtimes import build_runtime
from dcr.runtimes.hf import HFRuntime
from dcr.runtimes.loader import VllmRuntime
from dcr.runtimes.vllm import DcrWorkerExtension
from dcr.runtimes.weights import checkpoint_tensors
from dcr.serve.settings import ServeSettings


class ServeWorker:
    """What vLLM's worker offers its extension, for one rank of this process.

    ``rank_options`` (``instance``, ``staging_dir``, ``checkpoint_root``) give the
    plugin's rank its own instead of the process's: an in-process engine
    (:class:`dcr.serve.local.LocalDriver`) stands for a server of its own.
    """

    def __init__(self, *, rank: int, world: int, model: torch.nn.Module,
                 rank_options: dict[str, Any] | None = None) -> None:
        self.rank = self.local_rank = rank
        self.parallel_config = SimpleNamespace(world_size=world, tensor_parallel_size=world)
        self.device = next(model.parameters()).device
        self.model_runner = SimpleNamespace(model=model)
        self._rank_options = dict(rank_options or {})

    def _dcr_rank_options(self) -> dict[str, Any]:
        return self._rank_options


class HfServeWorker(ServeWorker):
    """A worker holding a transformers model, which loads through ``load_state_dict``."""

    def _dcr_loader(self, model: torch.nn.Module) -> Loader:
        return HFRuntime(model)


_WORKER_CLASSES: dict[bool, type[ServeWorker]] = {  # vLLM's way: the worker class with
    hf: type("ReferenceWorker",                      # the extension appended to its bases
             (HfServeWorker if hf else ServeWorker, DcrWorkerExtension), {})
    for hf in (False, True)}


def make_worker(model: Any, *, rank: int, world: int,
                rank_options: dict[str, Any] | None = None) -> ServeWorker:
    """A worker holding ``model`` (a transformers model loads through its state dict, any
    other through its vLLM-style ``load_weights``), with DCR's plugin mixed in."""
    cls = _WORKER_CLASSES[isinstance(model, PreTrainedModel)]
    return cls(rank=rank, world=world, model=model, rank_options=rank_options)


def build_workers(s: ServeSettings, rank_options: dict[str, Any] | None = None
                  ) -> list[ServeWorker]:
    """A worker per rank the settings hold, each loaded densely with ``--model``."""
    workers = []
    for rank in s.ranks:
        stage, tp_rank = divmod(rank, s.tp_size)
        runtime = build_runtime(s.runtime, s.model, tp_size=s.tp_size, tp_rank=tp_rank,
                                pp_size=s.pp_size, pp_rank=stage, ep=s.expert_parallel,
                                fp8=s.fp8, device=s.device)
        assert isinstance(runtime, HFRuntime | VllmRuntime)  # what build_runtime makes
        with Checkpoint(s.model) as ckpt:
            runtime.load_weights(checkpoint_tensors(ckpt).items())
        workers.append(make_worker(runtime.model, rank=rank, world=s.tp_size * s.pp_size,
                                   rank_options=rank_options))
    return workers


class UnknownMethod(Invalid, ValueError):
    """``/collective_rpc`` named a method that is not one of the plugin's."""


@dataclass(eq=False)
class Workers:
    """Every worker of this process, and the lock between weight changes and forwards;
    ``peers``: the other processes of this replica (``--peer``), whose ranks a plugin
    call reaches too, as vLLM's ``collective_rpc`` reaches every node's workers."""

    workers: list[ServeWorker]
    lock: threading.Lock
    peers: tuple[VllmDriver, ...] = ()

    def call(self, method: str, args: list[str], kwargs: dict[str, str],
             timeout_s: float = 600.0) -> list[Any]:
        """``method`` on every worker, here and then on each peer (vLLM's
        ``collective_rpc``); the answers carry their ranks. A peer that fails or does
        not answer fails the call, naming it."""
        if method not in METHODS:
            raise UnknownMethod(f"Method {method[:64]!r} is not one of DCR's plugin methods "
                                f"{list(METHODS)}.")
        with self.lock:
            results = [getattr(w, method)(*args, **kwargs) for w in self.workers]
            arg = json.loads(args[0]) if args and self.peers else None  # the one argument
            for peer in self.peers:
                results += peer.rpc(method, arg, timeout_s=timeout_s)
            return results

    @property
    def forward(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Next-token logits of every position, on rank 0's model (the ids go to the
        model's device); None for a model without a forward pass (vllm-ref)."""
        model = self.workers[0].model_runner.model
        if not isinstance(model, PreTrainedModel):
            return None
        return lambda ids: model(input_ids=ids.to(model.device)).logits

    @property
    def vocab(self) -> int:
        return int(self.workers[0].model_runner.model.config.vocab_size)


__all__ = ["HfServeWorker", "ServeWorker", "UnknownMethod", "Workers",
           "build_workers", "make_worker"]
