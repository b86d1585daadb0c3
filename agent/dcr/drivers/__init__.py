"""Serving engines as the agent drives them: the seam and one adapter per engine.

``base`` is the seam, ``plugin`` the plugin calls both adapters share, ``vllm`` and
``sglang`` the adapters, ``http`` their JSON-over-HTTP conversation, ``errors`` the errors.
Torch-free: the agent holds no model. The contract: docs/engines.md.
"""

from dcr.drivers.base import ApplyOutcome, Driver, PauseMode, TensorSpec
from dcr.drivers.errors import BadAnswer, EngineError
from dcr.drivers.plugin import EngineTimeouts
from dcr.drivers.sglang import SglangDriver
from dcr.drivers.vllm import VllmDriver

__all__ = ["ApplyOutcome", "BadAnswer", "Driver", "EngineError", "EngineTimeouts",
           "PauseMode", "SglangDriver", "TensorSpec", "VllmDriver"]
