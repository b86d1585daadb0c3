"""The main job (`dcr refit`, `make demo`): rollout pods of a real ``dcr serve`` server
and a ``dcr agent`` sidecar, real encoder processes, an agent or a server killed
mid-refit, recovery by overwrite retry and dense rejoin, bits checked per step through
the servers' fingerprints.

It is the one demo: every refit it makes is bit-exact on every in-place receiver
(transformers servers and a vLLM-layout TP2 server), a small share of the weights
changes per step, and the receivers' merged profile sends most bytes as XOR (the
coverage line). The file-level path of the earlier demo is checked in
``test_file_refit.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_refit_job_recovers_from_a_killed_agent_and_ends_bit_exact(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dcr", "refit", "--out", "out", "--steps", "2", "--agents", "2",
         "--owners", "2", "--kill-receiver-every", "2"],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    rows = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["bit_exact"] for r in rows)
    assert [(a["mode"], a["outcome"]) for a in rows[0]["attempts"]] == [("mixed", "committed")]
    second = rows[1]["attempts"]
    assert [a["mode"] for a in second] == ["mixed", "overwrite"]
    assert second[0]["outcome"].startswith("failed: Agent agent-0")
    assert second[1]["outcome"] == "committed"
    assert rows[1]["killed"] == "agent-0"
    # The restarted agent rejoins by a dense refit: at the retry's admission if it was
    # back in time, else right after the commit (between attempts either way).
    if "agent-0" in second[1]["receivers"]:
        assert second[1]["rejoined"] == ["agent-0"]
    else:
        assert rows[1]["rejoined_after"] == ["agent-0"]
    assert rows[1]["record"] == {"committed_version": 2, "baseline_id": rows[1]["record"][
        "baseline_id"], "attempt": second[1]["attempt"]}
    assert all(0 < r["payload_bytes"] < r["dense_bytes"] / 4 for r in rows)
    assert all(0 < r["changed_pct"] < 20 for r in rows)
    assert all(r["attempts"][-1]["payload_bytes"] > 0 for r in rows)  # applied in place
    assert (out / "refit.png").stat().st_size > 10_000
    assert "coverage (share of weight bytes by path): xor" in proc.stdout
    assert "all 2 refits bit-exact on every live agent" in proc.stdout


@pytest.mark.slow
def test_refit_job_over_a_relay_tree_recovers_from_a_killed_agent_and_a_killed_server(
        tmp_path: Path) -> None:
    """Step 1 kills pod 1's agent, step 2 pod 0's server: the restarted server answers a
    new instance id, so its agent reports unknown weights and is restored by a dense
    refit before the pod counts again; both steps end bit-exact on every pod."""
    proc = subprocess.run(
        [sys.executable, "-m", "dcr", "refit", "--out", "out", "--steps", "2", "--agents", "2",
         "--transport", "relay", "--kill-receiver-every", "1"],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert all(r["bit_exact"] for r in rows)
    assert [r["killed"] for r in rows] == ["agent-1", "serve-0"]
    for r in rows:
        assert [a["mode"] for a in r["attempts"]] == ["mixed", "overwrite"]
        assert r["attempts"][-1]["outcome"] == "committed"
    assert "serve-0" not in rows[1]["attempts"][0]["outcome"]  # the agent saw it fail:
    assert "agent-0" in rows[1]["attempts"][0]["outcome"]  # the pod's failure is its agent's
    second = rows[1]["attempts"][1]
    if "agent-0" in second["receivers"]:  # the server was back by the retry's admission
        assert second["rejoined"] == ["agent-0"]
    else:
        assert rows[1]["rejoined_after"] == ["agent-0"]
    assert "relay tree of 2 nodes" in proc.stdout
    assert "all 2 refits bit-exact on every live agent" in proc.stdout
