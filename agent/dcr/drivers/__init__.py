"""Serving engines as the agent drives them: the seam and one adapter per engine.

``base`` is the seam (:class:`~dcr.drivers.base.Driver`) and its values; ``plugin`` is
DCR's plugin inside the engine as the agent calls it (seven methods, one answer per rank)
and the shared half of both adapters; ``vllm`` drives a vLLM server (and ``dcr serve``,
which speaks vLLM's dialect) through ``/collective_rpc``, ``/pause`` and the weight-version
routes; ``sglang`` drives an SGLang server through its custom weight-loader hook,
``/pause_generation`` and ``/update_weight_version``; ``http`` is the one JSON-over-HTTP
conversation both use; ``errors`` holds the package's errors. Torch-free: the agent that
imports this holds no model. ``docs/engines.md`` is the contract in prose.
"""

from dcr.drivers.base import ApplyOutcome, Driver, PauseMode, TensorSpec
from dcr.drivers.errors import BadAnswer, EngineError
from dcr.drivers.plugin import EngineTimeouts
from dcr.drivers.sglang import SglangDriver
from dcr.drivers.vllm import VllmDriver

__all__ = ["ApplyOutcome", "BadAnswer", "Driver", "EngineError", "EngineTimeouts",
           "PauseMode", "SglangDriver", "TensorSpec", "VllmDriver"]
