"""Snapshots from the ranks' memory: each rank writes its regions, a reader assembles them.

A fleet whose owners are the trainer's ranks has no checkpoint directory to snapshot, and
its history vouches for every tensor by ``sum64`` (a sum over elements, so parts add up),
not ``xxh3-128``. So each rank writes the canonical elements it holds of the committed
version, region by region as its manifest part addresses them (``ShardMap.pieces``), as
one stream in 64 MiB pieces, and answers a :class:`RankPart`; the coordinator writes the
index over the parts (``RankSnapshotIndex``, format version 2). Adoption reads every piece
back, each by its digest, and sums each rank's regions from those bytes: a rank's sums must
be the ones its part declares, and the whole tensors' the history's at that version. A
reader scatters each rank's regions into one safetensors file in Hugging Face canonical
coordinates and checks every tensor's sum before the directory takes the output's place.
docs/retention.md, "Rank-owner fleets".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dcr.codec.planes import UInt
from dcr.codec.sums import CHUNK, MASK64, index_sum, span_at, span_sum, whole_sum
from dcr.errors import ManifestError
from dcr.format.dtypes import DTYPES
from dcr.format.history import (
    PIECE_BYTES,
    AnyIndex,
    ObjectRef,
    Piece,
    RankPart,
    RankRegion,
    RankSnapshotIndex,
    RankTensor,
    Snapshot,
)
from dcr.format.names import object_digest
from dcr.format.regions import Span, sum_text, sum_value
from dcr.transport.store import Store

PARALLEL = 4  # pieces in flight per reader
OUT_NAME = "model.safetensors"  # the one tensor file a rank snapshot is built into
# (canonical tensor, dtype, canonical shape, a span of it, the span's elements in order)
Region = tuple[str, str, tuple[int, ...], Span, UInt]
Visit = Callable[[RankRegion, int, UInt], None]  # region, first element, its next bits


def snapshot_prefix(version: int) -> str:
    return f"snapshots/v{version:010d}/"  # the history adopts snapshots/v<N>/index.dcrs


def write_rank_part(store: Store, version: int, rank: int, regions: Iterable[Region], *,
                    piece_bytes: int = PIECE_BYTES) -> RankPart:
    """Put ``regions`` (a rank's elements of ``version``) into ``store`` as rank ``rank``'s
    stream of its snapshot, in pieces of ``piece_bytes``; what the index lists of it."""
    if not 0 < piece_bytes <= PIECE_BYTES:
        raise ValueError(f"piece_bytes {piece_bytes} must be in 1..{PIECE_BYTES}")
    prefix = f"{snapshot_prefix(version)}rank-{rank:05d}."
    pieces: list[Piece] = []
    buf = bytearray()

    def flush(every: bool) -> None:
        while len(buf) >= piece_bytes or (every and buf):
            data = bytes(buf[:piece_bytes])
            del buf[:piece_bytes]
            key = f"{prefix}{len(pieces):05d}"
            store.put(key, data)
            pieces.append(Piece(key=key, size=len(data), digest=object_digest(data)))

    listed: list[RankRegion] = []
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    sums: dict[str, int] = {}
    size = 0
    for name, dtype, shape, span, bits in regions:
        flat = np.ascontiguousarray(bits).reshape(-1)
        listed.append(RankRegion(tensor=name, span=span))
        tensors[name] = (dtype, tuple(shape))
        sums[name] = (sums.get(name, 0) + span_sum(flat, span)) & MASK64
        raw = flat.view(np.uint8).data  # a view: no copy of the region beyond a piece
        for lo in range(0, len(raw), piece_bytes):
            buf += raw[lo:lo + piece_bytes]
            flush(False)
        size += flat.nbytes
    flush(True)
    return RankPart(rank=rank, size=size, pieces=tuple(pieces), regions=tuple(listed),
                    tensors={n: RankTensor(dtype=d, shape=s, sum=sum_text(sums[n]))
                             for n, (d, s) in tensors.items()})


def write_rank_index(store: Store, version: int, parts: Iterable[RankPart]) -> Snapshot:
    """The index over every rank's part, written under the snapshot's prefix: what the
    history records of it once a commit adopted it."""
    ranks = tuple(sorted(parts, key=lambda p: p.rank))
    totals: dict[str, int] = {}
    for p in ranks:
        for n, t in p.tensors.items():
            totals[n] = (totals.get(n, 0) + sum_value(t.sum)) & MASK64
    return put_index(store, RankSnapshotIndex(
        version=version, ranks=ranks,
        tensors={n: sum_text(v) for n, v in sorted(totals.items())}))


def put_index(store: Store, index: AnyIndex) -> Snapshot:
    """Write a snapshot's index, last, under its version's prefix; what the history
    records of the snapshot once a commit adopted it."""
    data = index.pack()
    key = f"{snapshot_prefix(index.version)}index.dcrs"
    store.put(key, data)
    return Snapshot(version=index.version, index=ObjectRef(key=key, size=len(data),
                                                           digest=object_digest(data)),
                    bytes=index.total_bytes)


def walk(part: RankPart, chunks: Iterable[bytes], visit: Visit, where: str) -> None:
    """Feed a rank's stream, in ``chunks`` as they land, to ``visit`` region by region:
    (region, index of its first element in this call, those elements' bits)."""
    regions = list(part.regions)
    k, done, carry = 0, 0, b""
    for data in chunks:
        buf = carry + data if carry else data
        at = 0
        while k < len(regions):
            r = regions[k]
            item = DTYPES[part.tensors[r.tensor].dtype].itemsize
            n = math.prod(r.span[1])
            take = min(n - done, (len(buf) - at) // item)
            if take:
                visit(r, done, np.frombuffer(buf, np.dtype(f"<u{item}"), take, at))
                done, at = done + take, at + take * item
            if done < n:
                break
            k, done = k + 1, 0
        carry = buf[at:]
    if k < len(regions) or carry:
        raise ManifestError(f"Snapshot {where}: rank {part.rank}'s stream does not end "
                            "where its regions do.")


def elements_sum(span: Span, first: int, bits: UInt) -> int:
    """The sum (``dcr.codec.sums``) of a span's elements ``first`` on, given in order."""
    offset, sizes, strides = span
    if len(sizes) == 1 and strides == (1,):
        return span_sum(bits, (offset + first, (bits.size,), (1,)))
    total = 0
    for lo in range(0, bits.size, CHUNK):
        at = span_at(span, np.arange(first + lo, first + min(bits.size, lo + CHUNK),
                                     dtype=np.int64))
        total += index_sum(bits[lo:lo + CHUNK], at)
    return total & MASK64


def read_back_ranks(index: RankSnapshotIndex, get: Callable[[Piece], bytes], where: str
                    ) -> dict[str, str]:
    """Every tensor's whole ``sum64``, from the bytes ``get`` returns for each piece
    (checked by its digest there). Refuses, naming the rank and its pieces, a rank whose
    bytes do not sum to what its part declares."""
    totals: dict[str, int] = {}
    for part in index.ranks:
        sums: dict[str, int] = {}

        def add(r: RankRegion, first: int, bits: UInt, sums: dict[str, int] = sums) -> None:
            sums[r.tensor] = (sums.get(r.tensor, 0) + elements_sum(r.span, first, bits)) & MASK64

        walk(part, (get(p) for p in part.pieces), add, where)
        wrong = sorted(n for n, t in part.tensors.items() if sum_text(sums.get(n, 0)) != t.sum)
        if wrong:
            raise ManifestError(f"Snapshot {where}: the pieces of rank {part.rank} "
                                f"({part.pieces[0].key if part.pieces else 'none'} on) do not "
                                f"hold what its part declares: {len(wrong)} tensors sum "
                                f"otherwise, first {wrong[:3]}.")
        for n, v in sums.items():
            totals[n] = (totals.get(n, 0) + v) & MASK64
    return {n: sum_text(totals.get(n, 0)) for n in index.tensors}


def _header(index: RankSnapshotIndex) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The safetensors header of the assembled file (tensors by name, in order) and each
    tensor's byte range in its data."""
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    ranges, at = {}, 0
    for name, (dtype, shape) in sorted(index.shapes().items()):
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        ranges[name] = (at, at + nbytes)
        at += nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes
    return len(raw).to_bytes(8, "little") + raw, ranges


def _ordered(pool: ThreadPoolExecutor, get: Callable[[Piece], bytes],
             pieces: Iterable[Piece]) -> Iterator[bytes]:
    """``get`` of each piece, in order, at most ``PARALLEL`` in flight."""
    window: list[Future[bytes]] = []
    for p in pieces:
        window.append(pool.submit(get, p))
        if len(window) >= PARALLEL:
            yield window.pop(0).result()
    for f in window:
        yield f.result()


def assemble(index: RankSnapshotIndex, get: Callable[[Piece], bytes], into: Path,
             expect: dict[str, str], progress: Callable[[int], None] | None = None) -> None:
    """Build the snapshot's tensors in ``into`` (a new, empty directory) as one safetensors
    file, each rank's regions scattered into place as its pieces land, then check every
    tensor's ``sum64`` against ``expect`` (the history's at the snapshot's version)."""
    head, ranges = _header(index)
    path = into / OUT_NAME
    with path.open("xb") as f:
        f.write(head)
        f.truncate(len(head) + sum(b - a for a, b in ranges.values()))
    shapes = index.shapes()
    data = np.memmap(path, np.uint8, "r+", offset=len(head)) if ranges else None

    def view(name: str) -> UInt:
        assert data is not None
        a, b = ranges[name]
        out: UInt = data[a:b].view(f"<u{DTYPES[shapes[name][0]].itemsize}")
        return out

    def put(r: RankRegion, first: int, bits: UInt) -> None:
        flat, (offset, sizes, strides) = view(r.tensor), r.span
        if len(sizes) == 1 and strides == (1,):
            flat[offset + first: offset + first + bits.size] = bits
        else:
            for lo in range(0, bits.size, CHUNK):
                at = span_at(r.span, np.arange(first + lo, first + min(bits.size, lo + CHUNK),
                                               dtype=np.int64))
                flat[at] = bits[lo:lo + CHUNK]

    def counted(p: Piece) -> bytes:
        got = get(p)
        if progress:
            progress(len(got))
        return got

    with ThreadPoolExecutor(PARALLEL) as pool:
        for part in index.ranks:
            walk(part, _ordered(pool, counted, part.pieces), put, str(into))
    wrong = sorted(n for n in ranges if whole_sum(view(n)) != expect.get(n))
    if data is not None:
        data.flush()
        del data
    if wrong or set(expect) != set(ranges):
        names = wrong or sorted(set(expect) ^ set(ranges))
        raise ManifestError(f"Snapshot of version {index.version}: after assembling the "
                            f"ranks' regions, {len(names)} tensors differ from their "
                            f"fingerprints, first {names[:3]}.")
    with path.open("rb") as done:
        os.fsync(done.fileno())


__all__ = ["OUT_NAME", "assemble", "put_index", "read_back_ranks", "snapshot_prefix", "walk",
           "write_rank_index", "write_rank_part"]
