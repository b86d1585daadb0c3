"""TRL's GRPOTrainer through dcr.integrations.trl, on dcr serve pods refit through a real S3 server.

Mechanics only (learning is shown by bench/rl.py, not asserted): every refit bit-exact
against a dense load of the trainer's weights, per-token versions on every sample the
reward functions see, no checkpoint written on the trainer's side, a kill mid-refit
recovered, and the staleness bound dropping and drawing again every sample older than it.
A trainer of FSDP2 ranks (gloo processes) refits ``dcr serve`` pods through the same
callback, each rank offering only its own shards.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fsdp2_rank import CONFIG
from hf_pods import hf_pods
from trainer_ranks import TrainerRanks
from transformers import LlamaForCausalLM

from dcr.integrations.trl import DcrWeightSync, FleetRollout, RolloutSettings
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import CoordinatorSettings
from dcr.protocol.records import CommitRecord
from dcr.refit.trainer import Trainer, TrainerSettings, reference_fingerprint
from dcr.rl.job import SIZES, RlSettings
from dcr.rl.loop import exact, run_rl, start_fleet

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
SYNC_RANK = Path(__file__).resolve().parents[1] / "support" / "sync_rank.py"
RANK_TOKEN = "trl-rank-token-0123456789abcdef"
AGENT_TOKEN = "trl-agent-token-0123456789abcdef"


def test_grpo_steps_refit_every_pod_bit_exact_and_survive_a_killed_agent(
        tmp_path: Path) -> None:
    s = RlSettings(out=tmp_path / "rl", steps=3, prompts=2, generations=4, max_tokens=6,
                   kill_step=2, link_mbit=0, rtt_ms=0)
    summary = run_rl(s)
    rows = summary["rows"]
    assert [r["bit_exact"] for r in rows] == [True, True, True]
    # Synchronous refits: step k's batch came from version k - 1 alone, every sample of it
    # carrying its tokens' versions to the reward functions.
    assert [r["versions"] for r in rows] == [{str(k): 8 * 6} for k in range(3)]
    assert all(r["samples"] == r["versioned"] == 8 for r in rows)
    assert rows[1]["killed"] == "agent-0"
    assert rows[1]["attempts"] >= 2
    assert all(r["changed_elements"] > 0 for r in rows)
    # No checkpoint on the trainer's side: TRL saved nothing, the store holds DCR payloads.
    out = tmp_path / "rl"
    assert not (out / "trl").exists() or not any((out / "trl").iterdir())
    assert not list((out / "store").rglob("*.safetensors"))
    assert not (out / "dense").exists()


def test_a_dense_full_checkpoint_refit_beside_each_step_loads_on_every_pod(
        tmp_path: Path) -> None:
    """--dense: after each DCR refit the same weights go to every pod as a full checkpoint
    through the same store; the agents accept the committed version's dense load (the
    commit told them its history) also after a pod was left out and rejoined, and the
    next DCR refit builds on it bit-exact."""
    s = RlSettings(out=tmp_path / "rl", steps=3, prompts=2, generations=4, max_tokens=6,
                   kill_step=2, dense=True, link_mbit=0, rtt_ms=0)
    summary = run_rl(s)
    rows = summary["rows"]
    assert [r["bit_exact"] for r in rows] == [True, True, True]
    assert rows[1]["killed"] == "agent-0"
    timed = [r["dense_refit_s"] is not None for r in rows]
    assert timed == [True, False, True]  # the kill's step times DCR's recovery alone
    assert summary["median"]["dense_refit_s"] > 0
    assert summary["dense_step_ratio"] > 0
    assert not list((tmp_path / "rl" / "dense").rglob("*.safetensors"))  # copies removed


def test_samples_older_than_the_bound_are_dropped_counted_and_drawn_again(
        tmp_path: Path) -> None:
    trainer = Trainer(TrainerSettings(warmup_steps=0, **SIZES["tiny"]))
    base = trainer.export(tmp_path / "base")
    fleet = start_fleet(tmp_path, base, pods=1, store_kind="s3", link_mbit=0, rtt_ms=0)
    try:
        sync = DcrWeightSync.for_model(
            trainer.model, store=fleet.boundary.direct_store(), overlap=True,
            dtype=torch.bfloat16, coordinator_for=fleet.coordinator_for(
                tmp_path / "commit.db", CoordinatorSettings(attempt_timeout_s=300.0)))
        held = SimpleNamespace(killed=threading.Event())  # the refit's publish waits on it
        fleet.kills.killer = held  # type: ignore[assignment]
        waited = sync.wait

        def wait() -> None:  # the rollout waits for the refit only once it dropped samples
            held.killed.set()
            waited()

        sync.wait = wait  # type: ignore[method-assign]
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.01)
        sync.on_step_end(None, SimpleNamespace(global_step=1), None, model=trainer.model)
        assert (sync.version, sync.committed) == (1, 0)  # the refit to 1 is held
        door = [p.door for p in fleet.pods]
        bounded = FleetRollout(door, sync=sync, settings=RolloutSettings(
            max_tokens=4, max_staleness=0))
        samples, stats = bounded.generate([[100, 101]] * 3)
        assert stats.dropped == 3
        assert all(s.versions == [1] * 4 for s in samples)
        assert all(len(s.logprobs) == 4 and all(x <= 0 for x in s.logprobs) for s in samples)
        assert sync.committed == 1
        assert exact(fleet, base, trainer.model)
        free = FleetRollout(door, sync=None, settings=RolloutSettings(max_tokens=4))
        _, stats = free.generate([[100]] * 2)
        assert (stats.dropped, dict(stats.versions)) == (0, {1: 8})
    finally:
        fleet.close()


@pytest.mark.timeout(600)
def test_fsdp2_ranks_offer_their_shards_and_rank_0_refits_every_pod_bit_exact(
        tmp_path: Path) -> None:
    """Two gloo ranks train a ``fully_shard`` Llama (FP32 master weights) and call the
    callback after each real AdamW step, as TRL does (``DcrWeightSync.for_ranks``): each
    rank offers its own shards, BF16, to the owner it serves (no gather, no checkpoint),
    and rank 0's ``LocalFleet`` refits two ``dcr serve`` pods. Every version is on every
    pod bit-exact against a dense load of the gathered weights, and the commit record
    and the agents say it."""
    torch.manual_seed(0)
    v0 = tmp_path / "v0"
    LlamaForCausalLM(CONFIG).to(torch.bfloat16).save_pretrained(v0)
    store = tmp_path / "store"
    with hf_pods(tmp_path, v0, store, AGENT_TOKEN) as agents:
        (tmp_path / "fleet.json").write_text(json.dumps({
            "agents": [a.url for a in agents], "agent_token": AGENT_TOKEN,
            "record": str(tmp_path / "commit.db")}))
        with TrainerRanks.start(2, v0, 0, store.as_uri(), RANK_TOKEN, tmp_path,
                                worker=SYNC_RANK) as ranks:
            for version in (1, 2, 3):
                assert min(ranks.step(version)) > 0  # both ranks offered changed elements
                want = reference_fingerprint(ranks.out / f"v{version}", "hf")
                for agent in agents:
                    assert agent.fingerprint() == want, f"{agent.name} differs at v{version}"
                    assert agent.status().version == version
    record = SqliteCommitStore(tmp_path / "commit.db", CommitRecord(
        committed_version=0, baseline_id="", attempt="")).read()
    assert record.committed_version == 3
    # Each rank published its own part of every version; no checkpoint went to the store.
    parts = sorted(p.name for p in store.rglob("manifest-o*.dcrm"))
    assert parts == sorted(["manifest-o0000.dcrm", "manifest-o0001.dcrm"] * 3)
    assert not list(store.rglob("*.safetensors"))
