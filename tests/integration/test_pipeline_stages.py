"""Pipeline parallelism: each stage applies the tensors it holds, through its own loader.

An engine of two pipeline stages of two tensor-parallel ranks each (four ranks, numbered
stage * 2 + TP rank as vLLM numbers them) is one receiver. A stage's loader skips the
tensors of other stages, as vLLM's does, so prewarm classes them ``skip`` on that rank and
the merged profile has each tensor's class from the ranks that hold it. Refits are
bit-exact with a dense load on every rank, the sharded checks run on every stage, and a
bit flipped on the last stage's head fails the attempt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shardrig import V0, perturbed

from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.errors import ConfigError
from dcr.format.profile import ReceiverProfile
from dcr.owner.encoder import Encoder
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings, RefitFailed
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import (
    ReferenceConfig,
    ReferenceModel,
    dense_state,
    random_checkpoint,
    stage_layers,
)
from dcr.serve.local import LocalDriver
from dcr.serve.settings import ServeSettings
from dcr.transport.receive import StoreSource
from dcr.transport.store import MemoryStore

CFG = ReferenceConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=False, num_experts=4,
                      moe_intermediate_size=16)
TP, PP = 2, 2


def _source(sd: dict[str, torch.Tensor]) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                .view("<u2")) for n, t in sd.items()})


def _stages(sd: dict[str, torch.Tensor]) -> list[ReferenceModel]:
    models = []
    for rank in range(TP * PP):
        stage, tp_rank = divmod(rank, TP)
        model = ReferenceModel(CFG, tp_size=TP, tp_rank=tp_rank, pp_size=PP, pp_rank=stage)
        model.load_weights(sd.items())
        models.append(model)
    return models


def _exact(models: list[ReferenceModel], sd: dict[str, torch.Tensor]) -> bool:
    for model, dense in zip(models, _stages(sd), strict=True):
        a, b = dense_state(model), dense_state(dense)
        if sorted(a) != sorted(b) or not all(
                torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a):
            return False
    return True


def test_stages_split_the_layers_as_vllm_does_and_hold_what_a_tp_only_rank_holds() -> None:
    assert [list(stage_layers(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(4, 3, r)) for r in range(3)] == [[0], [1, 2], [3]]
    sd = random_checkpoint(CFG, 0)
    whole = [ReferenceModel(CFG, tp_size=TP, tp_rank=r) for r in range(TP)]
    for m in whole:
        m.load_weights(sd.items())
    held: set[str] = set()
    for rank, model in enumerate(_stages(sd)):
        stage, tp_rank = divmod(rank, TP)
        mine = dense_state(model)
        tp_only = dense_state(whole[tp_rank])
        assert all(torch.equal(t.view(torch.uint8), tp_only[n].view(torch.uint8))
                   for n, t in mine.items())
        assert ("model.embed_tokens.weight" in mine) == (stage == 0)
        assert ("lm_head.weight" in mine) == (stage == PP - 1)
        held |= set(mine)
    assert held == set(dense_state(whole[0]))  # every runtime tensor lives on some stage


def test_a_refit_through_four_ranks_of_two_stages_is_bit_exact_and_checked_per_stage(
        tmp_path: Path) -> None:
    old = random_checkpoint(CFG, 0)
    states = [old, perturbed(old, 0.03, 1), perturbed(old, 0.03, 2)]
    store = MemoryStore()
    models = _stages(old)
    staging = tmp_path / "staging"
    engine = LocalDriver(models, staging_dir=staging, checkpoint_root=tmp_path)
    canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                 for n, t in old.items()]
    agent = AgentService("pp2-tp2", engine, lambda spec: StoreSource(
        store=store, version=spec.target_version, attempt=spec.attempt, owners=spec.owners),
        canonical=canonical, staging_dir=staging, version=0)
    profile = ReceiverProfile.model_validate(agent.profile())
    assert set(profile.tensors.values()) == {"xor"}  # skip on some ranks, held by another
    per_rank = [r.applier.plans for r in engine.ranks]  # type: ignore[union-attr]
    assert per_rank[0]["lm_head.weight"].cls == "skip"
    assert per_rank[-1]["model.embed_tokens.weight"].cls == "skip"
    layer0 = "model.layers.0.mlp.experts.1.down_proj.weight"
    assert per_rank[0][layer0].cls == "xor"
    assert per_rank[2][layer0].cls == "skip"
    assert layer0 in profile.regions  # TP shards of the expert, checked by region
    owner = Encoder(store=store, baseline=_source(old), version=0, profile=profile)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), [owner], [agent])
    for v in (1, 2):
        owner.set_candidate(_source(states[v]), v)
        coord.refit(v, f"v{v}")
        assert _exact(models, states[v])
    assert [h.outcome for h in coord.history] == ["committed", "committed"]
    assert owner.manifests[-1].sums  # the stages' regions went with the manifest

    head = dict(models[-1].named_parameters())["lm_head.weight"]  # last stage, TP rank 1
    with torch.no_grad():
        head.view(-1).view(torch.int16)[7] ^= 1 << 4
    owner.set_candidate(_source(perturbed(states[2], 0.03, 3)), 3)
    coord.settings = CoordinatorSettings(max_attempts=1)
    with pytest.raises(RefitFailed):
        coord.refit(3, "v3")
    assert "'lm_head.weight@" in coord.history[-1].outcome
    coord.close()


def test_what_the_reference_cannot_place_is_refused_by_name(tmp_path: Path) -> None:
    """Stages with options that mean one rank, more stages than layers, tied embeddings
    across stages, and a MoE checkpoint with shared experts (not modelled)."""
    from transformers import Qwen2MoeConfig

    from dcr.runtimes import build_runtime

    Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                   moe_intermediate_size=16, shared_expert_intermediate_size=64,
                   ).save_pretrained(tmp_path / "shared")
    with pytest.raises(ConfigError, match=r"has shared experts \(shared_expert_intermediate"):
        build_runtime("vllm-ref", tmp_path / "shared")
    with pytest.raises(ConfigError, match=r"--pp-size 2, --fp8 \[\] and --expert-parallel are"):
        ServeSettings(runtime="hf", model=tmp_path, pp_size=2)
    with pytest.raises(ConfigError, match="with --pp-size 2 this process holds every rank"):
        ServeSettings(runtime="vllm-ref", model=tmp_path, tp_size=2, tp_rank=1, pp_size=2)
    assert ServeSettings(runtime="vllm-ref", model=tmp_path, tp_size=2, pp_size=3).ranks == [
        0, 1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match="more stages than 3 layers"):
        ReferenceModel(CFG, pp_size=4, pp_rank=0)
    tied = ReferenceConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="tied embeddings"):
        ReferenceModel(tied, pp_size=2, pp_rank=1)
