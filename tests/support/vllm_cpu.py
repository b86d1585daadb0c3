"""vLLM's real model classes on CPU, and the small checkpoints the engine tier loads.

vLLM's engine cannot start without a GPU, but its model classes and their
``load_weights`` run on CPU once ``VLLM_TARGET_DEVICE=cpu`` is set before vLLM is
imported (``../shared/INFRA-NOTES.md``): a ``VllmConfig`` for the checkpoint, a gloo
process group standing in for NCCL, the tensor-parallel groups, and the class
``get_model_architecture`` picks, built in BF16 on the CPU. That is what a vLLM worker
builds, without the KV cache, the scheduler and CUDA graphs, which a refit never touches.

Checkpoints are made offline with transformers: a random model of each family, then
real AdamW steps on random tokens; each version is a Hugging Face directory
(``config.json`` + ``model.safetensors`` in BF16), exactly what vLLM loads.

Used by the tests (in process for TP 1, in :mod:`rank_worker` processes for TP 2) and by
``bench/engines.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # read when vllm is first imported

import torch
from safetensors.torch import save_file

from dcr.checkpoint import Checkpoint
from dcr.format.manifest import Manifest
from dcr.format.names import Mode
from dcr.format.profile import ReceiverProfile
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.vllm import DcrWorkerExtension
from dcr.transport.store import MemoryStore

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, kw_only=True)
class Family:
    """A model family the tier covers, as the transformers config that makes it and the
    tensor names its checkpoints use."""

    name: str
    config_cls: str  # a transformers config class
    config: dict[str, Any]
    # Store experts one tensor per expert and projection, named (gate, up, down), as
    # checkpoints on the Hub do (vLLM loads them into its stacks expert by expert),
    # instead of transformers 5's fused [E, 2I, H] and [E, H, I] tensors.
    expert_names: tuple[str, str, str] | None = None
    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement) on every name


COMMON = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 128}
FAMILIES = {f.name: f for f in (
    # vocab 1000 is padded to 1024 (vLLM pads to 64 per rank): the padding is zero-filled
    # on every load, which DCR replays.
    Family(name="llama-tied", config_cls="LlamaConfig", config={
        **COMMON, "intermediate_size": 128, "num_key_value_heads": 2,
        "tie_word_embeddings": True}),
    Family(name="llama", config_cls="LlamaConfig", config={
        **COMMON, "intermediate_size": 128, "num_key_value_heads": 2,
        "tie_word_embeddings": False}),
    # Qwen2-MoE: qkv with bias, a shared expert and its gate, routed experts per expert.
    Family(name="qwen2-moe", config_cls="Qwen2MoeConfig", config={
        **COMMON, "intermediate_size": 128, "num_key_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "tie_word_embeddings": False},
        expert_names=("gate_proj", "up_proj", "down_proj")),
    # The same, with experts in transformers 5's fused layout (vLLM loads both).
    Family(name="qwen2-moe-fused", config_cls="Qwen2MoeConfig", config={
        **COMMON, "intermediate_size": 128, "num_key_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "tie_word_embeddings": False}),
    # Mixtral, in the Hub's layout (block_sparse_moe, w1/w3/w2 per expert): vLLM 0.33
    # does not load transformers 5's own Mixtral names.
    Family(name="mixtral", config_cls="MixtralConfig", config={
        **COMMON, "intermediate_size": 32, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
        expert_names=("w1", "w3", "w2"), renames=((r"\.mlp\.", ".block_sparse_moe."),)),
)}


def make_versions(family: Family, root: Path, *, steps: int, lr: float, seed: int = 0,
                  tokens: int = 32) -> list[Path]:
    """``root/v0`` .. ``root/v{steps}``: a random model, then one AdamW step per version
    on random tokens (fp32 master weights, BF16 exports)."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, family.config_cls)(**family.config)
    config.dtype = "bfloat16"
    model = transformers.AutoModelForCausalLM.from_config(config).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    dirs = [_export(model, config, root / "v0", family)]
    for v in range(1, steps + 1):
        ids = torch.randint(0, config.vocab_size, (2, tokens), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        dirs.append(_export(model, config, root / f"v{v}", family))
    return dirs


def _export(model: torch.nn.Module, config: Any, out: Path, family: Family) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {n: t.detach().to(torch.bfloat16)
             for n, t in model.state_dict().items()
             if not (tied and n == "lm_head.weight")}  # a tied head is not stored (as HF)
    if family.expert_names is not None:
        state = dict(pair for name, tensor in state.items()
                     for pair in _per_expert(name, tensor, family.expert_names))
    for pattern, new in family.renames:
        state = {re.sub(pattern, new, n): t for n, t in state.items()}
    state = {n: t.contiguous() for n, t in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]  # else vLLM builds a pooling model
    config.save_pretrained(out)
    return out


def _per_expert(name: str, t: torch.Tensor, names: tuple[str, str, str]
                ) -> list[tuple[str, torch.Tensor]]:
    """transformers 5's fused expert tensors as one tensor per expert and projection."""
    gate, up, down = names
    if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
        base, half = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
        return [(f"{base}.{e}.{proj}.weight", part) for e in range(t.shape[0])
                for proj, part in ((gate, t[e, :half]), (up, t[e, half:]))]
    if name.endswith(".experts.down_proj"):  # [E, H, I]
        base = name.removesuffix(".down_proj")
        return [(f"{base}.{e}.{down}.weight", t[e]) for e in range(t.shape[0])]
    return [(name, t)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_config(model_dir: Path, *, tp: int = 1, quantization: str | None = None,
                device: str = "cpu", expert_parallel: bool = False) -> Any:
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="bfloat16",
                                 skip_tokenizer_init=True, enforce_eager=True,
                                 quantization=quantization),
        device_config=DeviceConfig(device=device), load_config=LoadConfig(),
        parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                       enable_expert_parallel=expert_parallel),
    )


def init_distributed(model_dir: Path, *, world: int, rank: int, port: int) -> None:
    """The process group and tensor-parallel groups a vLLM worker sets up, over gloo.

    vLLM creates the expert-parallel group only for an MoE config, so pass an MoE
    model's directory where MoE models will be built; dense models build under it too.
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vllm_config(model_dir, tp=world)):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world,
                                  pipeline_model_parallel_size=1)


def build_model(model_dir: Path, *, tp: int = 1, quantization: str | None = None,
                device: str = "cpu", expert_parallel: bool = False) -> torch.nn.Module:
    """The model class vLLM picks for ``model_dir``, built empty in BF16 (on the CPU
    unless ``device`` says otherwise); with ``expert_parallel``, an MoE layer's experts
    are split across the ranks, whole, instead of each expert across them."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.utils import get_model_architecture

    cfg = vllm_config(model_dir, tp=tp, quantization=quantization, device=device,
                      expert_parallel=expert_parallel)
    with set_current_vllm_config(cfg):
        model_cls, _ = get_model_architecture(cfg.model_config)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = model_cls(vllm_config=cfg, prefix="")
        finally:
            torch.set_default_dtype(old)
        record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    model.dcr_vllm_config = cfg  # for loads that need the config current
    return model.eval()


def build_served(model_dir: Path) -> torch.nn.Module:
    """The model as a ``vllm serve`` worker holds it once started: built (its tensors as
    created recorded), loaded from ``model_dir``, then
    processed after loading (vLLM's CPU build packs every linear weight for oneDNN and
    empties the parameter). Raises what the post-load step raises where this vLLM has
    no CPU kernels for it (the CUDA wheel)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = build_model(model_dir)
    load_dense(model, model_dir)
    with current(model):
        process_weights_after_loading(model, model.dcr_vllm_config.model_config,
                                      torch.device("cpu"))
    return model


def computed(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """What every linear and vocabulary layer computes, through its own quantization
    method (so from any packed copy it made), from one fixed input: the output's bits."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    gen = torch.Generator().manual_seed(seed)
    out = {}
    with current(model):
        for name, layer in model.named_modules():
            if isinstance(layer, LinearBase):
                width = layer.input_size_per_partition
            elif isinstance(layer, VocabParallelEmbedding):
                width = layer.embedding_dim
            else:
                continue
            x = torch.randn(3, width, generator=gen).to(torch.bfloat16)
            y = layer.quant_method.apply(layer, x)
            out[name] = y.contiguous().view(BITS[y.element_size()])
    return out


@contextlib.contextmanager
def current(model: torch.nn.Module) -> Iterator[None]:
    """vLLM's config made current, as a worker does around every load."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.dcr_vllm_config), torch.no_grad():
        yield


def load_dense(model: torch.nn.Module, model_dir: Path) -> set[str]:
    """A dense load of a checkpoint through the model's own ``load_weights``."""
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    with current(model):
        return set(model.load_weights(iter(state.items())))


def bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a flat integer view of its bits."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        flat = t.detach().contiguous().reshape(-1)
        out[name] = flat.view(BITS[flat.element_size()])
    return out


def differing(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """The parameters and buffers whose bits differ between two models of one class."""
    ba, bb = bits(a), bits(b)
    assert ba.keys() == bb.keys()
    return sorted(n for n in ba if not torch.equal(ba[n], bb[n]))


class Worker(DcrWorkerExtension):
    """What vLLM's worker looks like to its extension: ``model_runner.model`` and the
    ``vllm_config`` it loads under. The extension's methods are called as
    ``collective_rpc`` would call them, with JSON strings."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=model)
        self.vllm_config = model.dcr_vllm_config
        self.model = model


def canonical_request(model_dir: Path) -> str:
    """The ``dcr_prewarm`` request for a checkpoint's tensors, as JSON."""
    with Checkpoint(model_dir) as ckpt:
        tensors = [[i.name, i.dtype.name, list(i.shape)] for i in ckpt]
    return json.dumps({"tensors": tensors})


def stage(staging: Path, versions: list[Path], v: int, profile: ReceiverProfile,
          mode: Mode = "mixed") -> tuple[list[str], Manifest]:
    """Version ``v``'s payloads as files in the staging directory, as the agent stages
    them; their names and the manifest."""
    store = MemoryStore()
    m = diff_checkpoints(Checkpoint(versions[v - 1]), Checkpoint(versions[v]), store,
                         EncodeSettings(target_version=v, base_version=v - 1, mode=mode,
                                        profile=profile))
    names = []
    for i, e in enumerate(m.payloads):
        name = f"v{v}-{m.attempt}-{i}.dcrp"
        (staging / name).write_bytes(store.get(e.key))
        names.append(name)
    return names, m
