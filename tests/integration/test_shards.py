"""Direct projection: trainer ranks encode their shards in canonical coordinates.

Two Megatron-style tensor-parallel trainer ranks (vocabulary and column-parallel rows,
row-parallel columns, fused gate/up halves, replicated norms), and expert-parallel
ranks holding stacks of experts, each publish as one owner. vLLM-layout receivers
(TP2 ranks and a TP1 rank) end bit-exact with a dense load of the canonical target,
including after a failed first attempt repaired by the overwrite retry.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from shardrig import (
    DENSE,
    MOE,
    V0,
    Shards,
    State,
    bits,
    ep_shards,
    exact,
    perturbed,
    profile_of,
    receivers,
    tp_bits,
)

from dcr.errors import BaselineError, ConfigError
from dcr.format.profile import ReceiverProfile
from dcr.owner.shards import RegionParts, ShardEncoder, ShardMap, sum_regions
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings, RefitFailed
from dcr.protocol.records import Attempt, CommitRecord, Transition
from dcr.runtimes.vllm_reference import random_checkpoint
from dcr.serve.local import LocalDriver
from dcr.transport.store import MemoryStore


def shard_owners(store: MemoryStore, old: State, new: State, local: Callable[[State, int], Shards],
                 profile: ReceiverProfile | None = None) -> list[ShardEncoder]:
    """Two shard owners (ranks 0 and 1) at version 0 over ``local(state, rank)``'s maps
    and bits of ``old``, each with its bits of ``new`` as the candidate for version 1."""
    owners = []
    for rank in range(2):
        maps, base = local(old, rank)
        enc = ShardEncoder(store=store, maps=maps, baseline=base, version=0, owner=rank,
                           owners=2, profile=profile)
        enc.set_candidate(local(new, rank)[1], 1)
        owners.append(enc)
    return owners


def test_tensor_parallel_trainer_ranks_refit_vllm_ranks_bit_exactly(tmp_path: Path) -> None:
    old = random_checkpoint(DENSE, 0)
    new = perturbed(old, 0.02, 1)
    store = MemoryStore()
    rx, models = receivers(DENSE, old, store, (2, 1), tmp_path)
    profile = profile_of(rx)
    owners = shard_owners(store, old, new, lambda sd, r: tp_bits(sd, r, 2), profile=profile)
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
    engine = local.ranks[0].applier  # the rank's applier, made by prewarm
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
    owners = shard_owners(store, old, new, lambda sd, r: tp_bits(sd, r, 2))
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
    owners = shard_owners(store, old, new, lambda sd, r: ep_shards(sd, MOE, r, 2))
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx)
    coord.refit(1, "v1")
    assert exact(MOE, models, new)
    coord.close()


def test_shard_maps_refuse_what_they_cannot_project() -> None:
    with pytest.raises(ConfigError, match="does not split into 3 equal parts"):
        ShardMap(kind="rows", canonical=("w",), shape=(4, 4), dtype="BF16", rank=0, ranks=3)
    with pytest.raises(ConfigError, match="needs a 2-D tensor"):
        ShardMap(kind="columns", canonical=("w",), shape=(4, 4, 4), dtype="BF16", ranks=2)
    with pytest.raises(ConfigError, match="padding rows need a rows split with a span"):
        ShardMap(kind="rows", canonical=("w",), shape=(4, 4), dtype="BF16", ranks=2, pad=2)
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


EXPERT = "model.layers.0.mlp.experts.2.gate_proj.weight"


@pytest.mark.parametrize("owners_kind", ["ep", "tp"])
def test_a_flipped_bit_on_one_expert_of_one_rank_fails_the_attempt(
        tmp_path: Path, owners_kind: str) -> None:
    """Each TP rank of the receiver holds half of every expert, so no rank can recompute an
    expert's whole-tensor fingerprint. Its profile names the region it holds, the owners
    (expert-parallel stacks, or tensor-parallel shards of the MoE's dense tensors with
    the experts replicated) each write their part of that region's sum, and rank 1 finds
    the bit the owners never sent. Without the region sums the attempt commits the bit."""
    old = random_checkpoint(MOE, 0)
    new = perturbed(old, 0.03, 3)
    store = MemoryStore()
    rx, models = receivers(MOE, old, store, (2,), tmp_path)
    profile = profile_of(rx)
    assert any(".experts." in n for n in profile.regions)
    held = dict(models[1][0].named_parameters())["model.layers.0.mlp.experts.w13_weight"]
    with torch.no_grad():
        held[2].view(-1).view(torch.int16)[5] ^= 1 << 3  # expert 2's gate rows, on rank 1
    owners = []
    for rank in range(2):
        maps, base = (ep_shards(old, MOE, rank, 2) if owners_kind == "ep"
                      else tp_bits(old, rank, 2))
        enc = ShardEncoder(store=store, maps=maps, baseline=base, version=0, owner=rank,
                           owners=2, profile=profile)
        enc.set_candidate((ep_shards(new, MOE, rank, 2) if owners_kind == "ep"
                           else tp_bits(new, rank, 2))[1], 1)
        owners.append(enc)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx,
                        settings=CoordinatorSettings(max_attempts=1))
    with pytest.raises(RefitFailed):
        coord.refit(1, "v1")
    (first,) = coord.history
    assert f"'{EXPERT}@" in first.outcome
    assert "holds sum64:" in first.outcome
    assert "tp2-rank1" in first.outcome
    parts = [r for o in owners for r in o.manifests[-1].sums
             if r.tensor == EXPERT and r.spans in profile.regions[EXPERT]]
    assert len(parts) == 2  # a part of each rank's region: from one owner, or one each
    coord.close()


def test_a_profile_region_outside_its_tensor_fails_the_shard_owner_by_name(
        tmp_path: Path) -> None:
    """Receivers' profiles reach the owners; a span past a tensor's end is refused before
    the owner reads a byte for it, and no manifest is written."""
    old = random_checkpoint(DENSE, 0)
    store = MemoryStore()
    name = "model.layers.0.mlp.down_proj.weight"
    maps, base = tp_bits(old, 0, 2)
    shape = tuple(old[name].shape)
    bad = ReceiverProfile(tensors={name: "xor"},
                          regions={name: (((0, (shape[0] + 1, 4), (shape[1], 1)),),)})
    enc = ShardEncoder(store=store, maps=maps, baseline=base, version=0, owner=0, owners=2,
                       profile=bad)
    enc.set_candidate(base, 1)
    attempt = Attempt(transition=Transition(base_version=0, target_version=1), mode="mixed",
                      receivers=("r",), deadline=1e12)
    with pytest.raises(ConfigError, match=rf"A region of '{name}' .* has a span reaching"):
        enc.publish(attempt)
    assert enc.manifests == []


def test_a_rank_holding_a_tensor_whole_checks_the_sum_the_shard_owners_write_of_it(
        tmp_path: Path) -> None:
    """Owners of shards hold no whole tensor, so they list no xxh3 fingerprints; they
    write their shares of each tensor's whole-region sum instead, and a TP 1 receiver,
    which holds every tensor whole, finds a bit flipped in a row-parallel tensor that
    two owners hold by columns. Without those sums nothing checked it."""
    old = random_checkpoint(DENSE, 0)
    new = perturbed(old, 0.02, 4)
    store = MemoryStore()
    rx, models = receivers(DENSE, old, store, (1,), tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    held = dict(models[0][0].named_parameters())[name]
    with torch.no_grad():
        held.view(-1).view(torch.int16)[-1] ^= 1
    owners = shard_owners(store, old, new, lambda sd, r: tp_bits(sd, r, 2),
                          profile=profile_of(rx))
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx,
                        settings=CoordinatorSettings(max_attempts=1))
    with pytest.raises(RefitFailed):
        coord.refit(1, "v1")
    numel = old[name].numel()
    assert f"'{name}@0:{numel}:1' holds sum64:" in coord.history[0].outcome
    listed = [t for o in owners for m in o.manifests for t in m.tensors]
    assert listed  # each owner lists its share of every tensor's additive fingerprint,
    assert all(t.base.startswith("sum64:") and t.target.startswith("sum64:")  # no xxh3
               for t in listed)
    coord.close()


def test_owners_carry_region_parts_from_step_to_step_as_a_fresh_pass_would_find_them(
        tmp_path: Path) -> None:
    """A publish adds what the changes move to the parts over the baseline instead of
    summing the shard again: after three committed steps (each checked by TP 2 and TP 1
    ranks) every owner's carried parts equal a fresh pass over its baseline."""
    states = [random_checkpoint(DENSE, 0)]
    for step in range(3):
        states.append(perturbed(states[-1], 0.02, 10 + step))
    store = MemoryStore()
    rx, models = receivers(DENSE, states[0], store, (2, 1), tmp_path)
    profile = profile_of(rx)
    owners = []
    for rank in range(2):
        maps, base = tp_bits(states[0], rank, 2)
        owners.append(ShardEncoder(store=store, maps=maps, baseline=base, version=0,
                                   owner=rank, owners=2, profile=profile))
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx)
    for v in (1, 2, 3):
        for rank, o in enumerate(owners):
            o.set_candidate(tp_bits(states[v], rank, 2)[1], v)
        coord.refit(v, f"v{v}")
    assert [h.outcome for h in coord.history] == ["committed"] * 3
    assert exact(DENSE, models, states[3])
    for o in owners:
        assert o.parts.base  # carried, not emptied
        fresh = RegionParts()
        for name in sorted(o.maps):
            fresh.of(name, o.maps[name], o.baseline[name], sum_regions(o.maps[name], profile),
                     3, {})
        assert o.parts.base == fresh.base
    coord.close()


def test_megatron_vocabulary_padding_is_held_by_the_ranks_and_never_sent(
        tmp_path: Path) -> None:
    """Megatron pads a vocabulary of 128 to a multiple of 48 x 2 ranks (192): rank 0 holds
    rows 0-95, rank 1 rows 96-127 and 64 padding rows, for the embedding and the output
    layer. The padding changes every step (it is whatever the trainer left there) and is
    never sent; TP 2 and TP 1 receivers end bit-exact with the target."""
    from dcr.owner.layouts import megatron_vocab

    old = random_checkpoint(DENSE, 0)
    new = perturbed(old, 0.02, 5)

    def shards(sd: dict[str, torch.Tensor], rank: int, step: int) -> tuple[dict, dict]:
        maps, local = tp_bits(sd, rank, 2)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            m = megatron_vocab(name, tuple(sd[name].shape), "BF16", rank=rank, ranks=2,
                               divisible_by=48)
            assert m.span is not None
            garbage = np.random.default_rng(10 * step + rank).integers(
                0, 1 << 16, size=(m.pad, sd[name].shape[1]), dtype=np.uint16)
            maps[name] = m
            local[name] = np.concatenate([bits(sd[name][m.span[0]:m.span[1]]), garbage])
        return maps, local

    assert [shards(old, r, 0)[0]["lm_head.weight"].pad for r in (0, 1)] == [0, 64]
    store = MemoryStore()
    rx, models = receivers(DENSE, old, store, (2, 1), tmp_path)
    owners = shard_owners(store, old, new,
                          lambda sd, r: shards(sd, r, 0 if sd is old else 1),
                          profile=profile_of(rx))
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx)
    coord.refit(1, "v1")
    assert [h.outcome for h in coord.history] == ["committed"]
    assert exact(DENSE, models, new)
    want = sum(int((bits(new[n]) != bits(old[n])).sum()) for n in new)
    sent = sum(o.manifests[-1].stats.changed_elements for o in owners)
    replicated = sum(t.numel() for n, t in new.items() if t.dim() == 1)
    assert want - replicated <= sent <= want  # no padding row among them
    coord.close()
