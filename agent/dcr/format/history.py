"""What a receiver reads from the store alone to reach any committed version.

The **history** names every committed version (its base, the attempt that committed it,
and that attempt's manifest parts by size and digest) and the **snapshots** kept (each an
index object by size and digest). A **snapshot index** names the files of one version's
checkpoint, each in pieces by size and digest, and every tensor's fingerprint. So one
digest of the history vouches for everything a catch-up fetches: parts name payloads by
digest, and fingerprints check the bits before and after every step (docs/catch-up.md,
"The trust chain").
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dcr.errors import ManifestError, first_validation_error
from dcr.format.dtypes import DTYPES
from dcr.format.layout import MAX_OWNERS, owner_manifest_key
from dcr.format.names import ATTEMPT_PATTERN, object_digest
from dcr.format.regions import SUM_PATTERN, Span, extent, sum_text, sum_value
from dcr.versions import HISTORY, SNAPSHOT_INDEX, Wire

HISTORY_KEY = "history.dcrh"
MAX_HISTORY_BYTES = 64 << 20  # ~250 B per version: a few hundred thousand versions
AHEAD_VERSIONS = 64  # how far past the version a reader was told of the store's may be
MAX_INDEX_BYTES = 64 << 20  # ~100 B per piece or tensor
PIECE_BYTES = 64 << 20  # snapshot files are stored in pieces of this size

_HEX32 = r"^[0-9a-f]{32}$"
_FINGERPRINT = r"^xxh3-128:[0-9a-f]{32}$"
_FILE_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$"  # one level, no leading dot


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ObjectRef(_Model):
    key: Annotated[str, Field(min_length=1, description="Object key relative to the store root")]
    size: Annotated[int, Field(ge=0)]
    digest: Annotated[str, Field(pattern=_HEX32, description="BLAKE2b-128 of the object")]


class Committed(_Model):
    """One committed version and the attempt whose payloads produce it from its base."""

    version: Annotated[int, Field(ge=1)]
    base_version: Annotated[int, Field(ge=0)]
    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)]
    parts: tuple[ObjectRef, ...]  # the attempt's manifest parts, one per owner, in order
    payload_bytes: Annotated[int, Field(ge=0)]

    @model_validator(mode="after")
    def _forward(self) -> Committed:
        if len(self.parts) > MAX_OWNERS:
            raise ValueError(f"version {self.version} names {len(self.parts)} manifest "
                             f"parts, over the limit of {MAX_OWNERS} owners")
        if self.version <= self.base_version or not self.parts:
            raise ValueError(f"version {self.version} must follow its base "
                             f"{self.base_version} and name its manifest parts")
        return self


class Snapshot(_Model):
    version: Annotated[int, Field(ge=0)]
    index: ObjectRef
    bytes: Annotated[int, Field(ge=0, description="the checkpoint's bytes, all pieces")]


class History(_Model):
    format: Literal["dcr-history"] = "dcr-history"
    format_version: Literal[1] = 1
    versions: tuple[Committed, ...] = ()  # ascending; each one's base is the one before
    snapshots: tuple[Snapshot, ...] = ()  # ascending by version

    @model_validator(mode="after")
    def _a_chain(self) -> History:
        for a, b in zip(self.versions, self.versions[1:], strict=False):
            if b.base_version != a.version:
                raise ValueError(f"version {b.version} has base {b.base_version}, but the "
                                 f"version before it is {a.version}")
        kept = [s.version for s in self.snapshots]
        if kept != sorted(set(kept)):
            raise ValueError(f"snapshots must ascend without repeats: {kept}")
        return self

    @property
    def committed(self) -> int:
        """The newest committed version (the first base if none is)."""
        return self.versions[-1].version if self.versions else 0

    def entry(self, version: int) -> Committed:
        for c in self.versions:
            if c.version == version:
                return c
        raise ManifestError(f"The history holds no committed version {version} (it holds "
                            f"{self.span()}).")

    def chain(self, start: int, end: int) -> list[Committed]:
        """The committed versions that take ``start`` to ``end``, in order."""
        steps = [c for c in self.versions if start < c.version <= end]
        if start != end and (not steps or steps[0].base_version != start
                             or steps[-1].version != end):
            raise ManifestError(f"The history holds no chain of committed versions from "
                                f"{start} to {end} (it holds {self.span()}).")
        return steps

    def vouches(self, version: int) -> bool:
        """Whether the committed manifests list fingerprints of ``version`` (a committed
        version, or the first one's base): what a held copy of it is checked by."""
        return any(version in (c.version, c.base_version) for c in self.versions)

    def span(self) -> str:
        if not self.versions:
            return "no committed version"
        return f"versions {self.versions[0].version}-{self.versions[-1].version}"

    def pack(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def parse(cls, data: bytes, where: str, limit: int = MAX_HISTORY_BYTES) -> History:
        """``data`` as a history, refused unread when over ``limit`` bytes (a reader's
        :func:`history_bound`)."""
        return _parse(cls, data, where, min(limit, MAX_HISTORY_BYTES), "History",
                      wire=HISTORY)


def _widest(parts: int) -> int:
    """The packed size of a history of one committed version with ``parts`` manifest parts
    and one snapshot, every number and name as long as a writer makes them."""
    big, attempt = 10**10 - 1, "a" * 64
    ref = ObjectRef(key=owner_manifest_key(big, attempt, MAX_OWNERS - 1), size=2**63 - 1,
                    digest="0" * 32)
    return len(History(
        versions=(Committed(version=big, base_version=big - 1, attempt=attempt,
                            parts=(ref,) * parts, payload_bytes=2**63 - 1),),
        snapshots=(Snapshot(version=big, index=ref, bytes=2**63 - 1),)).pack())


_ONE, _PART = _widest(1), _widest(2) - _widest(1)  # a version with its snapshot; a part
_EMPTY = len(History().pack())


def history_bound(versions: int, owners: int) -> int:
    """The most bytes a history the coordinator writes can take when it names at most
    ``versions`` committed versions (a fleet's newest: retention only keeps fewer), each
    by at most ``owners`` manifest parts, and a snapshot of each: what a reader that
    knows both refuses to parse beyond (never more than :data:`MAX_HISTORY_BYTES`)."""
    owners = max(1, min(owners, MAX_OWNERS))
    each = _ONE - _EMPTY + (owners - 1) * _PART + 1  # the comma between entries
    return min(MAX_HISTORY_BYTES, _EMPTY + (max(versions, 0) + 1) * each)


class Piece(_Model):
    key: Annotated[str, Field(min_length=1)]
    size: Annotated[int, Field(ge=1, le=PIECE_BYTES)]
    digest: Annotated[str, Field(pattern=_HEX32)]


class SnapshotFile(_Model):
    name: Annotated[str, Field(pattern=_FILE_NAME)]
    size: Annotated[int, Field(ge=0)]
    pieces: tuple[Piece, ...]

    @model_validator(mode="after")
    def _whole(self) -> SnapshotFile:
        if sum(p.size for p in self.pieces) != self.size:
            raise ValueError(f"the pieces of {self.name} do not add up to {self.size} bytes")
        return self


class _Index(_Model):
    """What every snapshot index's version shares: compact JSON, at most 64 MiB."""

    def pack(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> Self:
        return _parse(cls, data, where, MAX_INDEX_BYTES, "Snapshot index")


class SnapshotIndex(_Index):
    format: Literal["dcr-snapshot"] = "dcr-snapshot"
    format_version: Literal[1] = 1
    version: Annotated[int, Field(ge=0)]
    files: tuple[SnapshotFile, ...]
    tensors: dict[str, Annotated[str, Field(pattern=_FINGERPRINT)]]  # name -> fingerprint

    @model_validator(mode="after")
    def _distinct(self) -> SnapshotIndex:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError(f"a file is listed twice: {sorted(names)}")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class RankRegion(_Model):
    """One span of a canonical tensor that a rank holds, its elements next in the rank's
    stream in the span's row-major order (``dcr.format.regions``)."""

    tensor: Annotated[str, Field(min_length=1)]
    span: Span


class RankTensor(_Model):
    """A canonical tensor a rank holds part of: its dtype and shape, and the rank's part
    of its ``sum64`` (the sum over the elements the rank's regions hold)."""

    dtype: str
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    sum: Annotated[str, Field(pattern=SUM_PATTERN)]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class RankPart(_Model):
    """What one rank wrote of a snapshot: its regions' elements, in order, as one stream
    of ``size`` bytes in pieces."""

    rank: Annotated[int, Field(ge=0, lt=MAX_OWNERS)]
    size: Annotated[int, Field(ge=0)]
    pieces: tuple[Piece, ...]
    regions: tuple[RankRegion, ...]
    tensors: dict[str, RankTensor]

    @model_validator(mode="after")
    def _tiled(self) -> RankPart:
        if sum(p.size for p in self.pieces) != self.size:
            raise ValueError(f"the pieces of rank {self.rank} do not add up to {self.size} "
                             "bytes")
        for t in self.tensors.values():
            if t.dtype not in DTYPES:
                raise ValueError(f"rank {self.rank} names dtype {t.dtype!r}, none of "
                                 f"{sorted(DTYPES)}")
        held = 0
        for r in self.regions:
            if r.tensor not in self.tensors:
                raise ValueError(f"rank {self.rank} has a region of {r.tensor!r} but no "
                                 "entry for it")
            _, sizes, strides = r.span
            shape = self.tensors[r.tensor].shape
            count: int = math.prod(sizes)
            if len(sizes) != len(strides) or (count and extent(r.span)[1] >= math.prod(shape)):
                raise ValueError(f"rank {self.rank}'s region of {r.tensor!r} lies outside "
                                 f"its shape {list(shape)}")
            held += count * DTYPES[self.tensors[r.tensor].dtype].itemsize
        if held != self.size:  # no byte of the stream is unchecked, none missing
            raise ValueError(f"rank {self.rank}'s regions hold {held} bytes; its stream is "
                             f"{self.size}")
        return self


class RankSnapshotIndex(_Index):
    """A snapshot written from the ranks' memory (``format_version`` 2): one part per rank,
    each its regions of the canonical tensors, and every tensor's whole ``sum64``."""

    format: Literal["dcr-snapshot"] = "dcr-snapshot"
    format_version: Literal[2] = 2
    version: Annotated[int, Field(ge=0)]
    ranks: tuple[RankPart, ...]
    tensors: dict[str, Annotated[str, Field(pattern=SUM_PATTERN)]]  # name -> whole sum64

    @model_validator(mode="after")
    def _whole(self) -> RankSnapshotIndex:
        if [p.rank for p in self.ranks] != list(range(len(self.ranks))) or not self.ranks:
            raise ValueError(f"ranks must be 0..n-1 in order: {[p.rank for p in self.ranks]}")
        for name, (_, shape, held, summed) in self._layout().items():
            if name not in self.tensors or held != math.prod(shape):
                raise ValueError(f"the ranks hold {held} elements of {name!r} "
                                 f"{list(shape)}; every element exactly once is "
                                 f"{math.prod(shape)}")
            if sum_text(summed) != self.tensors[name]:
                raise ValueError(f"the ranks' parts of {name!r} add up to "
                                 f"{sum_text(summed)}, not {self.tensors[name]}")
        if unheld := sorted(set(self.tensors) - set(self._layout())):
            raise ValueError(f"no rank holds {unheld[:3]}")
        return self

    def _layout(self) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
        """name -> (dtype, shape, elements held, summed parts), the ranks agreeing."""
        out: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for part in self.ranks:
            held: dict[str, int] = {}
            for r in part.regions:
                held[r.tensor] = held.get(r.tensor, 0) + math.prod(r.span[1])
            for name, t in part.tensors.items():
                dtype, shape, n, s = out.get(name, (t.dtype, t.shape, 0, 0))
                if (dtype, shape) != (t.dtype, t.shape):
                    raise ValueError(f"ranks disagree on {name!r}: {dtype} {list(shape)} and "
                                     f"{t.dtype} {list(t.shape)} (rank {part.rank})")
                out[name] = (dtype, shape, n + held.get(name, 0), s + sum_value(t.sum))
        return out

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor's dtype and shape."""
        return {n: (d, s) for n, (d, s, _, _) in self._layout().items()}

    @property
    def total_bytes(self) -> int:
        return sum(p.size for p in self.ranks)


AnyIndex = SnapshotIndex | RankSnapshotIndex
INDEX_VERSIONS: dict[int, type[SnapshotIndex] | type[RankSnapshotIndex]] = {
    1: SnapshotIndex,  # a checkpoint directory's files (dcr snapshot)
    2: RankSnapshotIndex,  # the ranks' regions, from memory
}


def parse_index(data: bytes, where: str) -> AnyIndex:
    """A snapshot index of any format version this reader knows; one it does not know is
    refused naming its version and the ones read here."""
    if len(data) > MAX_INDEX_BYTES:
        raise ManifestError(f"Snapshot index {where} is {len(data)} bytes, over the limit of "
                            f"{MAX_INDEX_BYTES}.")
    try:
        head = json.loads(data)
        found = head.get("format_version") if isinstance(head, dict) else None
    except ValueError as e:
        raise ManifestError(f"Snapshot index {where} is not JSON: {e}.") from e
    version = SNAPSHOT_INDEX.check(f"Snapshot index {where}", found, ManifestError)
    return INDEX_VERSIONS[version].parse(data, where)


M = TypeVar("M", bound=BaseModel)


def _parse(cls: type[M], data: bytes, where: str, limit: int, what: str,
           wire: Wire | None = None) -> M:
    if len(data) > limit:
        raise ManifestError(f"{what} {where} is {len(data)} bytes, over the limit of {limit}.")
    try:
        return cls.model_validate_json(data, strict=True)
    except ValidationError as e:
        if wire is not None:
            wire.refuse_invalid(e, f"{what} {where}", ManifestError)
        raise ManifestError(f"{what} {where} is invalid: {first_validation_error(e)}.") from e


def history_digest_ok(data: bytes, digest: str | None, where: str) -> None:
    """Refuse a history object whose digest is not ``digest`` (when one is given)."""
    if digest is not None and object_digest(data) != digest:
        raise ManifestError(f"History {where}: digest {object_digest(data)} is not the "
                            f"{digest} the caller vouches for.")
