"""The main job (`dcr refit`, `make demo`): rollout pods of a real ``dcr serve`` server
and a ``dcr agent`` sidecar, warm in-process owners (or ``dcr encode`` processes with
``--owner-form process``), an agent or a server killed mid-refit, recovery by overwrite
retry and dense rejoin, bits checked per step through the servers' fingerprints, and a
full-checkpoint refit of every pod through the same store timed beside each step.

By default the store is a real S3 server (``rclone serve s3``) that each pod reaches
through its own emulated link, and a relay's root sits behind one; these tests check
that the bytes really cross those links and that ``--store-kind file`` still works.
They run the trainer at a smaller shape than the demo's, to stay quick.

It is the one demo: every refit it makes is bit-exact on every in-place receiver
(transformers servers and a vLLM-layout TP2 server), a small share of the weights
changes per step, and the receivers' merged profile sends most bytes as XOR (the
coverage line). The warm owner's own rules (checkpoints closed as the baseline
advances, its summaries) are checked in process over in-process receivers. The
file-level path of the earlier demo is checked in ``test_file_refit.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dcr.apply.plan import CanonicalTensor
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.warm import WarmOwner
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.records import CommitRecord
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import (
    ReferenceConfig,
    ReferenceModel,
    dense_state,
    random_checkpoint,
)
from dcr.serve.local import LocalDriver
from dcr.transport.receive import StoreSource
from dcr.transport.store import MemoryStore

CFG = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, tie_word_embeddings=False, num_experts=4,
                      moe_intermediate_size=16)


SMALL = ["--hidden-size", "256", "--intermediate-size", "688", "--layers", "4"]  # 3M


def _refit(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    proc = subprocess.run(
        [sys.executable, "-m", "dcr", "refit", "--out", "out", *SMALL, *args],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, tmp_path / "out"


def _full_refits_ran(rows: list[dict[str, Any]], stdout: str, out: Path) -> None:
    """Every step also refit every pod from the full checkpoint, and the bits held; the
    objects and the pods' copies are gone afterwards."""
    assert all(r["full_s"] > 0 and r["full_upload_s"] > 0 and r["full_load_s"] > 0
               for r in rows)
    assert all(r["full_bit_exact"] for r in rows)
    assert all(r["full_bytes"] > r["dense_bytes"] for r in rows)  # the files, headers too
    assert "total s full s" in stdout
    assert "full-checkpoint refit / DCR refit time: median" in stdout
    full = [p for p in (out / "store").rglob("full") if any(p.rglob("*.safetensors"))]
    assert full == []  # the full checkpoints' objects are deleted
    copies = [p for p in out.rglob("full-agent-*") if p.is_dir()]
    assert copies == []  # and so are the pods' copies


def _links_carried(out: Path, rows: list[dict[str, Any]], pods: int) -> dict[str, Any]:
    """Each pod's link carried at least every full checkpoint it downloaded (and its DCR
    payloads, unless it was left out): the comparison crossed the emulated boundary."""
    boundary = json.loads((out / "boundary.json").read_text())
    assert boundary["store"] == "s3://dcr-demo"
    assert (boundary["link_mbit"], boundary["rtt_ms"]) == (200.0, 20.0)
    links = boundary["links"]
    assert sorted(k for k in links if k.startswith("pod-")) == [f"pod-{i}" for i in range(pods)]
    full = sum(r["full_bytes"] for r in rows)
    assert all(links[f"pod-{i}"]["down"] > full for i in range(pods))
    return dict(links)


@pytest.mark.slow
def test_refit_job_recovers_from_a_killed_agent_and_ends_bit_exact(tmp_path: Path) -> None:
    """The default boundary: S3 behind a link per pod; the owners write directly."""
    proc, out = _refit(tmp_path, "--steps", "2", "--agents", "2", "--owners", "2",
                       "--kill-receiver-every", "2")
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
    record = rows[1]["record"]
    assert record == {"committed_version": 2, "baseline_id": record["baseline_id"],
                      "attempt": second[1]["attempt"],
                      "history_digest": record["history_digest"]}
    assert len(record["history_digest"]) == 32  # the record vouches for the store's history
    # Its pod holds only v0: it built v1 (or v2) from the store's history, through its
    # link, fetching a delta or two and the history, not a checkpoint.
    assert 0 < rows[1]["rejoin_fetched_bytes"] < rows[1]["dense_bytes"] / 2
    assert "rejoins fetched" in proc.stdout
    assert not (out / "pods" / "pod-0" / "weights" / "v1").exists()
    assert all(0 < r["payload_bytes"] < r["dense_bytes"] / 4 for r in rows)
    assert all(0 < r["changed_pct"] <= r["sent_pct"] for r in rows)  # every change is sent
    assert all(r["attempts"][-1]["payload_bytes"] > 0 for r in rows)  # applied in place
    assert (out / "refit.png").stat().st_size > 10_000
    assert "coverage (share of weight bytes by path): xor" in proc.stdout
    assert "2 warm encoders in this process" in proc.stdout
    assert ("boundary: S3 store s3://dcr-demo (rclone serve s3 on loopback); each rollout "
            "pod reaches it through its own emulated link (200 Mbit/s each way, 20 ms "
            "RTT), the trainer's owners directly") in proc.stdout
    assert "every pod downloads through its link and dense-loads" in proc.stdout
    assert "bytes across the boundary" in proc.stdout
    assert "all 2 refits bit-exact on every live agent" in proc.stdout
    _full_refits_ran(rows, proc.stdout, out)
    links = _links_carried(out, rows, pods=2)
    assert "relay-root" not in links
    # The payloads were read from the bucket rclone served.
    assert any((out / "store" / "dcr-demo").rglob("manifest*"))


@pytest.mark.slow
def test_refit_job_over_a_relay_tree_recovers_from_a_killed_agent_and_a_killed_server(
        tmp_path: Path) -> None:
    """Step 1 kills pod 1's agent, step 2 pod 0's server: the restarted server answers a
    new instance id, so its agent reports unknown weights and is restored by a dense
    refit before the pod counts again; both steps end bit-exact on every pod. The
    trainer publishes to the root through a link, which carries every payload, and
    writes each attempt through to the store, whose history the pods rejoin from (they
    hold none of the trainer's checkpoints)."""
    proc, out = _refit(tmp_path, "--steps", "2", "--agents", "2", "--transport", "relay",
                       "--kill-receiver-every", "1")
    rows = json.loads((out / "summary.json").read_text())
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
    assert ("boundary: the trainer reaches the relay root through one emulated link "
            "(200 Mbit/s each way, 20 ms RTT)") in proc.stdout
    assert "2 warm encoders in this process" in proc.stdout  # two owners through the tree
    assert "all 2 refits bit-exact on every live agent" in proc.stdout
    _full_refits_ran(rows, proc.stdout, out)  # through the store beside the relay
    assert "(the relay carries only DCR attempts)" in proc.stdout
    links = _links_carried(out, rows, pods=2)
    committed = sum(r["attempts"][-1]["payload_bytes"] for r in rows)
    assert links["relay-root"]["up"] > committed > 0  # every payload crossed the root's link
    # Each commit dropped, at every member, what it replaced: the failed attempt of its
    # step and the previous step's committed one; only the last commit stays.
    tried = [a["attempt"] for r in rows for a in r["attempts"]]
    for i in range(2):
        log = (out / "relay" / f"relay-{i}.log").read_text()
        dropped = [a for a in tried if f"dropped attempt {a!r}" in log]
        assert dropped == tried[:-1], (i, tried, dropped)


@pytest.mark.slow
def test_refit_job_with_encoder_processes_ends_bit_exact(tmp_path: Path) -> None:
    """``--owner-form process``: two ``dcr encode`` processes per attempt, as encoder Jobs,
    writing to the S3 store directly (their environment, not the pods' links)."""
    proc, out = _refit(tmp_path, "--steps", "1", "--agents", "2", "--owner-form", "process")
    rows = json.loads((out / "summary.json").read_text())
    assert all(r["bit_exact"] for r in rows)
    assert [(a["mode"], a["outcome"]) for a in rows[0]["attempts"]] == [("mixed", "committed")]
    assert all(0 < r["payload_bytes"] < r["dense_bytes"] / 4 for r in rows)
    assert "2 encoder processes per attempt (dcr encode)" in proc.stdout
    assert "all 1 refits bit-exact on every live agent" in proc.stdout
    _full_refits_ran(rows, proc.stdout, out)
    links = _links_carried(out, rows, pods=2)
    # Uploads did not cross a pod's link: each carried up far less than a checkpoint.
    assert all(v["up"] < rows[0]["full_bytes"] / 4 for v in links.values())


@pytest.mark.slow
def test_refit_job_over_a_file_store_emulates_no_boundary(tmp_path: Path) -> None:
    """``--store-kind file``: a directory on this disk, no S3 server, no links."""
    proc, out = _refit(tmp_path, "--steps", "1", "--agents", "2", "--store-kind", "file")
    rows = json.loads((out / "summary.json").read_text())
    assert all(r["bit_exact"] for r in rows)
    assert [(a["mode"], a["outcome"]) for a in rows[0]["attempts"]] == [("mixed", "committed")]
    assert f"store file://{out.resolve() / 'store'}" in proc.stdout
    assert "on this disk: no boundary emulated" in proc.stdout
    assert "bytes across the boundary" not in proc.stdout
    assert json.loads((out / "boundary.json").read_text())["links"] == {}
    assert any((out / "store").rglob("manifest*"))
    _full_refits_ran(rows, proc.stdout, out)


def _export(sd: dict[str, torch.Tensor], path: Path) -> Path:
    path.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in sd.items()}, str(path / "model.safetensors"))
    return path


def _held_files(under: Path) -> list[str]:
    """Files under ``under`` this process still holds open or mapped."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    held += [line.split(maxsplit=5)[-1] for line in
             Path("/proc/self/maps").read_text().splitlines() if line.count(" ") >= 5]
    return sorted({h for h in held if h.startswith(str(under))})


def test_warm_owners_refit_across_a_retry_and_close_each_checkpoint_as_it_is_deleted(
        tmp_path: Path) -> None:
    """Two warm owners, three checkpoints on disk: the first attempt dies mid-apply on one
    rank and is retried by overwrite from the same candidate; each committed version's
    predecessor is deleted, as the demo does, and no file of it stays open or mapped.
    Both ranks end bit-exact with a dense load, and the summaries are the manifests'."""
    torch.manual_seed(0)
    sds = [random_checkpoint(CFG, 0)]
    for _ in range(2):
        sds.append({n: (t.float() + 1e-2 * torch.randn(t.shape)).to(torch.bfloat16)
                    for n, t in sds[-1].items()})
    ckpts = tmp_path / "ckpts"
    for v, sd in enumerate(sds):
        _export(sd, ckpts / f"v{v}")
    store = MemoryStore()
    canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                 for n, t in sds[0].items()]
    ranks, receivers = [], []
    for r in range(2):
        model = ReferenceModel(CFG, tp_size=2, tp_rank=r)
        model.load_weights(sds[0].items())
        staging = tmp_path / f"rank-{r}"
        engine = LocalDriver([model], staging_dir=staging, checkpoint_root=tmp_path)
        ranks.append(model)
        receivers.append(AgentService(
            f"rank-{r}", engine, lambda spec: StoreSource(
                store=store, version=spec.target_version, attempt=spec.attempt,
                owners=spec.owners), canonical=canonical, staging_dir=staging, version=0))
    profile = merge(ReceiverProfile.model_validate(rx.profile()) for rx in receivers)
    owners = [WarmOwner.open(checkpoints=lambda v: ckpts / f"v{v}", version=0, store=store,
                             owner=k, owners=2, profile=profile) for k in range(2)]
    commits = SqliteCommitStore(tmp_path / "commit.db", CommitRecord(
        committed_version=0, baseline_id="v0", attempt=""))
    engine = receivers[1].engine
    assert isinstance(engine, LocalDriver)
    victim = engine.ranks[0].applier
    assert victim is not None
    real, calls = victim._write_mapped, 0

    def dying(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        real(*args, **kwargs)
        calls += 1
        if calls == 3:
            victim._write_mapped = real  # type: ignore[method-assign]
            raise RuntimeError("rank-1 killed mid-apply")

    victim._write_mapped = dying  # type: ignore[method-assign]
    coordinator = Coordinator(commits, owners, receivers)
    try:
        for v in (1, 2):
            coordinator.refit(v, f"v{v}")
            shutil.rmtree(ckpts / f"v{v - 1}")
            assert _held_files(ckpts / f"v{v - 1}") == []
            assert all(o.version == v and o.candidate is None for o in owners)
    finally:
        coordinator.close()
    modes = [(h.mode, h.outcome.split(":")[0]) for h in coordinator.history]
    assert modes == [("mixed", "failed"), ("overwrite", "committed"), ("mixed", "committed")]
    for r, model in enumerate(ranks):
        dense = ReferenceModel(CFG, tp_size=2, tp_rank=r)
        dense.load_weights(sds[2].items())
        a, b = dense_state(model), dense_state(dense)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    last = coordinator.history[-1].attempt
    parts = [o.summaries[last] for o in owners]
    assert all(p["attempt"] == last and p["mode"] == "mixed" for p in parts)
    changed = sum(int(np.count_nonzero(sds[2][n].view(torch.int16).numpy()
                                       != sds[1][n].view(torch.int16).numpy())) for n in sds[2])
    assert sum(int(str(p["changed_elements"])) for p in parts) == changed
    assert sum(int(str(p["total_elements"])) for p in parts) == sum(
        t.numel() for t in sds[2].values())
    assert sum(int(str(p["dense_bytes"])) for p in parts) == 2 * sum(
        t.numel() for t in sds[2].values())
    assert all(int(str(p["payload_bytes"])) > 0 for p in parts)
    assert all(set(o.summaries) == {h.attempt for h in coordinator.history} for o in owners)
    for o in owners:
        o.close()
    assert _held_files(ckpts) == []
