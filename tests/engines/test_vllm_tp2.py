"""Refits at tensor-parallel size 2: two processes, one rank each, over gloo on loopback.

Each rank is a vLLM model class built for TP 2 (column-parallel fused qkv and gate_up
split by rows, row-parallel o_proj and down_proj split by columns, the vocabulary split
with its padding on the last rank, expert stacks split along their intermediate size),
wrapped as a worker with DCR's extension. The test is the agent: it calls every rank at
once, as ``/collective_rpc`` does, merges the ranks' profiles, stages each version's
payloads in the shared directory, and every rank checks itself against a second model
loaded densely through the extension.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM does not import in this interpreter: the engine "
                    "tier runs with `make test-engines` (tools/engines/setup.sh)")

import vllm_cpu
from ranks import Ranks

from dcr.format.payload import Mode
from dcr.format.profile import ReceiverProfile, merge


@pytest.fixture(scope="module")
def staging(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("staging")


@pytest.fixture(scope="module")
def ranks(versions: Callable[[str], list[Path]], checkpoint_root: Path, staging: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ranks]:
    group = Ranks(2, versions("qwen2-moe")[0], tmp_path_factory.mktemp("rank-logs"), env={
        "DCR_STAGING_DIR": str(staging), "DCR_CHECKPOINT_ROOT": str(checkpoint_root),
        "VLLM_CACHE_ROOT": os.environ["VLLM_CACHE_ROOT"]})
    yield group
    group.close()


def rpc(ranks: Ranks, method: str, target: str, request: object = None) -> list[dict]:
    answers = ranks.call(method, target, None if request is None else json.dumps(request))
    assert [a["rank"] for a in answers] == [0, 1]
    return answers


@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
@pytest.mark.parametrize("family", ["llama-tied", "llama", "qwen2-moe"])
def test_refit_at_tp2_matches_a_dense_load_on_every_rank(
        family: str, mode: Mode, ranks: Ranks, versions: Callable[[str], list[Path]],
        staging: Path) -> None:
    dirs = versions(family)
    for target in ("applied", "dense"):
        ranks.call("build", target, {"model": str(dirs[0])})
    rpc(ranks, "dcr_load_dense", "applied", {"checkpoint": f"{family}/v0", "expect": None})
    answers = rpc(ranks, "dcr_prewarm", "applied", json.loads(
        vllm_cpu.canonical_request(dirs[0])))
    profile = merge(ReceiverProfile(tensors=a["profile"]) for a in answers)
    assert set(profile.tensors.values()) == {"xor"}
    for v in range(1, len(dirs)):
        names, m = vllm_cpu.stage(staging, dirs, v, profile, mode)
        reports = rpc(ranks, "dcr_apply", "applied", {"payloads": names})
        assert all(r["records"] == m.stats.changed_elements for r in reports)
        rpc(ranks, "dcr_load_dense", "dense", {"checkpoint": f"{family}/v{v}",
                                                "expect": {t.name: t.target for t in m.tensors}})
        assert ranks.call("compare", arg=["applied", "dense"]) == [[], []], f"after v{v}"
        applied, dense = rpc(ranks, "dcr_fingerprint", "applied"), rpc(
            ranks, "dcr_fingerprint", "dense")
        assert applied == dense
        assert applied[0]["tensors"] != applied[1]["tensors"]  # each rank holds its shard


def test_each_rank_holds_its_shard_of_every_parallel_layer(
        ranks: Ranks, versions: Callable[[str], list[Path]]) -> None:
    shapes = ranks.call("build", "shapes", {"model": str(versions("qwen2-moe")[0])})
    for rank in shapes:
        assert rank["model.layers.0.self_attn.qkv_proj.weight"] == [64, 64]  # of 128 rows
        assert rank["model.layers.0.self_attn.qkv_proj.bias"] == [64]
        assert rank["model.layers.0.self_attn.o_proj.weight"] == [64, 32]  # of 64 columns
        assert rank["model.layers.0.mlp.shared_expert.gate_up_proj.weight"] == [64, 64]
        assert rank["model.layers.0.mlp.experts.routed_experts.w13_weight"] == [4, 32, 64]
        assert rank["model.layers.0.mlp.experts.routed_experts.w2_weight"] == [4, 64, 16]
        assert rank["model.embed_tokens.weight"] == [512, 64]  # 1024 padded rows, halved
    instances = ranks.call("dcr_instance", "shapes")
    assert [(a["rank"], a["world"]) for a in instances] == [(0, 2), (1, 2)]
    assert instances[0]["instance"] != instances[1]["instance"]  # one per worker process
