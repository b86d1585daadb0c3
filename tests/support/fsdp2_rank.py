"""One FSDP2 training rank whose shards are a refit's owner: the trainer side of a rank test.

``python fsdp2_rank.py RANK WORLD PORT CHECKPOINT VERSION STORE TOKEN_FILE OUT [LAYOUT]``
joins a gloo group of ``WORLD`` ranks, builds a Llama from ``CHECKPOINT`` (a Hugging Face
directory, or one safetensors file of :data:`CONFIG`'s model) as version ``VERSION``,
shards it (``LAYOUT``: ``fsdp``, ``fully_shard`` over all ranks; ``hsdp``, replicas of
``fully_shard`` on a 2 x WORLD/2 mesh; ``fsdp-tp``, Llama's tensor-parallel plan on
the mesh's second dimension and ``fully_shard`` on its first, the norms left to FSDP
alone), makes its shards a :class:`RankOwner` and serves the
warm-encoder protocol on loopback (one JSON line ``{"url"}``). Then, per line
``{"step": V}`` on stdin, it takes an AdamW step, offers version V and answers
``{"changed": N}``; rank 0 also writes the dense version V to ``OUT/vV/``, for the test
to compare with and for nothing else (no owner reads it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from transformers import LlamaConfig, LlamaForCausalLM

from dcr.owner.layouts import fsdp2_shards
from dcr.owner.rank import RankOwner, serve
from dcr.transport.store import open_store

CONFIG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                     max_position_embeddings=64)


@dataclass(frozen=True, kw_only=True)
class RankArgs:
    """A rank script's arguments, in the order :mod:`trainer_ranks` passes them."""

    rank: int
    world: int
    checkpoint: Path
    version: int
    store: str
    token_file: Path
    out: Path
    layout: str


def joined(argv: list[str]) -> RankArgs:
    """Log to stderr, read ``argv`` and join the gloo group it names."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    a = RankArgs(rank=int(argv[1]), world=int(argv[2]), checkpoint=Path(argv[4]),
                 version=int(argv[5]), store=argv[6], token_file=Path(argv[7]),
                 out=Path(argv[8]), layout=argv[9] if len(argv) > 9 else "fsdp")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=argv[3])
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    return a


def main() -> None:
    a = joined(sys.argv)
    rank, world, checkpoint, version, layout = a.rank, a.world, a.checkpoint, a.version, \
        a.layout
    store, token_file, out = a.store, a.token_file, a.out
    torch.manual_seed(0)
    if checkpoint.is_dir():
        model = LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.bfloat16)
    else:
        model = LlamaForCausalLM(CONFIG).to(torch.bfloat16)
        model.load_state_dict(load_file(checkpoint), strict=False)
    shard(model, layout, world)
    # FSDP2 over TP leaves the norms on the data-parallel slice: their copies lie along tp
    copies = ("tp",) if layout == "fsdp-tp" else None
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    maps, tensors = fsdp2_shards(model, rank=rank, ranks=world, copies=copies)
    owner = RankOwner(store=open_store(store), maps=maps, tensors=tensors, version=version,
                      rank=rank, ranks=world)
    server = serve(owner, token=Path(token_file).read_text().strip())
    print(json.dumps({"url": server.url}), flush=True)
    data = torch.Generator().manual_seed(1)
    for line in sys.stdin:
        step = int(json.loads(line)["step"])
        ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=data)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
        overlay = owner.offer(fsdp2_shards(model, rank=rank, ranks=world, copies=copies)[1], step)
        dense = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective
        if rank == 0:
            there = Path(out) / f"v{step}"
            there.mkdir(parents=True)
            save_file({n: t.contiguous() for n, t in dense.items()},
                      str(there / "model.safetensors"))
            model.config.to_json_file(there / "config.json")
        print(json.dumps({"changed": overlay.elements}), flush=True)
    server.close()
    dist.destroy_process_group()


def shard(model: LlamaForCausalLM, layout: str, world: int) -> None:
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    elif layout == "hsdp":  # fully_shard on a 2-D mesh: replicate over dim 0, shard over 1
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    elif layout == "fsdp-tp":
        world_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, world_mesh["tp"])
        mesh = world_mesh["dp"]
    else:
        raise SystemExit(f"unknown layout {layout!r}")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def tensor_parallel(model: LlamaForCausalLM, mesh: DeviceMesh) -> None:
    """Megatron's split as torch's tensor parallel API writes it for a Llama: query, key,
    value, gate and up by rows (output features), the attention and MLP outputs by
    columns, the embedding by columns (hidden), the LM head by rows (vocabulary)."""
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": ColwiseParallel(output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        at = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{at}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{at}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


if __name__ == "__main__":
    main()
