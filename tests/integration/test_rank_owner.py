"""Owners inside the trainer's ranks: offer after a step, publish when asked, advance on a commit.

Two Megatron-style ranks (fused qkv in the group layout, fused gate/up, row and column
splits) are :class:`RankOwner` objects over live tensors that the trainer overwrites as
soon as an offer returns; vLLM-layout receivers still end with the offered bits. Over the
warm-encoder protocol a rank answers only its own owner index, only the token, and advances
by the commit record a later request carries when it missed the commit itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from shardrig import DENSE, MOE, V0, bits, exact, perturbed, profile_of, receivers, tp_shards

from dcr.errors import BaselineError, ConfigError
from dcr.owner.rank import RankOwner, host_bits, serve
from dcr.owner.shards import ShardMap
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.encoder_api import EncoderClient, EncoderError, PublishRequest
from dcr.runtimes.vllm_reference import random_checkpoint
from dcr.transport.store import FileStore, MemoryStore

TOKEN = "rank-owner-test-token-0123456789"


def ranks(sd: dict[str, torch.Tensor], store: MemoryStore | FileStore, n: int = 2
          ) -> tuple[list[RankOwner], list[dict[str, torch.Tensor]]]:
    """``n`` rank owners at version 0 and the live tensors each trains."""
    owners, live = [], []
    for r in range(n):
        maps, local = tp_shards(sd, r, n, qkv=DENSE)
        tensors = {k: t.clone() for k, t in local.items()}
        owners.append(RankOwner(store=store, maps=maps, tensors=tensors, version=0, rank=r,
                                ranks=n, copy_bytes=512))  # several copy steps per tensor
        live.append(tensors)
    return owners, live


def step(live: list[dict[str, torch.Tensor]], sd: dict[str, torch.Tensor]) -> None:
    """The trainer's optimizer step: the live tensors now hold ``sd``'s shards."""
    for r, tensors in enumerate(live):
        for k, t in tp_shards(sd, r, len(live), qkv=DENSE)[1].items():
            tensors[k].copy_(t)


def test_rank_owners_with_fused_qkv_refit_vllm_ranks_while_the_trainer_steps_on(
        tmp_path: Path) -> None:
    v0 = random_checkpoint(DENSE, 0)
    v1 = perturbed(v0, 0.02, 1)
    v2 = perturbed(v1, 0.02, 2)
    store = MemoryStore()
    rx, models = receivers(DENSE, v0, store, (2, 1), tmp_path)
    owners, live = ranks(v0, store)
    for o in owners:
        o.profile = profile_of(rx)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx)
    step(live, v1)
    for o, tensors in zip(owners, live, strict=True):
        o.offer(tensors, 1)
    step(live, perturbed(v1, 0.3, 9))  # the trainer goes on before the refit runs
    coord.refit(1, "v1")
    assert exact(DENSE, models, v1)
    assert [o.version for o in owners] == [1, 1]
    assert all(not o.offers for o in owners)
    step(live, v2)
    for o, tensors in zip(owners, live, strict=True):
        o.offer(tensors, 2)
    coord.refit(2, "v2")
    assert exact(DENSE, models, v2)
    changed = sum(o.manifests[-1].stats.changed_elements for o in owners)
    want = sum(int((bits(v2[n]) != bits(v1[n])).sum()) for n in v2)
    replicated = sum(t.numel() for t in v2.values() if t.dim() == 1)
    assert want - replicated <= changed <= want
    coord.close()


def test_qkv_maps_address_every_canonical_element_once() -> None:
    sd = random_checkpoint(DENSE, 0)
    name = "model.layers.0.self_attn.q_proj.weight"
    seen = {n: np.zeros(sd[n].numel(), np.int64) for n in
            (name, name.replace("q_proj", "k_proj"), name.replace("q_proj", "v_proj"))}
    for r in range(2):
        maps, local = tp_shards(sd, r, 2, qkv=DENSE)
        key = name.replace("q_proj", "qkv_proj")
        base = bits(local[key])
        for delta in maps[key].project(base, ~base, "overwrite"):
            where = seen[delta.name]
            where[delta.start + delta.positions] += 1
            np.testing.assert_array_equal(  # the values are the canonical element's bits
                delta.values, ~bits(sd[delta.name]).reshape(-1)[delta.start + delta.positions])
    assert all((s == 1).all() for s in seen.values())


def test_an_offer_copies_in_steps_and_keeps_only_what_differs(tmp_path: Path) -> None:
    t = torch.arange(1000, dtype=torch.int32).to(torch.bfloat16)
    whole = np.concatenate([b for _, b in host_bits(t, copy_bytes=1 << 20)])
    steps = list(host_bits(t, copy_bytes=64))
    assert len(steps) == 32
    assert [lo for lo, _ in steps] == list(range(0, 1000, 32))
    np.testing.assert_array_equal(np.concatenate([b for _, b in steps]), whole)
    m = ShardMap(kind="replicated", canonical=("w",), shape=(1000,), dtype="BF16")
    owner = RankOwner(store=MemoryStore(), maps={"w": m}, tensors={"w": t}, version=3,
                      copy_bytes=64)
    u = t.clone()
    u[[5, 500, 999]] += 100
    overlay = owner.offer({"w": u}, 4)
    assert overlay.changes["w"][0].tolist() == [5, 500, 999]
    np.testing.assert_array_equal(overlay.bits("w", owner.baseline["w"]),
                                  u.view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(ConfigError, match="version 4 is not after 4"):
        owner.offer({"w": u}, 4)
    with pytest.raises(ConfigError, match="different tensors"):
        owner.offer({"x": u}, 5)
    with pytest.raises(ConfigError, match=r"is torch\.float32"):
        owner.offer({"w": u.float()}, 5)


def test_a_rank_advances_only_for_a_commit_naming_an_attempt_it_published() -> None:
    sd = random_checkpoint(DENSE, 0)
    (owner,), (live,) = ranks(sd, MemoryStore(), 1)
    step([live], perturbed(sd, 0.05, 3))
    owner.offer(live, 1)
    owner.write(attempt="a-1", mode="mixed", base_version=0, target_version=1)
    before = {k: v.copy() for k, v in owner.baseline.items()}
    for version, attempt in ((1, "a-forged"), (2, "a-1")):
        with pytest.raises(BaselineError, match="The baseline stays at 0"):
            owner.advance(version, attempt)
    assert owner.version == 0
    assert all((owner.baseline[k] == before[k]).all() for k in before)
    owner.advance(1, "a-1")
    assert owner.version == 1
    assert all((owner.baseline[k] == bits(live[k])).all() for k in live)
    owner.advance(1, "a-1")  # a second notice of the same commit does nothing
    assert owner.version == 1


def test_over_http_a_rank_answers_its_own_index_only_and_advances_by_the_next_request(
        tmp_path: Path) -> None:
    sd = random_checkpoint(DENSE, 0)
    store = FileStore(tmp_path / "store")
    owners, live = ranks(sd, store)
    v1 = perturbed(sd, 0.05, 4)
    step(live, v1)
    for o, tensors in zip(owners, live, strict=True):
        o.offer(tensors, 1)
    servers = [serve(o, token=TOKEN) for o in owners]
    try:
        client = EncoderClient(servers[1].url, TOKEN, name="rank-1")

        def request(**kw: object) -> PublishRequest:
            fields = {"attempt": "a-one", "mode": "mixed", "base_version": 0,
                      "target_version": 1, "owner": 1, "owners": 2, "base": "/ranks/v0",
                      "target": "/ranks/v1", **kw}
            return PublishRequest.model_validate(fields)

        with pytest.raises(EncoderError, match="Missing or wrong bearer token") as e:
            EncoderClient(servers[1].url, "x" * 32).publish(request(), timeout_s=30)
        assert e.value.status == 401
        with pytest.raises(EncoderError, match="rank 1 of 2; the request is for owner 0"):
            client.publish(request(owner=0), timeout_s=30)
        with pytest.raises(EncoderError, match="version 3 was not offered") as e:
            client.publish(request(target_version=3), timeout_s=30)
        assert e.value.status == 409
        summary = client.publish(request(), timeout_s=30)
        assert (summary["attempt"], summary["version"]) == ("a-one", 1)
        assert summary["store"] == store.uri
        assert list((tmp_path / "store").rglob("manifest-o0001.dcrm"))
        # The commit notice never came; the trainer stepped and offered version 2.
        step(live, perturbed(v1, 0.05, 5))
        owners[1].offer(live[1], 2)
        with pytest.raises(EncoderError, match="names version 1 by attempt 'a-forged'"):
            client.publish(request(attempt="a-two", base_version=1, target_version=2,
                                   committed_attempt="a-forged"), timeout_s=30)
        assert owners[1].version == 0
        client.publish(request(attempt="a-two", base_version=1, target_version=2,
                               committed_attempt="a-one"), timeout_s=30)
        assert owners[1].version == 1
        assert all((owners[1].baseline[k] == bits(tp_shards(v1, 1, 2, qkv=DENSE)[1][k])).all()
                   for k in live[1])
    finally:
        for s in servers:
            s.close()


def test_a_rank_refuses_a_weak_token() -> None:
    m = ShardMap(kind="replicated", canonical=("w",), shape=(4,), dtype="BF16")
    owner = RankOwner(store=MemoryStore(), maps={"w": m}, tensors={"w": torch.zeros(4,
                      dtype=torch.bfloat16)}, version=0)
    with pytest.raises(ConfigError, match="rank 0's encoder token is 5 characters"):
        serve(owner, token="short")


def ep_ranks(sd: dict[str, torch.Tensor], rank: int, ranks: int
             ) -> tuple[dict[str, ShardMap], dict[str, torch.Tensor]]:
    """An expert-parallel rank as a trainer holds it: one stack per projection of its
    experts, each expert named by a one-expert view of the stack (so the owner's baseline
    copies each expert once), everything else replicated."""
    maps: dict[str, ShardMap] = {}
    local: dict[str, torch.Tensor] = {}
    per = MOE.num_experts // ranks
    for name, t in sd.items():
        if ".experts." not in name:
            maps[name] = ShardMap(kind="replicated", canonical=(name,), shape=tuple(t.shape),
                                  dtype="BF16", rank=rank, ranks=ranks)
            local[name] = t.clone()
    for layer in range(MOE.num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                     for e in range(rank * per, (rank + 1) * per)]
            stack = torch.stack([sd[n] for n in names])  # the trainer's grouped GEMM weight
            for k, n in enumerate(names):
                maps[n] = ShardMap(kind="expert", canonical=(n,), shape=tuple(sd[n].shape),
                                   dtype="BF16", expert=0)
                local[n] = stack[k : k + 1]
    return maps, local


def test_expert_parallel_rank_owners_refit_tp_ranks_that_shard_every_expert(
        tmp_path: Path) -> None:
    """Two expert-parallel trainer ranks (two experts each) publish to TP 2 receivers that
    hold half of every expert: every expert reaches both receiver ranks, bit-exact, and
    each receiver rank checks its half of every expert against the owners' region sums."""
    v0 = random_checkpoint(MOE, 0)
    v1 = perturbed(v0, 0.03, 1)
    store = MemoryStore()
    rx, models = receivers(MOE, v0, store, (2,), tmp_path)
    profile = profile_of(rx)
    owners, live = [], []
    for r in range(2):
        maps, tensors = ep_ranks(v0, r, 2)
        owners.append(RankOwner(store=store, maps=maps, tensors=tensors, version=0, rank=r,
                                ranks=2))
        owners[-1].profile = profile
        live.append(tensors)
    for r, (o, tensors) in enumerate(zip(owners, live, strict=True)):
        for k, t in ep_ranks(v1, r, 2)[1].items():
            tensors[k].copy_(t)
        o.offer(tensors, 1)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx)
    coord.refit(1, "v1")
    assert [h.outcome for h in coord.history] == ["committed"]
    assert exact(MOE, models, v1)
    expert = "model.layers.0.mlp.experts.3.down_proj.weight"  # rank 1's
    assert expert in profile.regions  # each TP receiver rank holds half of it
    parts = [r for r in owners[1].manifests[-1].sums if r.tensor == expert]
    assert len(parts) == 3  # its two TP halves and the whole, all from rank 1
    assert not any(r.tensor == expert for r in owners[0].manifests[-1].sums)
    coord.close()
