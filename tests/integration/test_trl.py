"""TRL's GRPOTrainer through dcr.integrations.trl, on dcr serve pods refit through a real S3 server.

Mechanics only (learning is shown by bench/rl.py, not asserted): every refit bit-exact
against a dense load of the trainer's weights, per-token versions on every sample the
reward functions see, no checkpoint written on the trainer's side, a kill mid-refit
recovered, and the staleness bound dropping and drawing again every sample older than it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dcr.integrations.trl import DcrWeightSync, FleetRollout, RolloutSettings
from dcr.protocol.coordinator import CoordinatorSettings
from dcr.refit.trainer import Trainer, TrainerSettings
from dcr.rl.job import SIZES, RlSettings
from dcr.rl.loop import exact, run_rl, start_fleet

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


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
