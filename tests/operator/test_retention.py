"""Retention: after a commit the operator prunes the store by the fleet's keepSnapshots
(the history first, then the objects it no longer names) and shows what is kept; with
snapshotEvery on a fleet of rank owners, the ranks write the snapshot from memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dcr.codec.sums import whole_sum
from dcr.errors import BaselineError
from dcr.files.history import HistoryStore, retained
from dcr.files.ranksnap import write_rank_part
from dcr.format.history import (
    Committed,
    History,
    ObjectRef,
    RankPart,
    RankSnapshotIndex,
    Snapshot,
    parse_index,
)
from dcr.format.layout import owner_manifest_key, version_prefix
from dcr.owner.server import BackgroundServer, EncoderService
from dcr.protocol.encoder_api import PublishRequest, SnapshotRequest
from dcr.protocol.owner_endpoints import OwnerEndpointFailed, OwnerEndpoints
from dcr.protocol.records import CommitRecord
from dcr.transport.store import FileStore
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.history import keep_history
from dcr_operator.ranksnap import rank_snapshot

VERSIONS, SNAPSHOTS = range(1, 11), (0, 4, 8)


def attempt(v: int) -> str:
    return f"a-{v:012d}"


def fleet(store: Path, keep: int | None) -> RolloutFleetSpec:
    return RolloutFleetSpec.model_validate({
        "selector": {"matchLabels": {"app": "r"}},
        "agent": {"tokenSecretRef": {"name": "t", "key": "token"}},
        "store": {"uri": store.as_uri()},
        "initial": {"version": 0, "checkpoint": "/ckpt/v0"},
        "retention": {} if keep is None else {"keepSnapshots": keep}})


class Kube:
    def __init__(self) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []

    def merge_patch(self, path: str, body: dict[str, Any]) -> Any:
        self.patches.append((path, body))
        return body


def store_of_ten_versions(root: Path) -> HistoryStore:
    """Versions 1..10 committed, snapshots of 0, 4 and 8; an object under every prefix."""
    ref = ObjectRef(key="x", size=1, digest="0" * 32)
    versions = []
    for v in VERSIONS:
        part = owner_manifest_key(v, attempt(v), 0)
        (root / part).parent.mkdir(parents=True)
        (root / part).write_bytes(b"part")
        versions.append(Committed(version=v, base_version=v - 1, attempt=attempt(v),
                                  parts=(ObjectRef(key=part, size=4, digest="0" * 32),),
                                  payload_bytes=10))
    for s in SNAPSHOTS:
        (root / f"snapshots/v{s:010d}").mkdir(parents=True)
        (root / f"snapshots/v{s:010d}/index.dcrs").write_bytes(b"index")
    hs = HistoryStore(FileStore(root))
    hs._write(History(versions=tuple(versions), snapshots=tuple(
        Snapshot(version=s, index=ref, bytes=100) for s in SNAPSHOTS)))
    return hs


def test_keeping_two_snapshots_removes_what_only_older_versions_needed(tmp_path: Path) -> None:
    hs = store_of_ten_versions(tmp_path)
    kube = Kube()
    staged, hs.pruned = retained(hs.read(), 2)  # as the commit's history is staged
    hs._write(staged)
    keep_history(kube, "rl", "f", fleet(tmp_path, keep=2), hs)  # type: ignore[arg-type]
    kept = hs.read()
    # Snapshots 4 and 8 stay, and every version from 4 on (4's own entry vouches for it).
    assert [s.version for s in kept.snapshots] == [4, 8]
    assert [c.version for c in kept.versions] == list(range(4, 11))
    for v in VERSIONS:
        assert (tmp_path / version_prefix(v) / attempt(v)).exists() == (v >= 4), v
    assert not (tmp_path / "snapshots/v0000000000").exists()
    assert (tmp_path / "snapshots/v0000000004").exists()
    ((path, body),) = kube.patches
    assert path.endswith("/rolloutfleets/f/status")
    assert body["status"]["history"] == {
        "oldestVersion": 4, "committedVersion": 10, "snapshots": [4, 8],
        "pruned": [f"{version_prefix(v)}/{attempt(v)}/" for v in (1, 2, 3)]
        + ["snapshots/v0000000000/"]}


def test_without_a_retention_nothing_is_removed_and_status_shows_it_all(
        tmp_path: Path) -> None:
    hs = store_of_ten_versions(tmp_path)
    kube = Kube()
    keep_history(kube, "rl", "f", fleet(tmp_path, keep=None), hs)  # type: ignore[arg-type]
    assert all((tmp_path / version_prefix(v) / attempt(v)).exists() for v in VERSIONS)
    assert kube.patches[0][1]["status"]["history"]["snapshots"] == [0, 4, 8]
    assert kube.patches[0][1]["status"]["history"]["oldestVersion"] == 1


# --- snapshotEvery on a fleet of rank owners --------------------------------------------

RANK_TOKEN = "retention-rank-token-0123456789"
CANONICAL = np.arange(4 * 6, dtype=np.uint16).reshape(4, 6) * 7  # one canonical tensor


class NoPublish:
    def prepare(self, req: PublishRequest) -> Any:
        raise AssertionError("no publish in these tests")


def rank_of(k: int, refuse: bool = False) -> Any:
    """What rank ``k`` of 2 answers a snapshot with: its rows of ``CANONICAL``, from memory."""
    def snapshot(req: SnapshotRequest, store: Any) -> RankPart:
        if refuse:
            raise BaselineError(f"Rank {k}: its committed baseline is not {req.version}.")
        rows = CANONICAL[2 * k:2 * k + 2]
        return write_rank_part(store, req.version, k, [
            ("w", "BF16", (4, 6), (12 * k, (12,), (1,)), rows)])
    return snapshot


def endpoints_of(store: FileStore, snapshotters: list[Any]) -> tuple[OwnerEndpoints, list[Any]]:
    servers = [BackgroundServer(EncoderService(store, NoPublish(), snapshotter=s), RANK_TOKEN)
               for s in snapshotters]
    return OwnerEndpoints(name="ranks", urls=[s.url for s in servers], token=RANK_TOKEN,
                          target="/ranks/v2", base_checkpoint="/ranks/v2",
                          store=store.uri), servers


RECORD = CommitRecord(committed_version=2, baseline_id="/ranks/v2", attempt="a-2")


def test_snapshot_every_on_rank_owners_has_the_ranks_write_it_from_memory(
        tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    endpoints, servers = endpoints_of(store, [rank_of(0), rank_of(1)])
    try:
        snap = rank_snapshot(endpoints, RECORD, store)
    finally:
        for s in servers:
            s.close()
    assert snap is not None
    assert snap.version == 2
    index = parse_index(store.get(snap.index.key), snap.index.key)
    assert isinstance(index, RankSnapshotIndex)
    assert [p.rank for p in index.ranks] == [0, 1]
    assert index.tensors == {"w": whole_sum(CANONICAL)}


def test_an_endpoint_that_writes_no_snapshot_from_memory_leaves_it_to_the_job(
        tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    endpoints, servers = endpoints_of(store, [None])  # a dcr encoder of checkpoints
    try:
        assert rank_snapshot(endpoints, RECORD, store) is None
    finally:
        for s in servers:
            s.close()
    assert not store.list("snapshots/")


def test_a_rank_that_cannot_write_its_part_fails_the_snapshot_naming_it(
        tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    endpoints, servers = endpoints_of(store, [rank_of(0), rank_of(1, refuse=True)])
    try:
        with pytest.raises(OwnerEndpointFailed, match=r"Owner 1's part of the snapshot of "
                                                      r"version 2.*Rank 1"):
            rank_snapshot(endpoints, RECORD, store)
    finally:
        for s in servers:
            s.close()
    assert not store.list("snapshots/v0000000002/index.dcrs")
