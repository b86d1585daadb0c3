"""A replica spanning two pods: one receiver, driven through its leader's agent.

The leader pod runs ``dcr serve`` with TP rank 0 and ``--peer`` the worker pod's server,
which holds TP rank 1; every plugin call on the leader reaches both ranks. The pods share
nothing but the store: each has its own staging directory and checkpoint root (its own
copy of the starting checkpoint). The worker pod's agent runs as a ``member``: it stages
every payload the leader's agent is told about into the worker's staging directory, and
the leader applies a payload only once it is staged there too. Refits are bit-exact on
both ranks (fingerprints through the leader, against a dense load of the target), checked
per rank; killing the worker pod (its server and its member) mid-refit fails the attempt
and leaves the group out until it is back; then the leader's agent sees a new instance,
both pods build the committed version from the store's history under their own roots,
the group loads it densely and the refit commits.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from replica_group import POD_NAMES, TwoPodReplica, flip_bits
from transformers import LlamaConfig

from dcr.files.history import HistoryStore
from dcr.format.history import HISTORY_KEY, History
from dcr.format.profile import ReceiverProfile, dumps
from dcr.owner.process import ProcessOwner
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings, RefitFailed
from dcr.protocol.records import CommitRecord
from dcr.receiver.member_api import MemberClient, MemberError
from dcr.refit.job import start_relays
from dcr.transport.relay.publish import TOKEN_ENV
from dcr.transport.store import FileStore

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.e2e]

TOKEN = "group-test-token-0123456789abcdef"
LLAMA = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False)
V0 = CommitRecord(committed_version=0, baseline_id="ckpt-0", attempt="")
SETTINGS = CoordinatorSettings(attempt_timeout_s=90.0)


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory,
             export_llama_versions: Callable[..., None]) -> Path:
    """Versions 0..2 of a tiny Llama, an AdamW step apart (the training side's)."""
    root = tmp_path_factory.mktemp("llama")
    export_llama_versions(root, LLAMA)
    return root


class Pods(TwoPodReplica):
    """The replica, with a coordinator and an owner as a training side would run them."""

    def coordinator(self, owner: ProcessOwner, commits: SqliteCommitStore) -> Coordinator:
        history = HistoryStore(FileStore(self.store))
        return Coordinator(commits, [owner], [self.client], settings=SETTINGS,
                           on_commit=lambda rec, n: history.commit(rec.committed_version,
                                                                   rec.attempt, n))

    def owner(self) -> ProcessOwner:
        """The encoder, given the group's profile as the main job and the operator give
        theirs: it writes the sums of the regions each TP rank holds."""
        profile = self.tmp / "profile.json"
        profile.write_text(dumps(ReceiverProfile.model_validate(self.client.profile())))
        return ProcessOwner(store_uri=self.store.as_uri(),
                            checkpoints=lambda v: self.versions / f"v{v}", version=0,
                            timeout_s=120.0, profile_path=profile)


@pytest.fixture
def pods(tmp_path: Path, versions: Path) -> Iterator[Pods]:
    (tmp_path / "store").mkdir()
    p = Pods(tmp_path, versions, tmp_path / "store", TOKEN)
    yield p
    p.close()


def test_a_replica_of_two_pods_refits_bit_exact_on_every_rank(pods: Pods) -> None:
    commits = SqliteCommitStore(pods.tmp / "commit.db", V0)
    c = pods.coordinator(pods.owner(), commits)
    for v in (1, 2):
        record = c.refit(v, f"ckpt-{v}")
        assert record.committed_version == v
        pods.assert_holds(v)
    assert [h.outcome for h in c.history] == ["committed", "committed"]
    assert [h.receivers for h in c.history] == [("leader-agent",)] * 2  # one receiver
    log = pods.member.log_path.read_text()
    assert all(f"staging attempt {h.attempt}" in log for h in c.history)
    c.close()


# One element of a tensor every step changes (its rows past 1024 are TP rank 1's shard)
# and one of a tensor the AdamW step leaves as it is in BF16 (every rank holds it whole).
TOUCHED = {"lm_head.weight": 1500 * 128 + 3}
UNTOUCHED = {"model.norm.weight": 5}
CHECKED = {"lm_head.weight": "'lm_head.weight@", "model.norm.weight": "'model.norm.weight'"}


@pytest.mark.parametrize("flips", [TOUCHED | UNTOUCHED, UNTOUCHED], ids=["both", "untouched"])
def test_a_worker_rank_holding_wrong_bits_is_repaired_before_the_group_commits(
        tmp_path: Path, versions: Path, flips: dict[str, int]) -> None:
    """The worker's rank loaded v0 with a bit flipped in a tensor the delta touches and one
    in a tensor it does not (or only the latter): the flush compares every tensor and
    region the ranks hold, so the attempt fails and the group rejoins densely from the
    pods' own seeds before v1 commits, every rank's bits then those of a dense load of v1."""
    (tmp_path / "store").mkdir()
    flip_bits(versions / "v0", tmp_path / "flipped", flips)
    pods = Pods(tmp_path, versions, tmp_path / "store", TOKEN, worker_model=tmp_path / "flipped")
    try:
        c = pods.coordinator(pods.owner(), SqliteCommitStore(tmp_path / "commit.db", V0))
        record = c.refit(1, "ckpt-1")
        assert record.committed_version == 1
        first, last = c.history[0], c.history[-1]
        assert "differ from the manifest's target at flush" in first.outcome
        assert all(CHECKED[n] in first.outcome for n in flips)  # rank 1's region of lm_head
        assert (last.outcome, last.rejoined) == ("committed", ("leader-agent",))
        pods.assert_holds(1)
        c.close()
    finally:
        pods.close()


def test_the_member_refuses_without_the_token_and_names_an_attempt_it_does_not_hold(
        pods: Pods) -> None:
    with pytest.raises(MemberError, match="401"):
        MemberClient(pods.member.url, "wrong-token-0123456789abcdef").status("a-0000000000aa")
    member = MemberClient(pods.member.url, TOKEN)
    with pytest.raises(MemberError, match=r"attempt a-0000000000aa is not held here"):
        member.status("a-0000000000aa")
    with pytest.raises(MemberError, match="is not a plain file name"):
        member.release("a-0000000000aa", ["../../etc/passwd"])


def test_a_worker_pod_killed_mid_refit_is_rebuilt_from_the_store_and_the_refit_commits(
        pods: Pods) -> None:
    commits = SqliteCommitStore(pods.tmp / "commit.db", V0)
    c = pods.coordinator(pods.owner(), commits)
    c.refit(1, "ckpt-1")
    pods.assert_holds(1)
    before = pods.instance()

    killed = threading.Event()

    def kill_when_staged() -> None:  # the worker pod dies once the attempt reached it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(p.name.endswith(".dcrp") for p in pods.staging("worker").iterdir()):
                pods.worker_serve.kill()
                pods.member.kill()
                killed.set()
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_when_staged)
    watcher.start()
    with pytest.raises(RefitFailed, match="Only 0 receivers can take part in 1 -> 2"):
        c.refit(2, "ckpt-2")  # the group cannot take part while its worker pod is gone
    watcher.join()
    assert killed.is_set()
    failed = c.history[1]
    assert (failed.mode, failed.outcome.split(":")[0]) == ("mixed", "failed")
    assert pods.worker_serve.url in failed.outcome or "member" in failed.outcome

    pods.worker_serve.restart()  # the worker pod comes back: its rank loaded v0 at start
    pods.member.restart()
    record = c.refit(2, "ckpt-2")
    assert record.committed_version == 2
    assert c.history[-1].rejoined == ("leader-agent",)  # the group rebuilt v1 densely
    assert c.history[-1].outcome == "committed"  # clean at v1 again: a mixed attempt
    assert pods.instance() != before  # the worker pod's rank is a new instance
    built = [p.name for p in pods.root("worker").iterdir() if p.name != "v0"]
    assert built, "the member built the committed version under the worker's own root"
    pods.assert_holds(2)
    c.close()


def test_a_replica_of_two_pods_reads_from_its_relay_nodes_and_a_restarted_worker_rejoins(
        tmp_path: Path, versions: Path) -> None:
    """A relay fleet's group: each pod's agent (the leader's and the member) reads from its
    own node of the relay tree, the owner publishes to the root, and nothing goes through
    a store. A worker pod that restarts between refits leaves the group's weights unknown:
    the next refit first dense-loads the committed checkpoint, which each pod holds at the
    same path under its own root (a relay keeps no history to build from), then commits."""
    tree = start_relays(tmp_path / "relay", 2)  # node 0 (the root) in the leader's pod
    (tmp_path / "store").mkdir()  # unused: the agents are given the relay only
    pods = Pods(tmp_path, versions, tmp_path / "store", TOKEN, relays=(tree.urls[0],
                tree.urls[1]), relay_token_file=tree.read_token_file)
    try:
        for pod in POD_NAMES:  # the training side's checkpoints, on every pod's volume
            for v in (1, 2):
                shutil.copytree(versions / f"v{v}", pods.root(pod) / f"v{v}")
        owner = ProcessOwner(store_uri=f"relay+http://{tree.urls[0].split('://', 1)[1]}",
                             checkpoints=lambda v: versions / f"v{v}", version=0,
                             timeout_s=120.0,
                             env={TOKEN_ENV: tree.publish_token_file.read_text().strip()})
        c = Coordinator(SqliteCommitStore(tmp_path / "commit.db", V0), [owner], [pods.client],
                        settings=SETTINGS,
                        dense_checkpoint=lambda v: str(pods.root("leader") / f"v{v}"))
        c.refit(1, str(pods.root("leader") / "v1"))
        pods.assert_holds(1)
        assert "staging attempt" in pods.member.log_path.read_text()
        assert not any((tmp_path / "store").iterdir())

        pods.restart_worker()  # its rank is v0 again: the group's weights are unknown
        record = c.refit(2, str(pods.root("leader") / "v2"))
        assert record.committed_version == 2
        assert c.history[-1].rejoined == ("leader-agent",)  # v1 from each pod's own root
        pods.assert_holds(2)
        c.close()
    finally:
        pods.close()
        for proc in tree.procs:
            proc.kill()
            proc.wait()


def test_a_member_builds_from_the_history_its_leader_was_given_not_the_stores(
        pods: Pods) -> None:
    """The commit record vouches for the history; a store writer puts another (here the
    genuine, empty one from before v1) in its place. The leader's agent, given the
    record's digest with the rejoin, passes it on with the dense request, so the worker
    pod's member builds v1 from the coordinator's copy of the vouched history too, and
    the group's dense load succeeds on both ranks."""
    commits = SqliteCommitStore(pods.tmp / "commit.db", V0)
    c = Coordinator(commits, [pods.owner()], [pods.client], settings=SETTINGS,
                    history=HistoryStore(FileStore(pods.store)))
    record = c.refit(1, "ckpt-1")
    assert record.history_digest
    (pods.store / HISTORY_KEY).write_bytes(History().pack())  # the store writer's doing
    st = pods.client.rejoin(1, None, record.history_digest)
    assert st.version == 1
    assert f"history is now the one with digest {record.history_digest}" in \
        pods.member.log_path.read_text()
    pods.assert_holds(1)
    c.close()
