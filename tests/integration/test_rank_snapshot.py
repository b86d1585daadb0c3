"""Snapshots written from the ranks' memory, and retention for a fleet of rank owners.

Two Megatron-style ranks (fused qkv, fused gate/up, row and column splits, replicated
norms) commit five versions through the coordinator with the store's history and
``keep_snapshots=1``; after every second commit each rank writes its part of a snapshot
from its baseline and the index names the parts (format version 2, ``sum64``). The next
commit adopts it after reading every piece back, retention prunes the deltas before it,
and ``materialize`` from nothing builds the newest version from the snapshot plus the
later deltas, bit-exact against the dense state. A tampered piece is refused naming it;
a reader of format version 1 refuses the index by its version.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from shardrig import DENSE, V0, perturbed, receivers, tp_shards

from dcr.codec.sums import whole_sum
from dcr.errors import BaselineError, ManifestError
from dcr.files.history import HistoryStore
from dcr.files.materialize import materialize
from dcr.files.ranksnap import assemble, read_back_ranks, write_rank_index
from dcr.format.history import Piece, RankSnapshotIndex, SnapshotIndex, parse_index
from dcr.format.names import object_digest
from dcr.owner.rank import RankOwner, serve
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.encoder_api import EncoderClient, EncoderError, SnapshotRequest
from dcr.runtimes.vllm_reference import random_checkpoint
from dcr.transport.store import FileStore

State = dict[str, torch.Tensor]
TOKEN = "rank-snapshot-test-token-0123456789"


def rank_owners(sd: State, store: FileStore) -> tuple[list[RankOwner], list[State]]:
    owners, live = [], []
    for r in range(2):
        maps, local = tp_shards(sd, r, 2, qkv=DENSE)
        tensors = {k: t.clone() for k, t in local.items()}
        owners.append(RankOwner(store=store, maps=maps, tensors=tensors, version=0, rank=r,
                                ranks=2))
        live.append(tensors)
    return owners, live


def snapshot(owners: list[RankOwner], store: FileStore, version: int) -> None:
    """What the coordinator does after a K-th commit: each rank writes its part."""
    write_rank_index(store, version, [o.write_snapshot(version) for o in owners])


def remove(store: FileStore, prefixes: list[str]) -> None:
    for p in prefixes:
        shutil.rmtree(store.root / p, ignore_errors=True)


def same_bits(built: Path, sd: State) -> None:
    got = load_file(str(built / "model.safetensors"))
    assert got.keys() == sd.keys()
    for n, t in sd.items():
        assert got[n].shape == t.shape, n
        assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), n


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[FileStore, list[RankOwner], list[State]]:
    """Five versions committed, a snapshot after every second, keep_snapshots=1."""
    store = FileStore(tmp_path / "store")
    states = [random_checkpoint(DENSE, 0)]
    rx, _ = receivers(DENSE, states[0], store, (2, 1), tmp_path)
    owners, live = rank_owners(states[0], store)
    history = HistoryStore(store, keep_snapshots=1)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx,
                        history=history)
    for v in range(1, 6):
        states.append(perturbed(states[-1], 0.05, v))
        for r, tensors in enumerate(live):
            for k, t in tp_shards(states[v], r, 2, qkv=DENSE)[1].items():
                tensors[k].copy_(t)
        for o, tensors in zip(owners, live, strict=True):
            o.offer(tensors, v)
        coord.refit(v, f"v{v}")
        remove(store, history.pruned)
        if v % 2 == 0:
            snapshot(owners, store, v)
    coord.close()
    return store, owners, states


def test_rank_snapshots_are_adopted_and_retention_keeps_the_newest_and_later_deltas(
        fleet: tuple[FileStore, list[RankOwner], list[State]], tmp_path: Path) -> None:
    store, _, states = fleet
    h = HistoryStore(store).read()
    assert [s.version for s in h.snapshots] == [4]  # v2's adopted at v3, pruned at v5
    assert [c.version for c in h.versions] == [4, 5]
    assert not store.list("snapshots/v0000000002/")
    assert not [k for k in store.list("") if k.startswith(("v0000000001/", "v0000000002/",
                                                            "v0000000003/"))]
    assert parse_index(store.get(h.snapshots[0].index.key), "index").format_version == 2
    done = materialize(store, tmp_path / "late")
    assert (done.plan.route, done.plan.start, done.plan.target) == ("snapshot", 4, 5)
    same_bits(tmp_path / "late", states[5])
    materialize(store, tmp_path / "at4", version=4)
    same_bits(tmp_path / "at4", states[4])


def test_a_seed_older_than_the_pruned_history_gives_way_to_the_snapshot(
        fleet: tuple[FileStore, list[RankOwner], list[State]], tmp_path: Path) -> None:
    """A new pod's init container holds the public v0, which retention left no delta
    from and no fingerprint of: it builds from the snapshot (configs would come from the
    seed) instead of failing on a check nothing can vouch for."""
    store, _, states = fleet
    (tmp_path / "seed").mkdir()
    save_file(states[0], str(tmp_path / "seed" / "model.safetensors"))
    done = materialize(store, tmp_path / "pod", held=0, seed=tmp_path / "seed")
    assert (done.plan.route, done.plan.start) == ("snapshot", 4)
    same_bits(tmp_path / "pod", states[5])


def test_a_tampered_rank_piece_is_refused_by_name(
        fleet: tuple[FileStore, list[RankOwner], list[State]], tmp_path: Path) -> None:
    store, _, _ = fleet
    piece = "snapshots/v0000000004/rank-00001.00000"
    data = bytearray(store.get(piece))
    data[len(data) // 2] ^= 1
    store.put(piece, bytes(data))
    with pytest.raises(ManifestError, match=f"Snapshot piece {piece}: digest mismatch"):
        materialize(store, tmp_path / "late")  # v4's deltas are pruned: no other route
    assert not (tmp_path / "late").exists()


def test_a_rank_snapshot_with_a_piece_and_index_rewritten_is_not_adopted(
        tmp_path: Path) -> None:
    """A store writer changes rank 1's bits and rewrites the index's digests to match:
    reading the pieces back, rank 1's sums are not the ones its part declares."""
    store = FileStore(tmp_path / "store")
    sd = random_checkpoint(DENSE, 0)
    rx, _ = receivers(DENSE, sd, store, (2, 1), tmp_path)
    owners, live = rank_owners(sd, store)
    history = HistoryStore(store)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx, history=history)
    for v in (1, 2):
        for o, tensors in zip(owners, live, strict=True):
            tensors[next(iter(tensors))].add_(1.0)
            o.offer(tensors, v)
        coord.refit(v, f"v{v}")
        if v == 1:
            write_rank_index(store, 1, [o.write_snapshot(1) for o in owners])
            key = "snapshots/v0000000001/index.dcrs"
            index = RankSnapshotIndex.parse(store.get(key), key)
            forged = bytearray(store.get(index.ranks[1].pieces[0].key))
            forged[:2] = bytes([forged[0] ^ 1, forged[1]])
            store.put(index.ranks[1].pieces[0].key, bytes(forged))
            write_rank_index(store, 1, [index.ranks[0], index.ranks[1].model_copy(update={
                "pieces": (index.ranks[1].pieces[0].model_copy(update={
                    "digest": object_digest(bytes(forged))}), *index.ranks[1].pieces[1:])})])
    coord.close()
    assert HistoryStore(store).read().snapshots == ()


def test_a_reader_of_format_version_1_refuses_the_rank_index_by_its_version(
        fleet: tuple[FileStore, list[RankOwner], list[State]]) -> None:
    store, _, _ = fleet
    key = "snapshots/v0000000004/index.dcrs"
    with pytest.raises(ManifestError, match=r"[Ff]ormat.version"):
        SnapshotIndex.parse(store.get(key), key)
    with pytest.raises(ManifestError, match=r"has snapshot index format version 3, but this "
                                            r"DCR \S+ reads snapshot index format versions 1-2"):
        parse_index(store.get(key).replace(b'"format_version":2', b'"format_version":3'), key)


def test_a_rank_writes_a_snapshot_only_of_its_committed_baseline(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    owners, _ = rank_owners(random_checkpoint(DENSE, 0), store)
    with pytest.raises(BaselineError, match="a snapshot of version 3; this rank's committed "
                                            "baseline is 0"):
        owners[0].write_snapshot(3)
    part = owners[1].write_snapshot(0)
    assert part.rank == 1
    assert part.size == sum(p.size for p in part.pieces)
    assert all(p.key.startswith("snapshots/v0000000000/rank-00001.") for p in part.pieces)


def test_over_http_a_rank_writes_only_its_own_part_and_only_with_the_token(
        tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    owners, _ = rank_owners(random_checkpoint(DENSE, 0), store)
    server = serve(owners[1], token=TOKEN)
    try:
        client = EncoderClient(server.url, TOKEN, name="rank-1")
        with pytest.raises(EncoderError, match="rank 1 of 2; the request is for owner 0") as e:
            client.snapshot(SnapshotRequest(version=0, owner=0, owners=2), timeout_s=30)
        assert e.value.status == 400
        with pytest.raises(EncoderError, match="Missing or wrong bearer token"):
            EncoderClient(server.url, "x" * 32).snapshot(
                SnapshotRequest(version=0, owner=1, owners=2), timeout_s=30)
        assert not store.list("snapshots/")
        part = client.snapshot(SnapshotRequest(version=0, owner=1, owners=2), timeout_s=30)
    finally:
        server.close()
    assert part.rank == 1
    assert [p.key for p in part.pieces] == store.list("snapshots/v0000000000/")


@pytest.mark.parametrize("piece_bytes", [1001, 65536])
def test_pieces_that_split_elements_and_regions_read_back_and_assemble_exactly(
        tmp_path: Path, piece_bytes: int) -> None:
    """Pieces of 1001 bytes split BF16 elements and regions; 64 KiB hold several regions.
    Each rank's stream sums to its part and assembles into the dense state's bits."""
    store = FileStore(tmp_path / "store")
    sd = random_checkpoint(DENSE, 0)
    owners, _ = rank_owners(sd, store)
    snap = write_rank_index(store, 0, [o.write_snapshot(0, piece_bytes=piece_bytes)
                                       for o in owners])
    index = RankSnapshotIndex.parse(store.get(snap.index.key), snap.index.key)
    expect = {n: whole_sum(t.contiguous().view(torch.int16).numpy().view(np.uint16))
              for n, t in sd.items()}
    assert index.tensors == expect

    def get(p: Piece) -> bytes:
        return store.get(p.key)

    assert read_back_ranks(index, get, "here") == expect
    (tmp_path / "out").mkdir()
    assemble(index, get, tmp_path / "out", expect)
    same_bits(tmp_path / "out", sd)
