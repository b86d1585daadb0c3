"""``dcr.integrations.trl``'s callback and the RL job's settings refuse what they cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcr.errors import ConfigError
from dcr.integrations.ranks import RankGroup
from dcr.integrations.trl import DcrWeightSync
from dcr.rl.job import RlSettings
from dcr.transport.store import MemoryStore


def owner_of(model: torch.nn.Module) -> DcrWeightSync:
    return DcrWeightSync.for_model(model, coordinator_for=lambda owner: object(),
                                   store=MemoryStore())


def test_the_callback_needs_one_driver_and_ranks_refit_before_the_next_batch() -> None:
    sync = owner_of(torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="a coordinator .* or a rank group"):
        DcrWeightSync(owner=sync.owner)
    with pytest.raises(ConfigError, match="overlap=True is for one process"):
        DcrWeightSync(owner=sync.owner, group=object(), overlap=True)  # type: ignore[arg-type]


def test_a_rank_group_outside_torch_distributed_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs torch.distributed initialized"):
        RankGroup.join(torch.nn.Linear(4, 2), store=MemoryStore(), token="t" * 32,
                       fleet_for=lambda urls: None)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("lr", [0.0, -1e-6, float("nan")])
def test_the_rl_job_refuses_a_learning_rate_that_is_not_positive(lr: float) -> None:
    with pytest.raises(ConfigError, match=f"--lr {lr}"):
        RlSettings(out=Path("rl-out"), lr=lr)
