"""The rollout side reaches any committed version from the store alone.

The training side refits v0 -> v1 -> v2 -> v3 through the coordinator, which records each
commit in the store's history; it writes a snapshot of v2. The rollout side holds only the
run's starting model (v0, as a public base model would be) under its own checkpoint root:
no training-side checkpoint is reachable from it. A receiver added after v3 rejoins from
the store, and a rollout pod's volume is filled by ``materialize``; both end bit-exact
with a dense load of the training side's v3. Hostile stores and wrong labels are refused
with nothing written.
"""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from appserver import Server
from safetensors.torch import save_file

from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint, Checkpoint
from dcr.drivers.base import merge_fingerprints
from dcr.errors import CheckpointError, ManifestError
from dcr.files.history import HistoryStore
from dcr.files.materialize import materialize, plan
from dcr.files.snapshot import write_snapshot
from dcr.format.history import (
    HISTORY_KEY,
    History,
    ObjectRef,
    Piece,
    Snapshot,
    SnapshotFile,
    SnapshotIndex,
)
from dcr.format.names import object_digest
from dcr.format.profile import ReceiverProfile
from dcr.owner.encoder import Encoder
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.records import CommitRecord
from dcr.receiver.fromstore import FROM_STORE, FromStore
from dcr.receiver.server import make_app
from dcr.receiver.service import AgentConflict, AgentService
from dcr.runtimes.vllm_reference import ReferenceConfig, ReferenceModel, random_checkpoint
from dcr.serve.local import LocalDriver
from dcr.transport.receive import StoreSource
from dcr.transport.store import FileStore

pytestmark = pytest.mark.timeout(120)

CFG = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, tie_word_embeddings=False)
LAST = 3


def bits_of(path: Path) -> dict[str, bytes]:
    with Checkpoint(path) as ckpt:
        return {n: ckpt.bits(n).tobytes() for n in ckpt.names()}


@dataclass
class Run:
    """The training side after v3: its checkpoints, the store, the history."""

    train: Path  # the training side's checkpoints, v0..v3 (never mounted by the rollout side)
    store: FileStore
    history: HistoryStore
    states: dict[int, dict[str, torch.Tensor]]

    def rollout_root(self, name: str) -> Path:
        """A rollout pod's own volume, holding only the starting model."""
        root = self.train.parent / name
        (root / "v0").mkdir(parents=True)
        shutil.copy(self.train / "v0" / "model.safetensors", root / "v0")
        return root

    def agent(self, name: str, *, history: bool = True, seed: bool = False,
              store: FileStore | None = None) -> AgentService:
        root = self.rollout_root(name)
        staging = root.parent / f"{name}-staging"
        engine = LocalDriver([ReferenceModel(CFG, tp_size=1, tp_rank=0)], staging_dir=staging,
                             checkpoint_root=root)
        engine.load_dense("v0")
        canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                     for n, t in self.states[0].items()]
        store = store or self.store
        return AgentService(
            name, engine, lambda spec: StoreSource(store=store, version=spec.target_version,
                                                   attempt=spec.attempt, owners=spec.owners),
            canonical=canonical, staging_dir=staging, version=0, checkpoint_root=root,
            store=FromStore(HistoryStore(store), root, seed=(0, root / "v0") if seed else None)
            if history else None)


def source(state: dict[str, torch.Tensor]) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                .view(np.uint16)) for n, t in state.items()})


def step(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """About 2% of the elements move, as an optimizer step moves a BF16 export."""
    moved = torch.rand(t.shape, generator=gen) < 0.02
    new = (t.float() + 1e-2 * torch.randn(t.shape, generator=gen)).to(torch.bfloat16)
    return torch.where(moved, new, t)


def record(history: HistoryStore, rec: CommitRecord, owners: int) -> None:
    history.commit(rec.committed_version, rec.attempt, owners)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("two-clusters")
    train, states = tmp / "train", {0: random_checkpoint(CFG, 0)}
    for v in range(1, LAST + 1):
        gen = torch.Generator().manual_seed(v)
        states[v] = {n: step(t, gen) for n, t in states[v - 1].items()}
    for v, state in states.items():
        (train / f"v{v}").mkdir(parents=True)
        save_file(state, str(train / f"v{v}" / "model.safetensors"))
    store = FileStore(tmp / "store")
    r = Run(train=train, store=store, history=HistoryStore(store), states=states)
    rx = r.agent("refitted")
    owner = Encoder(store=store, baseline=source(states[0]), version=0,
                    profile=ReceiverProfile.model_validate(rx.profile()))
    coord = Coordinator(
        SqliteCommitStore(tmp / "commit.db", CommitRecord(committed_version=0,
                                                          baseline_id="v0", attempt="")),
        [owner], [rx],
        on_commit=lambda rec, owners: record(r.history, rec, owners))
    try:
        for v in range(1, LAST + 1):
            owner.set_candidate(source(states[v]), v)
            coord.refit(v, f"v{v}")
            if v == 2:  # the training side writes it; the commit of v3 adopts it
                write_snapshot(store, train / "v2", 2, piece_bytes=4096)
                assert not r.history.read().snapshots
    finally:
        coord.close()
    assert rx.status().version == LAST
    return r


def test_the_history_names_every_commit_and_the_snapshot(run: Run) -> None:
    h = run.history.read()
    assert [(c.base_version, c.version) for c in h.versions] == [(0, 1), (1, 2), (2, 3)]
    assert [s.version for s in h.snapshots] == [2]
    want = {n: Checkpoint(run.train / "v3").fingerprint(n) for n in run.states[3]}
    assert run.history.fingerprints(h, 3) == want
    assert run.history.fingerprints(h, 0) == {
        n: Checkpoint(run.train / "v0").fingerprint(n) for n in run.states[0]}


def test_a_receiver_added_after_v3_rejoins_from_the_store_bit_exact(run: Run) -> None:
    """Its root holds v0 only; ``rejoin(3)`` without a path builds v3 from the store (the
    snapshot of v2 and one delta) and loads it, checked against the history."""
    rx = run.agent("added")
    st = rx.rejoin(LAST)
    assert (st.version, st.unknown, st.gate_open) == (LAST, None, True)
    dense = LocalDriver([ReferenceModel(CFG, tp_size=1, tp_rank=0)],
                        staging_dir=run.train.parent / "oracle-staging",
                        checkpoint_root=run.train)
    dense.load_dense(f"v{LAST}")
    assert rx.fingerprint() == merge_fingerprints(dense.fingerprint())  # every param, buffer
    assert rx.counters.store_bytes_fetched > 0
    assert bits_of(rx.checkpoint_root / FROM_STORE) == bits_of(run.train / f"v{LAST}")


def test_materialize_replays_from_a_held_version_or_fetches_the_snapshot(
        run: Run, tmp_path: Path) -> None:
    h = run.history.read()
    # A pod volume holding v0: replaying three deltas is cheaper than the snapshot.
    held = tmp_path / "held"
    shutil.copytree(run.train / "v0", held)
    done = materialize(run.store, held, held=0)
    assert (done.plan.route, done.plan.start, done.plan.steps) == ("replay", 0, 3)
    assert bits_of(held) == bits_of(run.train / "v3")
    # An empty volume: the snapshot of v2, then one delta.
    fresh = tmp_path / "fresh"
    done = materialize(run.store, fresh)
    assert (done.plan.route, done.plan.start, done.plan.steps) == ("snapshot", 2, 1)
    assert bits_of(fresh) == bits_of(run.train / "v3")
    assert done.fetched_bytes >= done.plan.fetch_bytes
    # Asked for v1 with nothing held: no snapshot at or below it.
    with pytest.raises(ManifestError, match="No way to version 1 from the store"):
        plan(h, 1, None)


def test_a_rejoin_offered_another_versions_checkpoint_under_the_right_label_is_refused(
        run: Run) -> None:
    """A fresh agent knows no attempt of its own, yet the history vouches for v3: v2's
    checkpoint offered as "version 3" is refused before anything is written. Without the
    history (``history=None``), the same call loads v2 and reports version 3."""
    rx = run.agent("offered")
    shutil.copytree(run.train / "v2", rx.checkpoint_root / "v3")
    before = rx.engine.fingerprint()
    with pytest.raises(AgentConflict, match="dense load of version 3 refused"):
        rx.rejoin(3, "v3")
    assert rx.engine.fingerprint() == before
    assert (rx.status().version, rx.status().gate_open) == (0, True)


def test_a_held_copy_that_is_not_the_version_it_claims_is_refused_before_fetching(
        run: Run, tmp_path: Path) -> None:
    """A volume said to hold v1 holds v0: its fingerprints are compared with the
    history's first, so nothing is fetched or changed. Without the check the deltas
    after v1 would be patched onto v0 (the patch path would refuse the first file, after
    fetching)."""
    held = tmp_path / "claims-v1"
    shutil.copytree(run.train / "v0", held)
    before = bits_of(held)
    with pytest.raises(ManifestError, match="does not hold version 1"):
        materialize(run.store, held, held=1)
    assert bits_of(held) == before


def corrupt_copy(run: Run, tmp_path: Path, key_of: str) -> FileStore:
    """A copy of the store with one byte of the first object under ``key_of`` flipped."""
    copy = tmp_path / "store"
    shutil.copytree(run.store.root, copy)
    target = sorted(p for p in copy.rglob("*") if p.is_file()
                    and p.relative_to(copy).as_posix().startswith(key_of))[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    return FileStore(copy)


@pytest.mark.parametrize("key_of", ["snapshots/v0000000002/model.safetensors.",
                                    "snapshots/v0000000002/index.dcrs",
                                    "v0000000003/"])
def test_a_corrupted_object_in_the_store_is_refused_and_nothing_is_written(
        run: Run, tmp_path: Path, key_of: str) -> None:
    """One flipped byte in a snapshot piece, the snapshot index or a committed attempt's
    objects: its digest (the history's, the index's or the manifest's) refuses it, and
    the output directory never appears. Without the digest checks a flipped piece would
    be written into the checkpoint."""
    store = corrupt_copy(run, tmp_path, key_of)
    out = tmp_path / "out"
    with pytest.raises((ManifestError, CheckpointError), match="digest mismatch"):
        materialize(store, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_a_history_other_than_the_one_vouched_for_is_refused(run: Run, tmp_path: Path) -> None:
    """Given the history's digest (``--history-digest``), a rewritten history (here: its
    snapshot dropped) is refused before anything is fetched; without the check the
    rewritten one would be followed."""
    good = run.store.get(HISTORY_KEY)
    shutil.copytree(run.store.root, tmp_path / "store")
    store = FileStore(tmp_path / "store")
    h = History.parse(good, "test")
    store.put(HISTORY_KEY, h.model_copy(update={"snapshots": ()}).pack())
    with pytest.raises(ManifestError, match=r"is not the .* the caller vouches for"):
        materialize(store, tmp_path / "out", digest=object_digest(good))
    assert not (tmp_path / "out").exists()
    done = materialize(run.store, tmp_path / "out", digest=object_digest(good))
    assert done.plan.target == LAST


def test_a_receiver_without_a_history_cannot_rejoin_without_a_path(run: Run) -> None:
    rx = run.agent("no-history", history=False)
    with pytest.raises(AgentConflict, match="needs the store's history"):
        rx.rejoin(LAST)
    assert rx.status().version == 0


def test_without_snapshots_a_receiver_replays_from_the_model_it_started_from(
        run: Run, tmp_path: Path) -> None:
    """The store keeps no snapshot; the agent's seed (v0, the public base model on its
    own volume, checked by the history's fingerprints) and three deltas make v3."""
    shutil.copytree(run.store.root, tmp_path / "store")
    store = FileStore(tmp_path / "store")
    hs = HistoryStore(store)
    store.put(HISTORY_KEY, hs.read().model_copy(update={"snapshots": ()}).pack())
    rx = run.agent("seeded", seed=True, store=store)
    assert rx.rejoin(LAST).version == LAST
    assert bits_of(rx.checkpoint_root / FROM_STORE) == bits_of(run.train / f"v{LAST}")
    payloads = sum(c.payload_bytes for c in hs.read().versions)
    assert payloads <= rx.counters.store_bytes_fetched < payloads + 64 * 1024  # no snapshot
    with pytest.raises(AgentConflict, match="No way to version 3 from the store"):
        run.agent("unseeded-2", store=store).rejoin(LAST)


def test_a_snapshot_is_adopted_only_if_it_holds_the_committed_bits(
        run: Run, tmp_path: Path) -> None:
    """Whoever may write snapshot objects cannot make the history name other bits: v2's
    checkpoint written as "snapshot 3" is not adopted; the real v3 is."""
    shutil.copytree(run.store.root, tmp_path / "store")
    store = FileStore(tmp_path / "store")
    hs = HistoryStore(store)
    write_snapshot(store, run.train / "v2", 3, piece_bytes=4096)
    assert [s.version for s in hs.adopt(hs.read()).snapshots] == [2]
    write_snapshot(store, run.train / "v3", 3, piece_bytes=4096)
    assert [s.version for s in hs.adopt(hs.read()).snapshots] == [2, 3]


def test_a_pod_started_on_old_weights_is_not_ready_until_it_holds_the_committed_version(
        run: Run) -> None:
    """A pod rescheduled after v3 boots on v0: /readyz answers 503 naming both versions
    (it served old weights as Ready before), and 200 once it rejoined."""
    rx = run.agent("rescheduled")
    server = Server(make_app(rx, "t" * 32))
    try:
        def readyz() -> tuple[int, str]:
            try:
                with urllib.request.urlopen(server.url + "/readyz", timeout=30) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        assert readyz() == (503, "version 0; the committed version is 3\n")
        rx.rejoin(LAST)
        assert readyz() == (200, "version 3\n")
    finally:
        server.close()


def test_an_init_container_builds_the_committed_version_from_a_seed_and_records_it(
        run: Run, tmp_path: Path) -> None:
    """``dcr materialize --seed BASE --held 0``: the pod's volume starts as the public
    base model and reaches v3; run again (a restarted init container), it finds v3
    recorded there and fetches only the history and the manifest that checks it. The
    agent starts at the recorded version without a --model-version."""
    from dcr.files.materialize import recorded_version
    from dcr.receiver.settings import AgentSettings

    base = run.rollout_root("init") / "v0"
    out = tmp_path / "weights" / "current"
    done = materialize(run.store, out, held=0, seed=base)
    assert (done.plan.route, recorded_version(out)) == ("replay", LAST)
    assert bits_of(out) == bits_of(run.train / f"v{LAST}")
    again = materialize(run.store, out, held=0, seed=base)
    assert again.plan.route == "held"
    parts = sum(r.size for r in run.history.read().entry(LAST).parts)  # its fingerprints
    assert again.fetched_bytes == len(run.store.get(HISTORY_KEY)) + parts
    s = AgentSettings(name="a", store="file:///x", engine_url="http://127.0.0.1:1",
                      canonical=out, staging_dir=tmp_path / "staging",
                      state_dir=tmp_path / "state")
    assert s.start_version == LAST


def test_a_replay_refused_midway_leaves_the_copy_at_its_version_and_unrecorded(
        run: Run, tmp_path: Path) -> None:
    """v2's payload is corrupted in the store: replaying v0 -> v3 fails at the second step,
    and every file is still at v0 (each file is replaced only after the last step) with
    no recorded version, so the next run starts over. Without the one-pass replay the
    copy was left at v1, recorded nowhere."""
    from dcr.files.materialize import recorded_version

    store = corrupt_copy(run, tmp_path, "v0000000002/")
    held = tmp_path / "held"
    shutil.copytree(run.train / "v0", held)
    with pytest.raises((ManifestError, CheckpointError), match="digest mismatch"):
        materialize(store, held, held=0, route="replay")
    assert bits_of(held) == bits_of(run.train / "v0")
    assert recorded_version(held) is None
    assert not [p for p in held.iterdir() if p.name.endswith(".dcr-patch")]


def test_a_snapshot_of_other_bits_is_refused_before_anything_is_written(
        run: Run, tmp_path: Path) -> None:
    """``dcr snapshot`` of v2's checkpoint as version 3: the fingerprints it computes for
    the index are compared with the history's first, and no object is written."""
    shutil.copytree(run.store.root, tmp_path / "store")
    store = FileStore(tmp_path / "store")
    hs = HistoryStore(store)
    want = hs.fingerprints(hs.read(), 3)
    with pytest.raises(ManifestError, match=r"is not version 3: .* Nothing was written"):
        write_snapshot(store, run.train / "v2", 3, expect=want)
    assert store.list("snapshots/v0000000003/") == []


def inode_bits(path: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(path.iterdir())}


def test_a_mirror_advances_in_whole_generations_and_never_touches_the_one_it_linked(
        run: Run, tmp_path: Path) -> None:
    """``dcr mirror`` from the public base model: v1, v2, v3 each become a generation
    beside the previous one, built from hard links of it and the committed deltas;
    ``current`` moves only once a generation is whole, the previous generation keeps its
    bits (the patch path writes changed files anew: were it to write into a linked file,
    v1 would turn into v2), and the oldest beyond ``keep`` goes."""
    from dcr.files.mirror import CURRENT, current, generations, sync

    base, root = run.rollout_root("mirror") / "v0", tmp_path / "mirror"
    first = sync(run.store, root, version=1, seed=(0, base))
    assert first.current.version == 1
    assert bits_of(root / CURRENT) == bits_of(run.train / "v1")
    v1 = inode_bits(first.current.path)
    second = sync(run.store, root, version=2)
    assert second.built is not None
    assert second.built.plan.route == "replay"
    assert bits_of(root / CURRENT) == bits_of(run.train / "v2")
    assert inode_bits(first.current.path) == v1  # untouched, and still v1's bits
    assert bits_of(first.current.path) == bits_of(run.train / "v1")
    third = sync(run.store, root)  # the newest committed
    assert (third.current.version, third.removed) == (LAST, (first.current.path,))
    assert [g.version for g in generations(root)] == [2, LAST]
    assert bits_of(root / CURRENT) == bits_of(run.train / f"v{LAST}")
    assert sync(run.store, root).built is None  # current already
    assert current(root) == third.current


def test_a_mirror_sync_refused_midway_leaves_current_and_every_generation_whole(
        run: Run, tmp_path: Path) -> None:
    """v3's payload is corrupted in the store: the sync from v2 fails, its build is
    removed, and ``current`` still names v2 with v2's bits (where ModelExpress 0.7.0 has
    half-applied the previous copy in place by then)."""
    from dcr.files.mirror import current, generations, sync

    base, root = run.rollout_root("mirror-bad") / "v0", tmp_path / "mirror"
    sync(run.store, root, version=2, seed=(0, base))
    store = corrupt_copy(run, tmp_path, f"v{LAST:010d}/")
    with pytest.raises((ManifestError, CheckpointError), match="digest mismatch"):
        sync(store, root)
    now = current(root)
    assert now is not None
    assert now.version == 2
    assert bits_of(now.path) == bits_of(run.train / "v2")
    assert [g.version for g in generations(root)] == [2]
    assert sorted(p.name for p in root.iterdir()) == ["current", "v0000000002"]


def test_pods_start_and_rejoin_from_the_mirror_fetching_only_what_checks_it(
        run: Run, tmp_path: Path) -> None:
    """An init container seeded from ``<mirror>/current`` (no --held: the generation
    records its version) and an agent's rejoin with ``mirror`` both start from the
    mirror's v3: they fetch the history and v3's manifest parts (the fingerprints that
    check every tensor), no payload and no snapshot, and end bit-exact."""
    from dcr.files.mirror import CURRENT, sync

    root = tmp_path / "mirror"
    sync(run.store, root, seed=(0, run.rollout_root("mirror-src") / "v0"))
    checks = len(run.store.get(HISTORY_KEY)) + sum(
        r.size for r in run.history.read().entry(LAST).parts)
    out = tmp_path / "weights" / "current"
    done = materialize(run.store, out, seed=root / CURRENT)
    assert (done.plan.route, done.fetched_bytes) == ("held", checks)
    assert bits_of(out) == bits_of(run.train / f"v{LAST}")
    pod = run.rollout_root("mirror-pod")
    built, how = FromStore(HistoryStore(run.store), pod, seed=(0, pod / "v0"),
                           mirror=root).build(LAST)
    assert (how.plan.route, how.fetched_bytes) == ("held", checks)
    assert bits_of(pod / built) == bits_of(run.train / f"v{LAST}")


def test_a_mirror_generation_with_other_bits_is_refused_before_anything_is_fetched(
        run: Run, tmp_path: Path) -> None:
    """Whoever can write the mirror volume cannot choose the weights: a generation
    that records v3 but holds v2's bits is refused by the fingerprints the history
    vouches for, like any seed."""
    from dcr.files.mirror import CURRENT, sync

    root = tmp_path / "mirror"
    sync(run.store, root, seed=(0, run.rollout_root("mirror-forged") / "v0"))
    gen = (root / CURRENT).resolve()
    (gen / "model.safetensors").unlink()
    shutil.copy(run.train / "v2" / "model.safetensors", gen)
    with pytest.raises(ManifestError, match="does not hold version 3"):
        materialize(run.store, tmp_path / "out", seed=root / CURRENT)


def test_dcr_mirror_once_prints_what_it_built_and_a_second_run_fetches_nothing_new(
        run: Run, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root, base = tmp_path / "mirror", run.rollout_root("mirror-cli") / "v0"

    def mirror() -> dict[str, object]:
        out = subprocess.run([sys.executable, "-m", "dcr", "mirror", "--store",
                              run.store.root.as_uri(), "--dir", str(root), "--seed", str(base),
                              "--held", "0", "--once", "--json"],
                             capture_output=True, text=True, check=True, timeout=90)
        got: dict[str, object] = json.loads(out.stdout)
        return got

    first = mirror()
    assert (first["version"], first["route"]) == (LAST, "replay")
    assert bits_of(root / "current") == bits_of(run.train / f"v{LAST}")
    again = mirror()
    assert (again["route"], again["fetched_bytes"]) == ("held", 0)


def store_copy(run: Run, tmp_path: Path) -> tuple[FileStore, HistoryStore]:
    shutil.copytree(run.store.root, tmp_path / "store")
    store = FileStore(tmp_path / "store")
    return store, HistoryStore(store)


def plant_snapshot(store: FileStore, version: int, files: dict[str, bytes],
                   tensors: dict[str, str]) -> ObjectRef:
    """What a store writer can write: pieces with the digests its index names, and the
    index with the fingerprints every manifest makes public."""
    prefix, listed = f"snapshots/v{version:010d}/", []
    for name, data in files.items():
        pieces = []
        for i, off in enumerate(range(0, len(data), 4096)):
            chunk = data[off:off + 4096]
            store.put(f"{prefix}{name}.p{i:05d}", chunk)
            pieces.append(Piece(key=f"{prefix}{name}.p{i:05d}", size=len(chunk),
                                digest=object_digest(chunk)))
        listed.append(SnapshotFile(name=name, size=len(data), pieces=tuple(pieces)))
    data = SnapshotIndex(version=version, files=tuple(listed), tensors=tensors).pack()
    store.put(f"{prefix}index.dcrs", data)
    return ObjectRef(key=f"{prefix}index.dcrs", size=len(data), digest=object_digest(data))


def assert_every_named_version_builds(run: Run, store: FileStore, tmp_path: Path) -> None:
    """The invariant retention keeps: every version the history names is built from the
    store, from a snapshot at or below it, or below the oldest from the public base model."""
    h = HistoryStore(store).read()
    base = tmp_path / "seed-v0"  # the public base model, on the pod's side
    shutil.copytree(run.train / "v0", base)
    for v in sorted({c.version for c in h.versions} | {s.version for s in h.snapshots}):
        out = tmp_path / f"built-v{v}"
        below = not any(s.version <= v for s in h.snapshots)
        materialize(store, out, version=v, **({"held": 0, "seed": base} if below else {}))
        assert bits_of(out) == bits_of(run.train / f"v{v}"), v


@pytest.mark.parametrize("bits", ["random", "v2"])
def test_a_planted_snapshot_is_not_adopted_and_pruning_keeps_every_version_buildable(
        run: Run, tmp_path: Path, bits: str) -> None:
    """A store writer plants an index for v3 carrying v3's (public) fingerprints over 4 KiB
    of random bytes, or over v2's real checkpoint. Adoption reads every piece back and
    fingerprints the tensors from those bytes, so neither is adopted; keepSnapshots: 1
    then prunes nothing, and once the real v3 snapshot is written, adopted and the rest
    pruned, every version the history names still builds. Adopted on the index's word,
    the plant made retention delete v2's snapshot and v1-v2, and v3 unbuildable."""
    store, hs = store_copy(run, tmp_path)
    fps = hs.fingerprints(hs.read(), 3)
    data = (np.random.default_rng(3).bytes(4096) if bits == "random"
            else (run.train / "v2" / "model.safetensors").read_bytes())
    plant_snapshot(store, 3, {"model.safetensors": data}, fps)
    hs._write(hs.adopt(hs.read()))  # what the next commit does
    assert [s.version for s in hs.read().snapshots] == [2]
    assert hs.prune(1)[1] == []
    assert_every_named_version_builds(run, store, tmp_path / "before")
    for key in store.list("snapshots/v0000000003/"):
        (store.root / key).unlink()
    write_snapshot(store, run.train / "v3", 3, piece_bytes=4096)
    hs._write(hs.adopt(hs.read()))
    kept, gone = hs.prune(1)
    assert ([s.version for s in kept.snapshots], [c.version for c in kept.versions]) == (
        [3], [3])
    assert "snapshots/v0000000002/" in gone
    assert_every_named_version_builds(run, store, tmp_path / "after")


def test_a_snapshot_that_cannot_be_built_gives_way_to_the_next_route(
        run: Run, tmp_path: Path) -> None:
    """A history that names a garbage snapshot of v3 declaring 1 byte (one no reader
    vouches for by digest): the plan tries it first, it is refused on fetching, and the
    build falls back to the next route, replay from the seed or the snapshot of v2, and
    says which it used and what it refused. It failed outright before."""
    store, hs = store_copy(run, tmp_path)
    ref = plant_snapshot(store, 3, {"model.safetensors": b"\0" * 4096},
                         hs.fingerprints(hs.read(), 3))
    hs.snapshot(Snapshot(version=3, index=ref, bytes=1))
    assert plan(hs.read(), 3, 0).snapshot == Snapshot(version=3, index=ref, bytes=1)
    base = run.rollout_root("fallback") / "v0"
    seeded = materialize(store, tmp_path / "seeded", held=0, seed=base)
    assert (seeded.plan.route, seeded.plan.start) == ("replay", 0)
    assert len(seeded.refused) == 1
    assert seeded.refused[0].startswith("snapshot from version 3")
    fresh = materialize(store, tmp_path / "fresh")
    assert (fresh.plan.route, fresh.plan.start) == ("snapshot", 2)
    for out in ("seeded", "fresh"):
        assert bits_of(tmp_path / out) == bits_of(run.train / "v3")


def test_only_tensor_files_and_the_seeds_allow_listed_files_reach_a_built_checkpoint(
        run: Run, tmp_path: Path) -> None:
    """A store writer adds config.json, modeling_x.py and a 20 MiB blob to a snapshot
    whose tensors are real (so it is adopted); the seed holds its own config and
    tokenizer beside a blob and notes. A build from the snapshot fetches no file but the
    tensors, and takes config and tokenizer from the seed only; nothing off the
    allow-list is copied. Before, every file of both reached the pod."""
    store, hs = store_copy(run, tmp_path)
    write_snapshot(store, run.train / "v3", 3, piece_bytes=4096)
    index = SnapshotIndex.parse(store.get("snapshots/v0000000003/index.dcrs"), "t")
    planted = {"config.json": b'{"planted": 1}', "modeling_x.py": b"import os\n",
               "blob.bin": b"\1" * (20 << 20)}
    plant_snapshot(store, 3, {**{f.name: b"".join(store.get(p.key) for p in f.pieces)
                                 for f in index.files}, **planted}, index.tensors)
    hs._write(hs.adopt(hs.read()))
    assert [s.version for s in hs.read().snapshots] == [2, 3]
    bare = materialize(store, tmp_path / "bare")
    assert bare.plan.route == "snapshot"
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == [
        ".dcr-version", "model.safetensors"]
    assert bare.fetched_bytes < (20 << 20)
    base = run.rollout_root("vouched") / "v0"
    for name, data in {"config.json": b'{"seed": 1}', "tokenizer.json": b"{}",
                       "blob.bin": b"\2" * 1024, "notes.txt": b"x"}.items():
        (base / name).write_bytes(data)
    for route in ("snapshot", "replay"):
        out = tmp_path / route
        materialize(store, out, held=0, seed=base, route=route)  # type: ignore[arg-type]
        assert sorted(p.name for p in out.iterdir()) == [
            ".dcr-version", "config.json", "model.safetensors", "tokenizer.json"], route
        assert (out / "config.json").read_bytes() == b'{"seed": 1}'


@pytest.mark.parametrize(("name", "count", "size", "match"), [
    ("tokenizer.json", 1, (64 << 20) + 1, r"tokenizer.json is 67108865 bytes"),
    ("modeling_{}.py", 33, 1, r"modeling_32.py is carried file 33; at most 32")])
def test_a_seed_over_the_carried_file_bounds_is_refused_by_name(
        run: Run, tmp_path: Path, name: str, count: int, size: int, match: str) -> None:
    base = run.rollout_root(f"bounds-{count}") / "v0"
    for i in range(count):
        with (base / name.format(f"{i:02d}")).open("wb") as f:
            f.truncate(size)
    with pytest.raises(CheckpointError, match=match):
        materialize(run.store, tmp_path / "out", held=0, seed=base)


def test_a_mirror_generation_carries_only_vouched_files_to_the_next(
        run: Run, tmp_path: Path) -> None:
    """Whoever writes the mirror volume adds a blob and a modeling_*.py to the current
    generation: the next generation, built from hard links of it, carries neither
    (config.json, from the seed, goes on). Before, every file was linked on."""
    from dcr.files.mirror import sync

    base, root = run.rollout_root("mirror-vouched") / "v0", tmp_path / "mirror"
    (base / "config.json").write_bytes(b"{}")
    first = sync(run.store, root, version=1, seed=(0, base))
    (first.current.path / "blob.bin").write_bytes(b"\1" * 1024)
    second = sync(run.store, root, version=2)
    assert sorted(p.name for p in second.current.path.iterdir()) == [
        ".dcr-version", "config.json", "model.safetensors"]


def test_dcr_history_lists_the_commits_and_snapshots_and_inspect_reads_a_committed_version(
        run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    """Fails without ``dcr history`` and the history route of ``dcr inspect``: nothing
    showed a store's history, and inspect read only manifests ``dcr diff`` wrote."""
    import json

    from dcr.cli import main

    uri = run.store.root.as_uri()
    assert main(["history", "--store", uri, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    h = run.history.read()
    assert report["committed"] == LAST
    assert [(v["base_version"], v["version"], v["attempt"]) for v in report["versions"]] == [
        (c.base_version, c.version, c.attempt) for c in h.versions]
    assert [s["version"] for s in report["snapshots"]] == [2]
    assert main(["history", "--store", uri]) == 0
    assert f"committed version {LAST}; {LAST} versions, 1 snapshots kept" in (
        capsys.readouterr().out)
    assert main(["inspect", "--store", uri, "--version", "2", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["version"] == 2
    assert described["attempt"] == h.versions[1].attempt
    assert sum(t["changed"] for t in described["tensor_rows"]) > 0
    assert main(["inspect", "--store", uri, "--version", "9"]) == 1
    assert "its history commits no such version (it commits: 1, 2, 3)" in (
        capsys.readouterr().err)
