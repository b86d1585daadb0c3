"""Serving runtimes DCR applies refits through, and the factory that builds them.

:class:`~dcr.runtimes.base.Runtime` is the seam. :func:`build_runtime` makes one from a
Hugging Face checkpoint directory, one builder per kind in :data:`RUNTIMES`, so a new
runtime is one function and one row (docs/apply.md, "Runtimes").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcr.errors import ConfigError

if TYPE_CHECKING:  # torch loads only when a runtime is built, not for ``dcr --help``
    from dcr.runtimes.base import Runtime


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """How to build a runtime; fields a kind does not use are ignored."""

    tp_size: int = 1  # vllm-ref: tensor-parallel ranks
    tp_rank: int = 0  # vllm-ref: this rank
    pp_size: int = 1  # vllm-ref: pipeline stages
    pp_rank: int = 0  # vllm-ref: this stage
    ep: bool = False  # vllm-ref: experts split across the TP ranks instead of sharded
    fp8: tuple[str, ...] = ()  # vllm-ref: module suffixes stored as FP8
    device: str = "cpu"  # hf: where the weights live


def _hf(config: Any, o: RuntimeOptions) -> Runtime:
    import torch
    from transformers import AutoModelForCausalLM

    from dcr.runtimes.hf import HFRuntime

    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model = model.to(device=o.device, dtype=torch.bfloat16).eval()
    return HFRuntime(model)


def _vllm_reference(config: Any, o: RuntimeOptions) -> Runtime:
    from dcr.runtimes.loader import VllmRuntime
    from dcr.runtimes.vllm_reference import ReferenceConfig, ReferenceModel

    if getattr(config, "shared_expert_intermediate_size", 0):
        raise ConfigError(f"The checkpoint's {config.model_type} has shared experts "
                          f"(shared_expert_intermediate_size "
                          f"{config.shared_expert_intermediate_size}), which the vLLM-layout "
                          "reference does not model.")
    ref = ReferenceConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        tie_word_embeddings=bool(config.tie_word_embeddings), fp8_modules=o.fp8,
        num_experts=int(getattr(config, "num_experts", 0) or 0),
        moe_intermediate_size=int(getattr(config, "moe_intermediate_size", 0) or 0),
    )
    return VllmRuntime(ReferenceModel(ref, tp_size=o.tp_size, tp_rank=o.tp_rank, ep=o.ep,
                                      pp_size=o.pp_size, pp_rank=o.pp_rank))


RUNTIMES: dict[str, Callable[[Any, RuntimeOptions], Runtime]] = {
    "hf": _hf,
    "vllm-ref": _vllm_reference,
}


def build_runtime(kind: str, model_dir: Path, *, tp_size: int = 1, tp_rank: int = 0,
                  pp_size: int = 1, pp_rank: int = 0, ep: bool = False,
                  fp8: tuple[str, ...] = (), device: str = "cpu") -> Runtime:
    """A runtime of ``kind`` shaped by ``model_dir``'s ``config.json`` (weights not loaded)."""
    try:
        builder = RUNTIMES[kind]
    except KeyError:
        raise ConfigError(f"Runtime {kind!r} is not one of {sorted(RUNTIMES)}.") from None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if device != "cpu" and kind != "hf":
        raise ConfigError(f"Runtime {kind!r} holds its weights on the CPU only, not on {device!r}.")
    return builder(config, RuntimeOptions(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size,
                                          pp_rank=pp_rank, ep=ep, fp8=fp8, device=device))
