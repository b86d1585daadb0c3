"""Direct projection: trainer ranks encode their shards in canonical coordinates.

Two Megatron-style tensor-parallel trainer ranks (vocabulary and column-parallel rows,
row-parallel columns, fused gate/up halves, replicated norms), and expert-parallel
ranks holding stacks of experts, each publish as one owner. vLLM-layout receivers
(TP2 ranks and a TP1 rank) end bit-exact with a dense load of the canonical target,
including after a failed first attempt repaired by the overwrite retry.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dcr.apply.plan import CanonicalTensor
from dcr.errors import BaselineError, ConfigError
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.shards import ShardEncoder, ShardMap
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.records import Attempt, CommitRecord, Transition
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import (
    ReferenceConfig,
    ReferenceModel,
    dense_state,
    random_checkpoint,
)
from dcr.serve.local import LocalDriver
from dcr.transport.receive import StoreSource
from dcr.transport.store import MemoryStore

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


def tp_shards(sd: State, rank: int, ranks: int) -> Shards:
    """Rank ``rank``'s tensors as a Megatron-style trainer holds them, with their maps."""
    maps: dict[str, ShardMap] = {}
    local: dict[str, np.ndarray] = {}

    def add(key: str, m: ShardMap, t: torch.Tensor) -> None:
        maps[key], local[key] = m, bits(t)

    for name, t in sd.items():
        shape = tuple(t.shape)
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
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
            fused = torch.cat([sd[name].chunk(ranks)[rank], sd[up].chunk(ranks)[rank]])
            add(name.replace("gate_proj", "gate_up_proj"),
                ShardMap(kind="gate_up", canonical=(name, up), shape=tuple(sd[name].shape),
                         dtype="BF16", rank=rank, ranks=ranks), fused)
    return maps, local


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


def receivers(cfg: ReferenceConfig, sd: State, store: MemoryStore, tps: tuple[int, ...],
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
    return merge(ReceiverProfile(tensors=r.profile()["tensors"]) for r in rx)


def exact(cfg: ReferenceConfig, models: list[tuple[ReferenceModel, int, int]], sd: State) -> bool:
    for model, tp, r in models:
        dense = ReferenceModel(cfg, tp_size=tp, tp_rank=r)
        dense.load_weights(sd.items())
        a, b = dense_state(model), dense_state(dense)
        if not all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a):
            return False
    return True


def test_tensor_parallel_trainer_ranks_refit_vllm_ranks_bit_exactly(tmp_path: Path) -> None:
    old = random_checkpoint(DENSE, 0)
    new = perturbed(old, 0.02, 1)
    store = MemoryStore()
    rx, models = receivers(DENSE, old, store, (2, 1), tmp_path)
    profile = profile_of(rx)
    owners = []
    for rank in range(2):
        maps, base = tp_shards(old, rank, 2)
        enc = ShardEncoder(store=store, maps=maps, baseline=base, version=0, owner=rank,
                           owners=2, profile=profile)
        enc.set_candidate(tp_shards(new, rank, 2)[1], 1)
        owners.append(enc)
    commits = SqliteCommitStore(tmp_path / "c.db", V0)
    coord = Coordinator(commits, owners, rx)
    record = coord.refit(1, "v1")
    assert [h.outcome for h in coord.history] == ["committed"]
    assert record == commits.read()
    assert exact(DENSE, models, new)
    assert [o.version for o in owners] == [1, 1]
    changed = sum(o.manifests[-1].stats.changed_elements for o in owners)
    replicated = sum(t.numel() for n, t in new.items() if t.dim() == 1)
    want = sum(int((bits(new[n]) != bits(old[n])).sum()) for n in new)
    assert want - replicated <= changed <= want  # replicas send once: no double counting
    coord.close()


def test_a_failed_first_attempt_of_shard_owners_is_repaired_by_overwrite(tmp_path: Path) -> None:
    old = random_checkpoint(DENSE, 0)
    new = perturbed(old, 0.02, 2)
    store = MemoryStore()
    rx, models = receivers(DENSE, old, store, (2,), tmp_path)
    local = rx[1].engine
    assert isinstance(local, LocalDriver)
    engine = local.ranks[0].engine  # the rank's apply engine, made by prewarm
    assert engine is not None
    real, calls = engine._write_mapped, 0

    def dying(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        real(*args, **kwargs)
        calls += 1
        if calls == 7:
            engine._write_mapped = real  # type: ignore[method-assign]
            raise RuntimeError("rank 1 died mid-apply")

    engine._write_mapped = dying  # type: ignore[method-assign]
    owners = []
    for rank in range(2):
        maps, base = tp_shards(old, rank, 2)
        enc = ShardEncoder(store=store, maps=maps, baseline=base, version=0, owner=rank,
                           owners=2)
        enc.set_candidate(tp_shards(new, rank, 2)[1], 1)
        owners.append(enc)
    commits = SqliteCommitStore(tmp_path / "c.db", V0)
    coord = Coordinator(commits, owners, rx)
    coord.refit(1, "v1")
    assert [(h.mode, h.outcome.split(":")[0]) for h in coord.history] == [
        ("mixed", "failed"), ("overwrite", "committed")]
    assert all(o.manifests[-1].mode == "overwrite" for o in owners)
    assert exact(DENSE, models, new)
    coord.close()


def test_expert_parallel_ranks_publish_their_stacks_in_canonical_coordinates(
        tmp_path: Path) -> None:
    old = random_checkpoint(MOE, 0)
    new = perturbed(old, 0.03, 3)
    store = MemoryStore()
    rx, models = receivers(MOE, old, store, (2,), tmp_path)
    owners = []
    for rank in range(2):
        maps, base = ep_shards(old, MOE, rank, 2)
        enc = ShardEncoder(store=store, maps=maps, baseline=base, version=0, owner=rank,
                           owners=2)
        enc.set_candidate(ep_shards(new, MOE, rank, 2)[1], 1)
        owners.append(enc)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx)
    coord.refit(1, "v1")
    assert exact(MOE, models, new)
    coord.close()


def test_shard_maps_refuse_what_they_cannot_project() -> None:
    with pytest.raises(ConfigError, match="does not split into 3 equal parts"):
        ShardMap(kind="rows", canonical=("w",), shape=(4, 4), dtype="BF16", rank=0, ranks=3)
    with pytest.raises(ConfigError, match="needs a 2-D tensor"):
        ShardMap(kind="columns", canonical=("w",), shape=(4, 4, 4), dtype="BF16", ranks=2)
    with pytest.raises(ConfigError, match="names 2 canonical tensors"):
        ShardMap(kind="gate_up", canonical=("g",), shape=(4, 4), dtype="BF16")
    with pytest.raises(ConfigError, match=r"outside 0\.\.1"):
        ShardMap(kind="rows", canonical=("w",), shape=(4, 4), dtype="BF16", rank=2, ranks=2)
    m = ShardMap(kind="rows", canonical=("w",), shape=(4, 4), dtype="BF16", rank=1, ranks=2)
    with pytest.raises(ConfigError, match=r"is \[4, 4\]; rank 1/2 of a rows split"):
        list(m.project(np.zeros((4, 4), np.uint16), np.zeros((4, 4), np.uint16), "xor"))
    enc = ShardEncoder(store=MemoryStore(), maps={"w": m}, baseline={"w": np.zeros((2, 4),
                       np.uint16)}, version=0,
                       profile=ReceiverProfile(tensors={"w": "dense"}))
    enc.set_candidate({"w": np.ones((2, 4), np.uint16)}, 1)
    attempt = Attempt(transition=Transition(base_version=0, target_version=1), mode="mixed",
                      receivers=("r",), deadline=1e12)
    with pytest.raises(ConfigError, match="dense class"):
        enc.publish(attempt)
    with pytest.raises(BaselineError, match="The baseline stays"):
        enc.advance_baseline(CommitRecord(committed_version=1, baseline_id="x", attempt="a-x"))
    assert enc.version == 0
