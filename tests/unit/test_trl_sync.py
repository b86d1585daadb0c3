"""``dcr.integrations.trl``'s callback and the RL job's settings refuse what they cannot run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from stubs import stubs

from dcr.errors import ConfigError
from dcr.integrations.ranks import RankGroup
from dcr.integrations.trl import DcrWeightSync, FleetRollout, RolloutSettings
from dcr.rl.job import RlSettings
from dcr.transport.store import MemoryStore


def owner_of(model: torch.nn.Module) -> DcrWeightSync:
    return DcrWeightSync.for_model(model, coordinator_for=lambda owner: object(),
                                   store=MemoryStore())


def test_the_callback_needs_one_driver_and_ranks_refit_before_the_next_batch() -> None:
    sync = owner_of(torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"a coordinator \(one process\) or a rank group"):
        DcrWeightSync(owner=sync.owner)
    with pytest.raises(ConfigError, match=r"overlap=True is for one process"):
        DcrWeightSync(owner=sync.owner, group=object(), overlap=True)  # type: ignore[arg-type]


def test_a_rank_group_outside_torch_distributed_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"needs torch\.distributed initialized"):
        RankGroup.join(torch.nn.Linear(4, 2), store=MemoryStore(), token="t" * 32,
                       fleet_for=lambda urls: None)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("lr", [0.0, -1e-6, float("nan")])
def test_the_rl_job_refuses_a_learning_rate_that_is_not_positive(lr: float) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"--lr {lr} must be positive")):
        RlSettings(out=Path("rl-out"), lr=lr)


def test_the_rollout_reads_vllm_token_route_answers_with_their_weight_versions() -> None:
    """``api="generate"``: the sample is asked of vLLM's ``/inference/v1/generate`` with
    the token ids and sampling parameters that route takes, and read from its answer's
    shape (logprobs under ``content``, versions as spans)."""
    answer = {"choices": [{"index": 0, "token_ids": [7, 8, 9], "finish_reason": "length",
                           "logprobs": {"content": [{"token_id": t, "logprob": -0.5 * t}
                                                    for t in (7, 8, 9)]},
                           "weight_versions": [{"version": "3", "start": 0, "end": 2},
                                               {"version": "4", "start": 2, "end": 3}]}]}
    with stubs("127.0.0.1") as (door,):
        door.answer = (200, {"Content-Type": "application/json"}, json.dumps(answer).encode())
        rollout = FleetRollout([door.url], sync=None, settings=RolloutSettings(
            api="generate", model="policy", max_tokens=3, temperature=0.7))
        samples, stats = rollout.generate([[1, 2]])
    assert [path for path, _ in door.seen] == ["/inference/v1/generate"]
    body = json.loads(door.bodies[0])
    assert body["token_ids"] == [1, 2]
    assert body["model"] == "policy"
    assert {k: body["sampling_params"][k] for k in ("max_tokens", "temperature", "logprobs")} \
        == {"max_tokens": 3, "temperature": 0.7, "logprobs": 0}
    assert samples[0].completion_ids == [7, 8, 9]
    assert samples[0].logprobs == [-3.5, -4.0, -4.5]
    assert samples[0].versions == [3, 3, 4]
    assert dict(stats.versions) == {3: 2, 4: 1}
