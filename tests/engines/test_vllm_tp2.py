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
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM does not import in this interpreter: the engine "
                    "tier runs with `make test-engines` (tools/engines/setup.sh)")

import vllm_cpu
from ranks import Ranks

from dcr.checkpoint import Checkpoint
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


def changed(before: Path, after: Path) -> dict[str, int]:
    """{canonical tensor: how many of its elements' bits differ between two versions}."""
    with Checkpoint(before) as a, Checkpoint(after) as b:
        return {n: int((a.bits(n) != b.bits(n)).sum()) for n in a.names()}


def held(name: str, rank: int, expert_parallel: bool) -> bool:
    """Whether a rank holds (part of) a canonical tensor: all of them at TP 2; with expert
    parallelism, routed experts 0-1 on rank 0 and 2-3 on rank 1 (vLLM's linear placement)."""
    expert = re.search(r"\.mlp\.experts\.(\d+)\.", name)
    return not (expert_parallel and expert) or int(expert[1]) // 2 == rank


def rpc(ranks: Ranks, method: str, target: str, request: object = None) -> list[dict]:
    answers = ranks.call(method, target, None if request is None else json.dumps(request))
    assert [a["rank"] for a in answers] == [0, 1]
    return answers


@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
@pytest.mark.parametrize(("family", "expert_parallel"), [
    ("llama-tied", False), ("llama", False), ("qwen2-moe", False), ("qwen2-moe", True)])
def test_refit_at_tp2_matches_a_dense_load_on_every_rank(
        family: str, expert_parallel: bool, mode: Mode, ranks: Ranks,
        versions: Callable[[str], list[Path]], staging: Path) -> None:
    """With ``expert_parallel`` each rank holds half the experts, whole: its loader skips
    the records of the experts it does not hold, and every element lands exactly once."""
    dirs = versions(family)
    for target in ("applied", "dense"):
        ranks.call("build", target, {"model": str(dirs[0]), "expert_parallel": expert_parallel})
    rpc(ranks, "dcr_load_dense", "applied", {"checkpoint": f"{family}/v0", "expect": None})
    answers = rpc(ranks, "dcr_prewarm", "applied", json.loads(
        vllm_cpu.canonical_request(dirs[0])))
    profile = merge(ReceiverProfile(tensors=a["profile"]) for a in answers)
    assert set(profile.tensors.values()) == {"xor"}
    for v in range(1, len(dirs)):
        names, m = vllm_cpu.stage(staging, dirs, v, profile, mode)
        reports = rpc(ranks, "dcr_apply", "applied", {"payloads": names})
        # Each rank applies every changed element of the tensors it holds, no more.
        changes = changed(dirs[v - 1], dirs[v])
        assert sum(changes.values()) == m.stats.changed_elements
        assert [r["records"] for r in reports] == [
            sum(k for n, k in changes.items() if held(n, rank, expert_parallel))
            for rank in (0, 1)]
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


def test_with_expert_parallelism_each_rank_holds_half_the_experts_whole(
        ranks: Ranks, versions: Callable[[str], list[Path]]) -> None:
    shapes = ranks.call("build", "ep-shapes", {"model": str(versions("qwen2-moe")[0]),
                                               "expert_parallel": True})
    for rank in shapes:
        assert rank["model.layers.0.mlp.experts.routed_experts.w13_weight"] == [2, 64, 64]
        assert rank["model.layers.0.mlp.experts.routed_experts.w2_weight"] == [2, 64, 32]
        assert rank["model.layers.0.mlp.shared_expert.gate_up_proj.weight"] == [64, 64]
