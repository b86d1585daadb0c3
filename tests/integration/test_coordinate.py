"""A trainer's own coordinator (``dcr.coordinate.LocalFleet``), every party a process.

Two FSDP2 training ranks (:mod:`trainer_ranks`) serve their shards over the warm-encoder
protocol, two ``dcr agent`` processes each drive a ``dcr serve`` reference server, and a
file store carries the payloads; no operator, no Kubernetes. Each version the ranks offer
commits through ``LocalFleet.refit``: every server then holds the bits of a dense load of
rank 0's export (integer views, through the same loader), the SQLite record names it, and
the store's history it vouches for lets a late ``dcr materialize`` reach the last one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fsdp2_rank import CONFIG
from hf_pods import hf_pods
from safetensors.torch import load_file
from trainer_ranks import TrainerRanks
from transformers import LlamaForCausalLM

from dcr.coordinate import LocalFleet, version_name
from dcr.files.history import HistoryStore
from dcr.protocol.agent_api import AgentClient
from dcr.protocol.coordinator import CoordinatorSettings
from dcr.refit.trainer import reference_fingerprint
from dcr.transport.store import FileStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RANK_TOKEN = "local-fleet-rank-token-0123456789"
AGENT_TOKEN = "local-fleet-agent-token-0123456789"


@pytest.fixture
def v0(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(CONFIG).to(torch.bfloat16).save_pretrained(tmp_path / "v0")
    return tmp_path / "v0"


@pytest.fixture
def agents(tmp_path: Path, v0: Path) -> Iterator[list[AgentClient]]:
    """Two rollout pods: a ``dcr serve`` of v0 and the ``dcr agent`` beside it."""
    with hf_pods(tmp_path, v0, tmp_path / "store", AGENT_TOKEN) as clients:
        yield clients


def test_rank_processes_refit_agents_without_kubernetes_and_a_late_pod_catches_up(
        tmp_path: Path, v0: Path, agents: list[AgentClient]) -> None:
    store = FileStore(tmp_path / "store")
    with TrainerRanks.start(2, v0, 0, store.uri, RANK_TOKEN, tmp_path) as ranks:
        fleet = LocalFleet(name="policy", store=store.uri, record=tmp_path / "commit.db",
                           owners=ranks.urls, owner_token=RANK_TOKEN,
                           agents=[a.url for a in agents], agent_token=AGENT_TOKEN,
                           settings=CoordinatorSettings(attempt_timeout_s=300.0))
        assert RANK_TOKEN not in repr(fleet)
        for version in (1, 2, 3):
            assert min(ranks.step(version)) > 0  # both ranks changed elements
            done = fleet.refit(version)
            assert done.attempts[-1].outcome == "committed"
            assert done.record.baseline_id == version_name("policy", version)
            want = reference_fingerprint(ranks.out / f"v{version}", "hf")
            for agent in agents:
                assert agent.fingerprint() == want, f"{agent.name} differs at v{version}"
                assert agent.status().version == version
        again = fleet.refit(3)  # asked again: finished, not refit
        assert again.record == done.record
        assert again.attempts == ()
    record = fleet.commits.read()
    assert (record.committed_version, record.attempt) == (3, done.record.attempt)
    history = HistoryStore(store, record.history_digest).read()
    assert [c.version for c in history.versions] == [1, 2, 3]
    assert history.committed == 3
    out = tmp_path / "late-pod"
    run = subprocess.run([sys.executable, "-m", "dcr", "materialize", "--store", store.uri,
                          "--out", str(out), "--held", "0", "--seed", str(v0), "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["version"] == 3
    built = load_file(str(out / "model.safetensors"))
    target = load_file(str(ranks.out / "v3" / "model.safetensors"))
    assert built.keys() == target.keys()
    for name, t in target.items():
        assert torch.equal(built[name].view(torch.int16), t.view(torch.int16)), name
