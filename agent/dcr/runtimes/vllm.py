"""Running the applier inside vLLM's worker processes.

:class:`VllmRuntime` adapts any module with vLLM's ``load_weights`` to the
:class:`~dcr.runtimes.base.Runtime` protocol; :class:`DcrWorkerExtension` carries DCR's
plugin (:class:`~dcr.runtimes.rank.EngineRank`) into every vLLM worker, reached through
``POST /collective_rpc``: one ``dcr_*`` method per row of
:class:`~dcr.protocol.engine_api.EngineApi`, one JSON string in, a dict with the rank out.
The adapter lives in :mod:`dcr.runtimes.loader`, shared with SGLang. Nothing here imports
vLLM at module level. The contract and its choices: docs/engines.md.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from dcr.apply.applier import Loader
from dcr.protocol.engine_api import EngineApi, PluginCall, RawRequest
from dcr.runtimes.loader import VllmRuntime
from dcr.runtimes.rank import EngineRank

# --- the vLLM worker extension --------------------------------------------------------------

class DcrWorkerExtension:
    """Mixed into vLLM's worker class; its ``dcr_*`` methods are reached through
    ``collective_rpc`` (``POST /collective_rpc`` on a dev-mode server).

    vLLM refuses an extension attribute that the worker class already has, so every
    name here starts with ``dcr_`` or ``_dcr_``.
    """

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    _dcr_state: tuple[object, EngineRank]  # the model it was made for, and the rank

    def dcr_instance(self) -> dict[str, Any]:
        return self._dcr_serve(EngineApi.instance)

    def dcr_prewarm(self, request: RawRequest) -> dict[str, Any]:
        """Reserve scratch and classify every canonical tensor; this rank's profile."""
        return self._dcr_serve(EngineApi.prewarm, request)

    def dcr_apply(self, request: RawRequest) -> dict[str, Any]:
        """Apply staged payloads in place, as one set; the apply report."""
        return self._dcr_serve(EngineApi.apply, request)

    def dcr_fingerprint(self) -> dict[str, Any]:
        return self._dcr_serve(EngineApi.fingerprint)

    def dcr_load_dense(self, request: RawRequest) -> dict[str, Any]:
        """A dense load of a checkpoint under ``DCR_CHECKPOINT_ROOT`` through the
        model's own ``load_weights``."""
        return self._dcr_serve(EngineApi.load_dense, request)

    def dcr_check_targets(self, request: RawRequest) -> dict[str, Any]:
        """The tensors among ``expect`` this rank can read back exactly whose bits differ
        from their fingerprint (the agent's check after an attempt's applies)."""
        return self._dcr_serve(EngineApi.check_targets, request)

    def dcr_sync(self) -> dict[str, Any]:
        return self._dcr_serve(EngineApi.sync)

    # --- the worker's side --------------------------------------------------------------

    def _dcr_serve(self, call: PluginCall[Any, Any], request: RawRequest | None = None
                   ) -> dict[str, Any]:
        """This rank's answer to ``call``; a call with a request runs as the worker's
        own weight loads do (:meth:`_dcr_loading`)."""
        if call.request is None:
            return self._dcr_rank().serve(call)
        assert request is not None  # every dcr_* method of a call with one takes it
        parsed = call.parse(request)
        with self._dcr_loading():
            return self._dcr_rank().serve(call, parsed)

    def _dcr_model(self) -> Any:
        runner = self.model_runner
        get_model = getattr(runner, "get_model", None)
        return get_model() if callable(get_model) else runner.model

    def _dcr_loader(self, model: Any) -> Loader:
        """The runtime DCR loads through; a worker that hosts another kind of model
        overrides this."""
        return VllmRuntime(model)

    def _dcr_rank_options(self) -> dict[str, Any]:
        """:class:`EngineRank`'s ``instance``, ``staging_dir`` and ``checkpoint_root``
        where the worker gives its own (none: the process's)."""
        return {}

    def _dcr_rank(self) -> EngineRank:
        model = self._dcr_model()
        held: tuple[object, EngineRank] | None = getattr(self, "_dcr_state", None)
        if held is not None and held[0] is model:
            return held[1]
        # A new model object (a reload replaced it): a rank that must be prewarmed again.
        rank, world = _rank_and_world(self)
        loader = self._dcr_loader(model)
        state = EngineRank(loader, rank=rank, world=world,
                           device=next(model.parameters()).device,
                           derived=loader.derived if isinstance(loader, VllmRuntime) else None,
                           **self._dcr_rank_options())
        self._dcr_state = (model, state)
        return state

    @contextlib.contextmanager
    def _dcr_loading(self) -> Iterator[None]:
        """vLLM's config made current (as the worker does around its own weight loads),
        and no autograd."""
        config = getattr(self, "vllm_config", None)
        with contextlib.ExitStack() as stack:
            if config is not None:
                vllm_config = importlib.import_module("vllm.config")
                stack.enter_context(vllm_config.set_current_vllm_config(config))
            stack.enter_context(torch.no_grad())
            yield


def _rank_and_world(worker: object) -> tuple[int, int]:
    """This worker's rank and the number of workers: from the default process group
    vLLM set up (each worker is one rank of it), else from the worker's own ``rank`` and
    ``parallel_config.world_size`` (a server that holds every rank in one process, as
    ``dcr serve`` does), else rank 0 of 1."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = getattr(worker, "rank", 0)
    world = getattr(getattr(worker, "parallel_config", None), "world_size", 1)
    return ((rank if isinstance(rank, int) else 0),
            (world if isinstance(world, int) and world >= 1 else 1))
