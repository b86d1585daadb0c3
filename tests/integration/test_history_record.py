"""The commit record vouches for the store's history, and what a reader of it pays.

A coordinator that keeps the store's history stages each commit's history under its digest
before the compare-and-set, so the record carries that digest; it writes the history only
once every receiver is settled. A store writer who puts an older, genuine history back
then wedges nothing: the coordinator repairs it from its own copy, and where that copy is
gone too, it refuses by name with every gate open. Readers bound what they parse by their
own limits, and ``/readyz``'s reading is fetched again only once the history changed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr import cli
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.errors import ManifestError
from dcr.files import history as history_mod
from dcr.files.history import COPIES, HistoryRefused, HistoryStore, copy_key
from dcr.files.materialize import recorded_version
from dcr.files.mirror import current
from dcr.format.commitfile import COMMIT_FILE_KEY, CommitFile
from dcr.format.history import (
    AHEAD_VERSIONS,
    HISTORY_KEY,
    PIECE_BYTES,
    History,
    Piece,
    SnapshotFile,
    SnapshotIndex,
    history_bound,
)
from dcr.format.layout import MAX_OWNERS
from dcr.format.manifest import ManifestLimits, limits_for
from dcr.format.names import object_digest
from dcr.format.profile import ReceiverProfile
from dcr.owner.encoder import Encoder
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.records import CommitOutcome, CommitRecord
from dcr.receiver import fromstore
from dcr.receiver.attempt import AgentConflict
from dcr.receiver.fromstore import FromStore
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import ReferenceConfig, ReferenceModel, random_checkpoint
from dcr.serve.local import LocalDriver
from dcr.transport.receive import StoreSource
from dcr.transport.store import FileStore
from dcr_operator.prefixes import remove_under

pytestmark = pytest.mark.timeout(120)

CFG = ReferenceConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, tie_word_embeddings=False)


def source(state: dict[str, torch.Tensor]) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                .view(np.uint16)) for n, t in state.items()})


def states(n: int) -> list[dict[str, torch.Tensor]]:
    out = [random_checkpoint(CFG, 0)]
    for v in range(1, n + 1):
        gen = torch.Generator().manual_seed(v)
        out.append({k: (t.float() + 1e-2 * torch.randn(t.shape, generator=gen))
                    .to(torch.bfloat16) for k, t in out[-1].items()})
    return out


class PutBack:
    """A commit store after whose successful compare-and-set a store writer puts
    ``history`` (an older, genuine one) back, and optionally deletes the coordinator's
    copies: the window between the record moving and the history being written."""

    def __init__(self, inner: SqliteCommitStore, store: FileStore) -> None:
        self.inner, self.store = inner, store
        self.history: bytes | None = None
        self.delete_copies = False

    def read(self) -> CommitRecord:
        return self.inner.read()

    def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome:
        outcome = self.inner.compare_and_set(expected, new)
        if outcome is CommitOutcome.SUCCESS and self.history is not None:
            self.store.put(HISTORY_KEY, self.history)
            if self.delete_copies:
                for key in self.store.list(COPIES):
                    (self.store.root / key).unlink()
        return outcome


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.states = states(3)
        self.store = FileStore(tmp / "store")
        root = tmp / "rollout"
        root.mkdir()
        staging = tmp / "staging"
        engine = LocalDriver([ReferenceModel(CFG, tp_size=1, tp_rank=0)], staging_dir=staging,
                             checkpoint_root=root)
        from safetensors.torch import save_file

        (root / "v0").mkdir()
        save_file(self.states[0], str(root / "v0" / "model.safetensors"))
        engine.load_dense("v0")
        canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                     for n, t in self.states[0].items()]
        store = self.store
        self.rx = AgentService(
            "rx", engine, lambda spec: StoreSource(store=store, version=spec.target_version,
                                                   attempt=spec.attempt, owners=spec.owners),
            canonical=canonical, staging_dir=staging, version=0, checkpoint_root=root,
            store=FromStore(HistoryStore(store), root))
        self.owner = Encoder(store=store, baseline=source(self.states[0]), version=0,
                             profile=ReceiverProfile.model_validate(self.rx.profile()))
        self.commits = PutBack(SqliteCommitStore(tmp / "commit.db", CommitRecord(
            committed_version=0, baseline_id="v0", attempt="")), store)
        self.coord = Coordinator(self.commits, [self.owner], [self.rx],
                                 history=HistoryStore(store))

    def refit(self, v: int) -> CommitRecord:
        self.owner.set_candidate(source(self.states[v]), v)
        return self.coord.refit(v, f"v{v}")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    yield f
    f.coord.close()


def test_an_older_history_put_back_after_the_commit_is_repaired_from_the_coordinators_copy(
        fleet: Fleet) -> None:
    """Without the record's digest, the commit of v3 re-read the history v1 left (put back
    by a store writer the moment the record moved), refused the attempt, and every retry
    raised again: record 3, the receiver flushed, its gate closed. Now the record vouches
    for the history staged before it moved, which is put back in place from its copy."""
    fleet.refit(1)
    older = fleet.store.get(HISTORY_KEY)
    two = fleet.refit(2)
    assert two.history_digest == object_digest(fleet.store.get(HISTORY_KEY))
    fleet.commits.history = older
    three = fleet.refit(3)
    st = fleet.rx.status()
    assert (three.committed_version, st.version, st.gate_open) == (3, 3, True)
    assert object_digest(fleet.store.get(HISTORY_KEY)) == three.history_digest
    assert HistoryStore(fleet.store, three.history_digest).read().committed == 3


def test_a_history_that_cannot_be_repaired_is_refused_by_name_with_every_gate_open(
        fleet: Fleet) -> None:
    """With the coordinator's copies deleted too, the history is refused, naming the digest
    the record vouches for; the receiver has already learned the commit and serves."""
    fleet.refit(1)
    older = fleet.store.get(HISTORY_KEY)
    fleet.refit(2)
    fleet.commits.history, fleet.commits.delete_copies = older, True
    with pytest.raises(HistoryRefused, match=r"is not the .* the caller vouches for"):
        fleet.refit(3)
    record, st = fleet.commits.read(), fleet.rx.status()
    assert (record.committed_version, st.version, st.gate_open, st.dirty) == (3, 3, True, None)
    with pytest.raises(HistoryRefused, match=record.history_digest):
        HistoryStore(fleet.store, record.history_digest).read()


def test_a_refit_over_a_history_other_than_the_recorded_one_closes_no_gate(
        fleet: Fleet) -> None:
    """A history the record does not vouch for, with no copy to repair it from, is refused
    before any attempt starts: nothing is prepared, the gate never closes."""
    fleet.refit(1)
    older = fleet.store.get(HISTORY_KEY)
    fleet.refit(2)
    for key in fleet.store.list(COPIES):
        (fleet.store.root / key).unlink()
    fleet.store.put(HISTORY_KEY, older)
    fleet.owner.set_candidate(source(fleet.states[3]), 3)
    attempts = len(fleet.coord.history)
    with pytest.raises(HistoryRefused):
        fleet.coord.refit(3, "v3")
    assert len(fleet.coord.history) == attempts
    st = fleet.rx.status()
    assert (st.version, st.gate_open, st.attempt) == (2, True, fleet.commits.read().attempt)


def test_a_receiver_given_the_digest_rejoins_from_the_vouched_history_alone(
        fleet: Fleet, tmp_path: Path) -> None:
    """A rejoin told the record's digest reads that history (from its copy when another
    stands in its place), never the one a store writer put back."""
    fleet.refit(1)
    older = fleet.store.get(HISTORY_KEY)
    two = fleet.refit(2)
    fleet.store.put(HISTORY_KEY, older)
    hs = HistoryStore(fleet.store)
    assert hs.read().committed == 1  # as the store holds it
    hs.digest = two.history_digest
    assert hs.read().committed == 2


def test_a_committed_version_loads_densely_against_the_history_its_commit_named(
        fleet: Fleet) -> None:
    """An agent pinned to the history its attempt's base record vouched for learns the new
    record's digest with the commit: a dense load of the committed version (a full refit,
    or a rejoin from a checkpoint) is then checked against a history that names it, instead
    of being refused because the history it was pinned to ends one version earlier."""
    from safetensors.torch import save_file

    fleet.refit(1)
    two = fleet.refit(2)
    root = fleet.rx.checkpoint_root
    assert root is not None
    (root / "v2").mkdir()
    save_file(fleet.states[2], str(root / "v2" / "model.safetensors"))
    st = fleet.rx.rejoin(2, "v2")
    assert (st.version, st.gate_open) == (2, True)
    assert fleet.rx.store is not None
    assert fleet.rx.store.history.digest == two.history_digest
    (root / "v1").mkdir()
    save_file(fleet.states[1], str(root / "v1" / "model.safetensors"))
    with pytest.raises(AgentConflict, match=r"differ|fingerprint"):
        fleet.rx.rejoin(2, "v1")  # the wrong bits under the committed version's name


def test_manifest_parts_the_history_names_are_read_with_the_readers_limits(
        fleet: Fleet) -> None:
    """A reader reads at most what its limits allow: the committed part of v1, genuine
    but larger than this reader's limit, is refused before it is fetched (the defaults,
    which every history reader used, took any part up to 64 MiB)."""
    fleet.refit(1)
    entry = HistoryStore(fleet.store).read().entry(1)
    small = ManifestLimits(max_bytes=entry.parts[0].size - 1, max_json_bytes=1 << 20,
                           max_entries=1 << 10)
    with pytest.raises(ManifestError, match="over this reader's limit"):
        HistoryStore(fleet.store, limits=small).manifest(entry)
    assert HistoryStore(fleet.store, limits=limits_for(64)).manifest(entry).target_version == 1


class Counting(FileStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads = 0

    def get(self, key: str) -> bytes:
        self.reads += key == HISTORY_KEY
        return super().get(key)


def test_readyz_fetches_the_history_again_only_once_it_changed_and_once_for_many_callers(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every look at the committed version fetched and parsed the whole history; now an
    unchanged history is not fetched again, and callers at once share one reading."""
    fleet.refit(1)
    counting = Counting(fleet.store.root)
    fs = FromStore(HistoryStore(counting), None)
    monkeypatch.setattr(fromstore, "HISTORY_TTL_S", 0.0)
    assert [fs.committed() for _ in range(5)] == [1] * 5
    assert counting.reads == 1
    fleet.refit(2)
    assert fs.committed() == 2
    assert counting.reads == 2
    monkeypatch.setattr(fromstore, "HISTORY_TTL_S", 3600.0)
    fs = FromStore(HistoryStore(counting), None)
    threads = [threading.Thread(target=fs.committed) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counting.reads == 3


def test_a_history_entry_naming_more_parts_than_owners_is_refused_by_count() -> None:
    """A committed version names one manifest part per owner; a history naming more than
    an attempt can have owners is refused naming the count, before any part is fetched
    (it parsed, and every reader then fetched and parsed each part)."""
    ref = {"key": "v0000000001/a-1/manifest-o0000.dcrm", "size": 1, "digest": "0" * 32}
    entry = {"version": 1, "base_version": 0, "attempt": "a-1",
             "parts": [ref] * (MAX_OWNERS + 1), "payload_bytes": 0}
    data = json.dumps({"versions": [entry]}).encode()
    with pytest.raises(ManifestError, match=f"names {MAX_OWNERS + 1} manifest parts, over "
                                            f"the limit of {MAX_OWNERS} owners"):
        History.parse(data, "test")


def test_a_history_longer_than_the_reader_was_told_is_refused_by_size_unparsed(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent told version 1 by one owner expects a history of a few kB; a store writer's
    history of 2 MiB (here the genuine one, padded) is refused by its size before it is
    parsed, where every reader parsed up to 64 MiB of it (on each /readyz)."""
    fleet.refit(1)
    bound = history_bound(1 + AHEAD_VERSIONS, 1)
    assert fleet.rx.store is not None
    assert fleet.rx.store.history.max_bytes == bound
    genuine = fleet.store.get(HISTORY_KEY)
    fleet.store.put(HISTORY_KEY, genuine[:-1] + b" " * (2 << 20) + genuine[-1:])
    parsed: list[int] = []
    monkeypatch.setattr(History, "model_validate_json",
                        classmethod(lambda cls, data, **kw: parsed.append(len(data))))
    with pytest.raises(ManifestError, match=f"over the limit of {bound}"):
        fleet.rx.store.history.latest()
    assert parsed == []


class Gets(FileStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.keys: list[str] = []

    def get(self, key: str) -> bytes:
        self.keys.append(key)
        return super().get(key)


def test_a_planted_index_declaring_more_bytes_than_its_tensors_is_refused_before_a_fetch(
        fleet: Fleet) -> None:
    """An index for v1 with v1's (public) fingerprints whose one file declares 1 GiB in 64
    MiB pieces: the tensors the history vouches for at v1 take a few kB, so it is refused
    by its declared size before a piece is fetched (the read back fetched them all)."""
    fleet.refit(1)
    hs = HistoryStore(Gets(fleet.store.root))
    history = hs.read()
    pieces = tuple(Piece(key=f"snapshots/v0000000001/model.safetensors.{i:05d}",
                         size=PIECE_BYTES, digest="0" * 32) for i in range(16))
    index = SnapshotIndex(version=1, tensors=hs.fingerprints(history, 1), files=(
        SnapshotFile(name="model.safetensors", size=16 * PIECE_BYTES, pieces=pieces),))
    fleet.store.put("snapshots/v0000000001/index.dcrs", index.pack())
    assert hs.adopt(history).snapshots == ()
    assert isinstance(hs.store, Gets)
    assert [k for k in hs.store.keys if k.startswith("snapshots/")] == [
        "snapshots/v0000000001/index.dcrs"]


def test_copies_of_histories_the_record_no_longer_vouches_for_are_pruned_beyond_the_newest(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each commit leaves a copy of its history; beyond the newest few (here none) besides
    the one staged and the one the record vouched for, the copies are named for removal
    with retention's prefixes, and removed they leave every vouched history readable."""
    monkeypatch.setattr(history_mod, "KEEP_COPIES", 0)
    one, two, three = fleet.refit(1), fleet.refit(2), fleet.refit(3)
    writer = fleet.coord.writer
    assert isinstance(writer, HistoryStore)
    assert writer.pruned == [copy_key(one.history_digest)]
    assert remove_under(fleet.store.root, writer.pruned) == writer.pruned
    assert sorted(fleet.store.list(COPIES)) == sorted(
        copy_key(r.history_digest) for r in (two, three))
    assert HistoryStore(fleet.store, three.history_digest).read().committed == 3


def _pin(path: Path, record: CommitRecord) -> Path:
    """What the operator publishes in the fleet's ``<fleet>-commit`` ConfigMap."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CommitFile(committed_version=record.committed_version,
                               history_digest=record.history_digest).pack())
    return path


def _holds(fleet: Fleet, ckpt: Path, v: int) -> bool:
    """Does ``ckpt`` hold version ``v``'s bits, every tensor?"""
    from safetensors.torch import load_file

    got = {n: t for f in sorted(ckpt.glob("*.safetensors")) for n, t in load_file(f).items()}
    want = fleet.states[v]
    return got.keys() == want.keys() and all(
        torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want)


def test_a_store_writer_putting_back_an_older_history_steers_no_pod_given_the_commit_file(
        fleet: Fleet, tmp_path: Path) -> None:
    """``dcr materialize`` and ``dcr mirror`` read the version and the history digest from
    the commit file the operator publishes: a store writer who puts v1's genuine history
    back after v2's commit steers neither off v2's bits (without the file, both build v1:
    the store's newest history is all they have)."""
    fleet.refit(1)
    one = fleet.commits.read()
    older = fleet.store.get(HISTORY_KEY)
    two = fleet.refit(2)
    fleet.store.put(HISTORY_KEY, older)
    uri, seed = fleet.store.uri, tmp_path / "rollout" / "v0"
    start = ["--seed", str(seed), "--held", "0"]
    assert cli.main(["materialize", "--store", uri, "--out", str(tmp_path / "steered"),
                     *start]) == 0
    assert recorded_version(tmp_path / "steered") == 1  # what the store alone says

    pinned = _pin(tmp_path / "commit" / COMMIT_FILE_KEY, two)
    out = tmp_path / "pod"
    assert cli.main(["materialize", "--store", uri, "--out", str(out), *start,
                     "--commit-file", str(pinned)]) == 0
    assert recorded_version(out) == 2
    assert _holds(fleet, out, 2)

    mirror, once = tmp_path / "mirror", ["--dir", str(tmp_path / "mirror"), "--once"]
    _pin(pinned, one)  # each sync reads the file again: the mirror follows it
    assert cli.main(["mirror", "--store", uri, *once, *start, "--commit-file",
                     str(pinned)]) == 0
    gen = current(mirror)
    assert gen is not None
    assert gen.version == 1
    _pin(pinned, two)
    assert cli.main(["mirror", "--store", uri, *once, "--commit-file", str(pinned)]) == 0
    gen = current(mirror)
    assert gen is not None
    assert gen.version == 2
    assert _holds(fleet, gen.path, 2)


def test_a_missing_commit_file_trusts_the_store_by_name_and_a_bad_one_is_refused(
        fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before the fleet's first commit its optional volume is empty: the pod builds what
    the store's history names, and says whom it trusts. A file that is not the operator's
    (a version as a string, a digest of another shape, a field it never writes, too large)
    is refused naming the value, and nothing is built."""
    two = [fleet.refit(1), fleet.refit(2)][-1]
    base = ["materialize", "--store", fleet.store.uri, "--seed",
            str(tmp_path / "rollout" / "v0"), "--held", "0"]
    missing = tmp_path / "empty" / COMMIT_FILE_KEY
    assert cli.main([*base, "--out", str(tmp_path / "a"), "--commit-file", str(missing)]) == 0
    assert recorded_version(tmp_path / "a") == 2
    assert "trusting whoever may write" in caplog.text
    assert str(missing) in caplog.text
    bad = tmp_path / "bad" / COMMIT_FILE_KEY
    bad.parent.mkdir()
    good = json.loads(CommitFile(committed_version=2, history_digest=two.history_digest)
                      .pack())
    for doc, needle in [({**good, "committed_version": "2"}, "'2'"),
                        ({**good, "history_digest": "AB" * 16}, "AB" * 16),
                        ({**good, "baseline": "x"}, "baseline"),
                        ({**good, "pad": "x" * 2000}, "over 1024 bytes")]:
        bad.write_text(json.dumps(doc))
        out = tmp_path / "refused"
        assert cli.main([*base, "--out", str(out), "--commit-file", str(bad)]) == 1
        err = capsys.readouterr().err
        assert f"Commit file {bad}" in err, err
        assert needle in err, err
        assert recorded_version(out) is None
    assert cli.main([*base, "--out", str(tmp_path / "b"), "--commit-file", str(missing),
                     "--version", "1"]) == 1
    assert "contradict" in capsys.readouterr().err
