"""Retention for a trainer's own fleet of rank owners (``LocalFleet``), every party a process.

Two FSDP2 training ranks serve their shards, two ``dcr agent`` + ``dcr serve`` pods refit
through a real S3 server, and ``snapshot_every=2, keep_snapshots=1``: after versions 2
and 4 the ranks write a snapshot from memory, the next commit adopts it, and the deltas
before the newest snapshot leave the store. A late ``dcr materialize`` (with the public
starting model as its seed, which the history no longer vouches for) and a pod started
afterwards on v0 reach version 5 from the snapshot plus the delta after it: the built
file's integer views equal the ranks' dense export, and the new pod's engine holds what
a dense load of it holds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp2_rank import CONFIG
from hf_pods import hf_pods
from safetensors.torch import load_file
from trainer_ranks import TrainerRanks
from transformers import LlamaForCausalLM

from dcr.coordinate import LocalFleet
from dcr.files.history import HistoryStore
from dcr.protocol.coordinator import CoordinatorSettings
from dcr.refit.trainer import reference_fingerprint
from dcr.transport.store import open_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RANK_TOKEN = "local-fleet-rank-token-0123456789"
AGENT_TOKEN = "local-fleet-agent-token-0123456789"


def test_rank_fleet_snapshots_on_schedule_prunes_older_deltas_and_late_pods_build_from_it(
        tmp_path: Path, s3_env) -> None:
    torch.manual_seed(0)
    v0 = tmp_path / "v0"
    LlamaForCausalLM(CONFIG).to(torch.bfloat16).save_pretrained(v0)
    store = open_store(s3_env.uri)
    with TrainerRanks.start(2, v0, 0, store.uri, RANK_TOKEN, tmp_path) as ranks, \
            hf_pods(tmp_path, v0, store.uri, AGENT_TOKEN) as agents:
        fleet = LocalFleet(name="policy", store=store.uri, record=tmp_path / "commit.db",
                           owners=ranks.urls, owner_token=RANK_TOKEN,
                           agents=[a.url for a in agents], agent_token=AGENT_TOKEN,
                           settings=CoordinatorSettings(attempt_timeout_s=300.0),
                           snapshot_every=2, keep_snapshots=1)
        done = {}
        for version in range(1, 6):
            assert min(ranks.step(version)) > 0
            done[version] = fleet.refit(version)
            want = reference_fingerprint(ranks.out / f"v{version}", "hf")
            for agent in agents:
                assert agent.fingerprint() == want, f"{agent.name} differs at v{version}"
        assert [v for v, d in done.items() if d.snapshot is not None] == [2, 4]
        assert "snapshots/v0000000002/" in done[5].removed
        history = HistoryStore(store, fleet.commits.read().history_digest).read()
        assert [s.version for s in history.snapshots] == [4]
        assert [c.version for c in history.versions] == [4, 5]
        assert not [k for k in store.list("") if k.startswith(
            ("v0000000001/", "v0000000002/", "v0000000003/", "snapshots/v0000000002/"))]
        seed = shutil.copytree(v0, tmp_path / "later" / "v0")  # the new pod's own copy
        with hf_pods(tmp_path / "later", seed, store.uri, AGENT_TOKEN, n=1) as (new,):
            assert new.rejoin(5).version == 5
            assert new.fingerprint() == reference_fingerprint(ranks.out / "v5", "hf")
        target = load_file(str(ranks.out / "v5" / "model.safetensors"))
    out = tmp_path / "late-pod"
    run = subprocess.run([sys.executable, "-m", "dcr", "materialize", "--store", store.uri,
                          "--out", str(out), "--held", "0", "--seed", str(v0), "--json"],
                         capture_output=True, text=True, timeout=300, check=False,
                         env=s3_env.env)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert (summary["version"], summary["route"]) == (5, "snapshot")
    built = load_file(str(out / "model.safetensors"))
    assert built.keys() == target.keys()
    for name, t in target.items():
        assert torch.equal(built[name].view(torch.int16), t.view(torch.int16)), name
