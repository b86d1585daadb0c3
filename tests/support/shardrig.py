"""Trainer ranks' shards of a reference model, and vLLM-layout receivers to refit with them.

``tp_shards`` holds a Megatron-style tensor-parallel rank's tensors (vocabulary and
column-parallel rows, row-parallel columns, fused gate/up, optionally fused qkv in the
interleaved group layout, replicated norms) with their shard maps; ``ep_shards`` an
expert-parallel rank's expert stacks. ``receivers`` gives an agent per vLLM-layout rank
over an in-process engine; ``exact`` compares every rank with a dense load of the target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dcr.apply.plan import CanonicalTensor
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.shards import ShardMap
from dcr.protocol.records import CommitRecord
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import ReferenceConfig, ReferenceModel, dense_state
from dcr.serve.local import LocalDriver
from dcr.transport.receive import StoreSource
from dcr.transport.store import Store

State = dict[str, torch.Tensor]
DENSE = ReferenceConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
MOE = ReferenceConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=4, tie_word_embeddings=False, num_experts=4,
                      moe_intermediate_size=16)
V0 = CommitRecord(committed_version=0, baseline_id="v0", attempt="")


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def perturbed(sd: State, rate: float, seed: int) -> State:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in sd.items():
        mask = torch.rand(t.shape, generator=gen) < rate
        u = t.clone()
        u[mask] = (t[mask].float() * 1.05 + 1e-3).to(torch.bfloat16)
        out[n] = u
    return out


Shards = tuple[dict[str, ShardMap], dict[str, np.ndarray]]


def tp_shards(sd: State, rank: int, ranks: int, *, qkv: ReferenceConfig | None = None
              ) -> tuple[dict[str, ShardMap], dict[str, torch.Tensor]]:
    """Rank ``rank``'s tensors as a Megatron-style trainer holds them, with their maps;
    with ``qkv`` (the model's config) q, k and v are fused in Megatron's group layout."""
    maps: dict[str, ShardMap] = {}
    local: dict[str, torch.Tensor] = {}

    def add(key: str, m: ShardMap, t: torch.Tensor) -> None:
        maps[key], local[key] = m, t.contiguous()

    fused = ("gate_proj.weight", "up_proj.weight") + (
        ("q_proj.weight", "k_proj.weight", "v_proj.weight") if qkv else ())
    for name, t in sd.items():
        shape = tuple(t.shape)
        if name.endswith(fused):
            continue  # fused below
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            add(name, ShardMap(kind="columns", canonical=(name,), shape=shape, dtype="BF16",
                               rank=rank, ranks=ranks), t.chunk(ranks, dim=1)[rank])
        elif t.dim() == 2:
            add(name, ShardMap(kind="rows", canonical=(name,), shape=shape, dtype="BF16",
                               rank=rank, ranks=ranks), t.chunk(ranks, dim=0)[rank])
        else:
            add(name, ShardMap(kind="replicated", canonical=(name,), shape=shape, dtype="BF16",
                               rank=rank, ranks=ranks), t)
    for name in sd:
        if name.endswith("gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            gate_up = torch.cat([sd[name].chunk(ranks)[rank], sd[up].chunk(ranks)[rank]])
            add(name.replace("gate_proj", "gate_up_proj"),
                ShardMap(kind="gate_up", canonical=(name, up), shape=tuple(sd[name].shape),
                         dtype="BF16", rank=rank, ranks=ranks), gate_up)
        if qkv and name.endswith("q_proj.weight"):
            k, v = name.replace("q_proj", "k_proj"), name.replace("q_proj", "v_proj")
            add(name.replace("q_proj", "qkv_proj"),
                ShardMap(kind="qkv", canonical=(name, k, v), shape=tuple(sd[name].shape),
                         dtype="BF16", rank=rank, ranks=ranks,
                         heads=(qkv.num_heads, qkv.num_kv_heads)),
                megatron_qkv(sd[name], sd[k], sd[v], qkv, rank, ranks))
    return maps, local


def megatron_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ReferenceConfig,
                 rank: int, ranks: int) -> torch.Tensor:
    """Megatron's fused qkv rows of ``rank``: per query group, its query heads, k, v."""
    dim = q.shape[0] // cfg.num_heads
    per = cfg.num_heads // cfg.num_kv_heads
    groups = [torch.cat([q[g * per * dim:(g + 1) * per * dim], k[g * dim:(g + 1) * dim],
                         v[g * dim:(g + 1) * dim]]) for g in range(cfg.num_kv_heads)]
    mine = cfg.num_kv_heads // ranks
    return torch.cat(groups[rank * mine:(rank + 1) * mine])


def ep_shards(sd: State, cfg: ReferenceConfig, rank: int, ranks: int) -> Shards:
    """Expert-parallel rank: stacks of its experts; everything else replicated."""
    maps: dict[str, ShardMap] = {}
    local: dict[str, np.ndarray] = {}
    per = cfg.num_experts // ranks
    mine = range(rank * per, (rank + 1) * per)
    for name, t in sd.items():
        if ".experts." not in name:
            maps[name] = ShardMap(kind="replicated", canonical=(name,), shape=tuple(t.shape),
                                  dtype="BF16", rank=rank, ranks=ranks)
            local[name] = bits(t)
    for layer in range(cfg.num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in mine]
            stack = torch.stack([sd[n] for n in names])
            for k, n in enumerate(names):
                key = f"{n}@stack"
                maps[key] = ShardMap(kind="expert", canonical=(n,), shape=tuple(sd[n].shape),
                                     dtype="BF16", expert=k)
                local[key] = bits(stack)
    return maps, local


def receivers(cfg: ReferenceConfig, sd: State, store: Store, tps: tuple[int, ...],
              tmp: Path) -> tuple[list[AgentService], list[tuple[ReferenceModel, int, int]]]:
    """An agent per rank, each over an in-process engine holding that rank's shard,
    prewarmed."""
    canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape)) for n, t in sd.items()]
    out, models = [], []
    for tp in tps:
        for r in range(tp):
            model = ReferenceModel(cfg, tp_size=tp, tp_rank=r)
            model.load_weights(sd.items())
            staging = tmp / f"tp{tp}-rank{r}"
            engine = LocalDriver([model], staging_dir=staging, checkpoint_root=tmp)
            out.append(AgentService(
                f"tp{tp}-rank{r}", engine, lambda spec: StoreSource(
                    store=store, version=spec.target_version, attempt=spec.attempt,
                    owners=spec.owners), canonical=canonical, staging_dir=staging, version=0))
            out[-1].attach()
            models.append((model, tp, r))
    return out, models


def profile_of(rx: list[AgentService]) -> ReceiverProfile:
    return merge(ReceiverProfile.model_validate(r.profile()) for r in rx)


def exact(cfg: ReferenceConfig, models: list[tuple[ReferenceModel, int, int]], sd: State) -> bool:
    for model, tp, r in models:
        dense = ReferenceModel(cfg, tp_size=tp, tp_rank=r)
        dense.load_weights(sd.items())
        a, b = dense_state(model), dense_state(dense)
        if not all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a):
            return False
    return True




def tp_bits(sd: State, rank: int, ranks: int) -> Shards:
    """``tp_shards`` as raw bits (what a ``ShardEncoder`` takes)."""
    maps, local = tp_shards(sd, rank, ranks)
    return maps, {k: bits(t) for k, t in local.items()}
