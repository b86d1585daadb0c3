"""Snapshots: one version's whole checkpoint in a store, in pieces, and fetched back.

The training side writes the checkpoint's tensor files in pieces of
``PIECE_BYTES`` (each its own object, so a reader fetches them in parallel and checks
each by digest as it lands), then an index naming the pieces and every tensor's
fingerprint. A reader compares the index's fingerprints with those the history vouches
for before it fetches a piece, and the files' own tensors with them after, and only then
moves the directory into place: a refused snapshot leaves nothing behind. Nothing but
tensor files is written or fetched (:mod:`dcr.files.vouched` says why).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dcr.checkpoint import Checkpoint
from dcr.errors import CheckpointError, ManifestError
from dcr.files.history import get_checked
from dcr.files.ranksnap import assemble, put_index, snapshot_prefix
from dcr.files.vouched import is_tensor_file, tensor_files
from dcr.format.history import (
    PIECE_BYTES,
    ObjectRef,
    Piece,
    RankSnapshotIndex,
    Snapshot,
    SnapshotFile,
    SnapshotIndex,
    parse_index,
)
from dcr.format.names import object_digest
from dcr.transport.store import Store

PARALLEL = 4  # pieces in flight per reader or writer


def write_snapshot(store: Store, checkpoint: Path, version: int, *,
                   expect: dict[str, str] | None = None,
                   piece_bytes: int = PIECE_BYTES) -> Snapshot:
    """Put ``checkpoint``'s files and their index into ``store`` as version ``version``'s
    snapshot; what the history records of it. Its tensor files go, nothing else: a
    reader takes configs and tokenizer from its seed (:mod:`dcr.files.vouched`). With
    ``expect`` (the fingerprints the history vouches for), a checkpoint with other bits
    is refused before anything is written."""
    if not 0 < piece_bytes <= PIECE_BYTES:
        raise ValueError(f"piece_bytes {piece_bytes} must be in 1..{PIECE_BYTES}")
    with Checkpoint(checkpoint) as ckpt:
        tensors = {n: ckpt.fingerprint(n) for n in ckpt.names()}
    if expect is not None and (wrong := differing(tensors, expect)):
        raise ManifestError(f"{checkpoint} is not version {version}: {len(wrong)} tensors "
                            f"differ from the history's fingerprints, first {wrong[:3]}. "
                            "Nothing was written.")
    prefix = snapshot_prefix(version)
    names = sorted(p.name for p in tensor_files(checkpoint))

    def put_piece(job: tuple[Path, int, int, str]) -> Piece:
        path, offset, size, key = job
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read(size)
        store.put(key, data)
        return Piece(key=key, size=len(data), digest=object_digest(data))

    files = []
    with ThreadPoolExecutor(PARALLEL) as pool:
        for name in names:
            path = checkpoint / name
            size = path.stat().st_size
            jobs = [(path, off, min(piece_bytes, size - off), f"{prefix}{name}.{i:05d}")
                    for i, off in enumerate(range(0, size, piece_bytes))]
            files.append(SnapshotFile(name=name, size=size,
                                      pieces=tuple(pool.map(put_piece, jobs))))
    return put_index(store, SnapshotIndex(version=version, files=tuple(files),
                                          tensors=tensors))


def fetch_snapshot(store: Store, snap: Snapshot, out: Path, expect: dict[str, str], *,
                   progress: Callable[[int], None] | None = None) -> None:
    """Write the snapshot's checkpoint into the new directory ``out``, checked: the index
    by its digest, each piece by its own, and every tensor against ``expect`` (the
    fingerprints the history vouches for at ``snap.version``)."""
    index = parse_index(get_checked(store, snap.index, "Snapshot index"),
                        f"{store.uri}/{snap.index.key}")
    if index.version != snap.version:
        raise ManifestError(f"Snapshot index {snap.index.key} is of version {index.version}, "
                            f"not {snap.version}.")
    if index.tensors != expect:
        names = differing(index.tensors, expect)
        raise ManifestError(f"Snapshot of version {snap.version} does not hold the bits its "
                            f"history vouches for: {len(names)} tensor fingerprints differ, "
                            f"first {names[:3]}. Nothing was fetched.")
    if out.exists():
        raise CheckpointError(f"{out} exists; a snapshot is fetched into a new directory.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".dcr-fetch", dir=out.parent))
    try:
        if isinstance(index, RankSnapshotIndex):
            assemble(index, lambda p: get_checked(store, ObjectRef(
                key=p.key, size=p.size, digest=p.digest), "Snapshot piece"), tmp, expect,
                progress)
            os.replace(tmp, out)
            return
        _fetch_files(store, index, tmp, progress)
        with Checkpoint(tmp) as ckpt:
            have = {n: ckpt.fingerprint(n) for n in ckpt.names()}
            unread = sorted({f.name for f in index.files if f.name.endswith(".safetensors")}
                            - {p.name for p in ckpt.files})
        if unread:
            raise ManifestError(f"Snapshot of version {snap.version}: {unread[:3]} hold no "
                                "tensor the checkpoint reads; nothing unchecked is kept.")
        if have != expect:
            names = differing(have, expect)
            raise ManifestError(f"Snapshot of version {snap.version}: after fetching, "
                                f"{len(names)} tensors differ from their fingerprints, "
                                f"first {names[:3]}.")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def differing(have: dict[str, str], want: dict[str, str]) -> list[str]:
    """The tensors whose fingerprints differ, or that only one side names."""
    return sorted(n for n in set(have) | set(want) if have.get(n) != want.get(n))


def _fetch_files(store: Store, index: SnapshotIndex, into: Path,
                 progress: Callable[[int], None] | None) -> None:
    def fetch(job: tuple[Path, int, Piece]) -> None:
        path, offset, piece = job
        data = get_checked(store, ObjectRef(key=piece.key, size=piece.size,
                                            digest=piece.digest), "Snapshot piece")
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        if progress:
            progress(len(data))

    jobs = []
    files = [f for f in index.files if is_tensor_file(f.name)]  # nothing else is vouched for
    for f in files:
        path = into / f.name  # the name's pattern keeps it one level down, no dot
        with path.open("xb") as fh:
            fh.truncate(f.size)
        offset = 0
        for piece in f.pieces:
            jobs.append((path, offset, piece))
            offset += piece.size
    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(fetch, jobs))
    for f in files:
        with (into / f.name).open("rb") as done:
            os.fsync(done.fileno())
