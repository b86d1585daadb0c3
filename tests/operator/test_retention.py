"""Retention: after a commit the operator prunes the store by the fleet's keepSnapshots
(the history first, then the objects it no longer names) and shows what is kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcr.files.history import HistoryStore, retained
from dcr.format.history import Committed, History, ObjectRef, Snapshot
from dcr.format.layout import owner_manifest_key, version_prefix
from dcr.transport.store import FileStore
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.history import keep_history

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
