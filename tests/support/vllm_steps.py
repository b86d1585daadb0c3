"""A logits processor that makes every step of a ``vllm serve`` at least ``STEP_S`` longer.

A test that needs a request still in flight when a refit pauses the engine cannot count on
the machine: the test models decode a token in a few milliseconds, so a 200-token request
can end before the pause arrives, or not, depending on load. With this processor loaded
(``--logits-processors vllm_steps:SlowSteps``) every engine step sleeps first, so such a
request lasts at least 200 * ``STEP_S`` seconds on any machine. It changes no logit: it is
argmax-invariant (vLLM skips it for greedy batches) and ``apply`` returns its input.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

STEP_S = 0.02


class SlowSteps(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        time.sleep(STEP_S)  # called once per step, before its forward pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
