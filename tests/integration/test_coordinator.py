"""The coordinator over in-process parties: retry by overwrite, joint commit, conflicts.

Two vLLM-layout TP ranks receive, each an agent over an in-process engine
(``LocalDriver``) holding its shard; the first attempt's second rank dies mid-apply. The
coordinator abandons it, retries in overwrite mode, commits by compare-and-set, and
only then advances the owner's baseline: both ranks end bit-exact with a dense load.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.encoder import Encoder
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import CommitConflict, Coordinator, CoordinatorSettings
from dcr.protocol.records import CommitOutcome, CommitRecord
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
V0 = CommitRecord(committed_version=0, baseline_id="ckpt-0", attempt="")


def source(sd: dict[str, torch.Tensor]) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                .view(np.uint16)) for n, t in sd.items()})


def setup(tmp_path: Path, count: int = 2, tp_size: int = 2):  # type: ignore[no-untyped-def]
    """Agents over ``count`` in-process engines (rank ``r % tp_size`` each), an owner of
    the transition 0 -> 1, and the commit record."""
    torch.manual_seed(0)
    old = random_checkpoint(CFG, 0)
    new = {n: (t.float() + 1e-2 * torch.randn(t.shape)).to(torch.bfloat16)
           for n, t in old.items()}
    store = MemoryStore()
    canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                 for n, t in old.items()]
    ranks, receivers = [], []
    for r in range(count):
        model = ReferenceModel(CFG, tp_size=tp_size, tp_rank=r % tp_size)
        model.load_weights(old.items())
        staging = tmp_path / f"rank-{r}"
        engine = LocalDriver([model], staging_dir=staging, checkpoint_root=tmp_path)
        ranks.append(model)
        receivers.append(AgentService(
            f"rank-{r}", engine, lambda spec: StoreSource(
                store=store, version=spec.target_version, attempt=spec.attempt,
                owners=spec.owners), canonical=canonical, staging_dir=staging, version=0))
    profile = merge(ReceiverProfile.model_validate(rx.profile()) for rx in receivers)
    owner = Encoder(store=store, baseline=source(old), version=0, profile=profile)
    owner.set_candidate(source(new), 1)
    commits = SqliteCommitStore(tmp_path / "commit.db", V0)
    return old, new, ranks, receivers, owner, commits


def exact(model: ReferenceModel, rank: int, sd: dict[str, torch.Tensor],
          tp_size: int = 2) -> bool:
    dense = ReferenceModel(CFG, tp_size=tp_size, tp_rank=rank)
    dense.load_weights(sd.items())
    a, b = dense_state(model), dense_state(dense)
    return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_a_receiver_killed_mid_apply_is_repaired_by_an_overwrite_retry(tmp_path: Path) -> None:
    _, new, ranks, receivers, owner, commits = setup(tmp_path)
    engine = receivers[1].engine
    assert isinstance(engine, LocalDriver)
    victim = engine.ranks[0].applier  # the rank's applier, made by prewarm
    assert victim is not None
    real, calls = victim._write_mapped, 0

    def dying(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        real(*args, **kwargs)
        calls += 1
        if calls == 5:
            victim._write_mapped = real  # type: ignore[method-assign]
            raise RuntimeError("rank-1 killed mid-apply")

    victim._write_mapped = dying  # type: ignore[method-assign]
    baseline_before = owner.baseline
    coordinator = Coordinator(commits, [owner], receivers)
    record = coordinator.refit(1, "ckpt-1")
    modes = [(h.mode, h.outcome.split(":")[0]) for h in coordinator.history]
    assert modes == [("mixed", "failed"), ("overwrite", "committed")]
    assert "rank-1 killed mid-apply" in coordinator.history[0].outcome
    assert record == commits.read()
    assert (record.committed_version, record.baseline_id) == (1, "ckpt-1")
    assert record.attempt == coordinator.history[1].attempt
    assert owner.version == 1
    assert owner.baseline is not baseline_before
    assert all(exact(m, r, new) for r, m in enumerate(ranks))


def test_a_conflicting_commit_leaves_the_baseline_where_it_was(tmp_path: Path) -> None:
    _, _, _, receivers, owner, commits = setup(tmp_path)
    baseline_before = owner.baseline

    class Racing:
        """Another coordinator commits between our read and our compare-and-set."""

        def read(self) -> CommitRecord:
            return commits.read()

        def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome:
            other = CommitRecord(committed_version=1, baseline_id="other", attempt="a-other")
            assert commits.compare_and_set(expected, other) is CommitOutcome.SUCCESS
            return commits.compare_and_set(expected, new)

    with pytest.raises(CommitConflict, match="another refit committed"):
        Coordinator(Racing(), [owner], receivers).refit(1, "ckpt-1")
    assert owner.baseline is baseline_before
    assert commits.read().attempt == "a-other"


def test_a_refit_to_a_version_already_committed_is_refused(tmp_path: Path) -> None:
    _, _, _, receivers, owner, commits = setup(tmp_path)
    assert Coordinator(commits, [owner], receivers).refit(1, "ckpt-1").committed_version == 1
    with pytest.raises(CommitConflict, match="already names version 1"):
        Coordinator(commits, [owner], receivers).refit(1, "ckpt-other")
    again = Coordinator(commits, [owner], receivers)  # the same transition: already done
    assert again.refit(1, "ckpt-1") == commits.read()
    assert again.history == []


class Counted:
    """A receiver handle that counts how many calls to any receiver are in flight."""

    def __init__(self, inner: AgentService, gauge: dict[str, int], lock: threading.Lock
                 ) -> None:
        self.inner, self.gauge, self.lock, self.name = inner, gauge, lock, inner.name

    def __getattr__(self, call: str):  # type: ignore[no-untyped-def]
        fn = getattr(self.inner, call)

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            with self.lock:
                self.gauge["now"] += 1
                self.gauge["most"] = max(self.gauge["most"], self.gauge["now"])
            try:
                time.sleep(0.01)  # long enough that unbounded calls would overlap
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.gauge["now"] -= 1
        return counted


def test_a_fleet_is_driven_by_a_bounded_pool_not_a_thread_per_receiver(
        tmp_path: Path) -> None:
    """Fails on 422472d, where the coordinator started a thread per receiver (3,234
    threads for 1,024 receivers): twelve receivers with receiver_calls=3 never see more
    than three calls at once, and the refit commits every one of them bit-exact."""
    _, new, ranks, agents, owner, commits = setup(tmp_path, count=12, tp_size=1)
    gauge, lock = {"now": 0, "most": 0}, threading.Lock()
    receivers = [Counted(a, gauge, lock) for a in agents]
    coord = Coordinator(commits, [owner], receivers,  # type: ignore[arg-type]
                        settings=CoordinatorSettings(receiver_calls=3))
    assert coord.refit(1, "ckpt-1").committed_version == 1
    coord.close()
    assert 1 <= gauge["most"] <= 3
    assert all(exact(model, 0, new, tp_size=1) for model in ranks)
