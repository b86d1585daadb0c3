"""The payload container, version 1: preamble, compressed JSON header, compressed streams.

``FORMAT.md`` documents every byte; this is the only code that reads or writes it. Reading
checks lengths, digest and limits before anything is decompressed or parsed, and each zstd
frame must decompress to exactly its declared size (``FORMAT.md``, "Validation order"); the
writer refuses to seal what the default limits would refuse to read.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Literal, get_args

import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dcr.errors import (
    DcrError,
    DigestMismatch,
    LimitExceeded,
    MalformedPayload,
    PayloadError,
    TruncatedPayload,
    first_validation_error,
)
from dcr.format.dtypes import DTYPES
from dcr.format.names import ATTEMPT_PATTERN, EntryKind, Mode
from dcr.versions import PAYLOAD

MAGIC = b"\x89DCR\r\n\x1a\n"
FORMAT_VERSION = PAYLOAD.writes
_PREAMBLE = struct.Struct("<8sHHIIQI")  # magic, version, flags, header packed/raw, body, reserved
DIGEST_SIZE = 16
DIGEST_PERSON = b"dcr-payload-v1"
PREAMBLE_SIZE = _PREAMBLE.size + DIGEST_SIZE  # 48

LocCoding = Literal["gaps", "runs"]
WIDTHS = (1, 2, 4, 8)

NAME_RE = re.compile(r"[^\x00-\x1f\x7f]{1,1024}")  # use fullmatch
# Bytes a record can cost beside its value: its location byte, up to 8 escape planes and
# up to 8 run-length planes (FORMAT.md, "Records").
_CODING_BYTES = 1 + 8 + 8


@dataclass(frozen=True, kw_only=True)
class DecodeLimits:
    """Upper bounds a reader enforces before it allocates anything.

    Defaults fit the largest real checkpoints (a 1T-parameter model's biggest tensor is
    well under 2**36 elements) and a 4 GiB bucket. ``max_items`` bounds what checking a
    header costs: about 30 us and 1.6 KiB of parsed models per item (measured), so 65536
    items take about 2 s and 110 MiB, against one item per 4 KiB of a default 256 MiB
    bucket. A receiver narrows the rest to its model with :meth:`for_tensors`.
    """

    max_header_bytes: int = 64 << 20  # decompressed JSON header
    max_items: int = 1 << 16
    max_stream_bytes: int = 8 << 30  # one decompressed stream
    max_total_bytes: int = 16 << 30  # all decompressed streams of one payload
    max_elements: int = 1 << 40  # elements in one canonical tensor
    max_ndim: int = 16

    @classmethod
    def for_tensors(cls, tensors: Iterable[tuple[str, tuple[int, ...]]],
                    base: DecodeLimits | None = None) -> DecodeLimits:
        """Limits that no honest payload for these ``(dtype, shape)`` tensors exceeds,
        never above ``base`` (the defaults).

        Items are disjoint ranges of these tensors, so a payload holds at most one record
        per element. Every stream has at most one byte per record, and ``loc.0`` spans
        every tensor the payload touches, so one stream is bounded by all the elements,
        not by the largest tensor; all streams together by each element's value bytes plus
        :data:`_CODING_BYTES` (an overwrite of a whole tensor needs more than its own
        bytes: a location byte per element beside the values).
        """
        base = DEFAULT_LIMITS if base is None else base
        sizes = [(math.prod(shape), DTYPES[dt].itemsize, len(shape)) for dt, shape in tensors]
        elements = sum(n for n, _, _ in sizes)
        return replace(
            base,
            max_elements=min(base.max_elements, max((n for n, _, _ in sizes), default=0)),
            max_ndim=min(base.max_ndim, max((d for _, _, d in sizes), default=0)),
            max_stream_bytes=min(base.max_stream_bytes, elements),
            max_total_bytes=min(base.max_total_bytes,
                                sum(n * (size + _CODING_BYTES) for n, size, _ in sizes)),
        )


DEFAULT_LIMITS = DecodeLimits()
# Most streams one payload can have: loc.0, 8 escape and 8 run-length planes, and a value
# plane per byte of each dtype for each entry kind. With the top-level object, a header
# holds at most ``items + MAX_STREAMS + 1`` JSON objects.
MAX_STREAMS = 1 + 8 + 8 + len(get_args(EntryKind)) * sum(d.itemsize for d in DTYPES.values())


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ItemHeader(_Frozen):
    """One owner's entries for one contiguous element range of one canonical tensor."""

    name: str
    dtype: str
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    start: Annotated[int, Field(ge=0)]
    stop: Annotated[int, Field(ge=1)]
    entry: EntryKind
    loc: LocCoding
    count: Annotated[int, Field(ge=1)]
    runs: Annotated[int, Field(ge=0)]
    escapes: Annotated[int, Field(ge=0)]
    loc_width: Literal[0, 1, 2, 4, 8]
    len_width: Literal[0, 1, 2, 4, 8]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def location_values(self) -> int:
        """How many location values (gaps or run gaps) this item codes."""
        return self.count if self.loc == "gaps" else self.runs

    def stream_sizes(self) -> list[tuple[str, int]]:
        """The bytes this item puts into each stream, in body order."""
        sizes = [("loc.0", self.location_values)]
        sizes += [(f"esc.{k}", self.escapes) for k in range(self.loc_width)]
        sizes += [(f"len.{k}", self.runs) for k in range(self.len_width)]
        itemsize = DTYPES[self.dtype].itemsize
        sizes += [(f"val.{self.entry}.{self.dtype}.{k}", self.count) for k in range(itemsize)]
        return sizes

    @property
    def where(self) -> str:
        return f"{self.name}[{self.start}:{self.stop}]"

    @model_validator(mode="after")
    def _consistent(self) -> ItemHeader:
        if not NAME_RE.fullmatch(self.name):
            raise ValueError(f"tensor name {self.name!r} is empty, too long or has control bytes")
        if self.dtype not in DTYPES:
            raise ValueError(f"item {self.name!r}: unknown dtype {self.dtype!r}")
        if not self.start < self.stop <= self.numel:
            raise ValueError(
                f"item {self.name!r}: range [{self.start}, {self.stop}) is not inside "
                f"a tensor of {self.numel} elements"
            )
        if self.count > self.stop - self.start:
            raise ValueError(
                f"item {self.where}: {self.count} records in a range of "
                f"{self.stop - self.start} elements"
            )
        if self.escapes > self.location_values or (self.escapes == 0) != (self.loc_width == 0):
            raise ValueError(
                f"item {self.where}: {self.escapes} escapes with loc_width {self.loc_width} "
                f"for {self.location_values} location values"
            )
        if self.loc == "gaps" and (self.runs != 0 or self.len_width != 0):
            raise ValueError(f"item {self.where}: gap coding takes runs=0 and len_width=0")
        if self.loc == "runs" and not (1 <= self.runs <= self.count and self.len_width != 0):
            raise ValueError(
                f"item {self.where}: run coding needs 1 <= runs ({self.runs}) <= count "
                f"({self.count}) and a nonzero len_width"
            )
        return self


class StreamHeader(_Frozen):
    """One zstd frame of the body: its stream id, raw size and compressed size."""

    id: str
    raw: Annotated[int, Field(ge=1)]
    packed: Annotated[int, Field(ge=1)]


class PayloadHeader(_Frozen):
    """The decompressed JSON header of a payload."""

    base_version: Annotated[int, Field(ge=0)]
    target_version: Annotated[int, Field(ge=0)]
    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)]
    owner: Annotated[int, Field(ge=0, le=2**31 - 1)]
    seq: Annotated[int, Field(ge=0, le=2**31 - 1)]
    mode: Mode
    items: tuple[ItemHeader, ...]
    streams: tuple[StreamHeader, ...]

    @property
    def label(self) -> str:
        return f"payload {self.attempt}/o{self.owner}/s{self.seq}"

    @model_validator(mode="after")
    def _consistent(self) -> PayloadHeader:
        if self.base_version == self.target_version:
            raise ValueError(f"base and target version are both {self.base_version}")
        if self.mode == "overwrite":
            bad = [i.where for i in self.items if i.entry != "overwrite"]
            if bad:
                raise ValueError(f"mode is overwrite but items {bad[:3]} carry XOR entries")
        check_disjoint(self.items)
        expected = expected_streams(self.items)
        declared = [(s.id, s.raw) for s in self.streams]
        if declared != expected:
            raise ValueError(f"streams {declared} differ from what the items imply: {expected}")
        return self


def check_disjoint(items: Iterable[ItemHeader]) -> None:
    """Raise if two items cover the same element or disagree on a tensor's dtype or shape.

    Overlapping XOR items would apply a mask twice, which restores the old bits.
    """
    ordered = sorted(items, key=lambda i: (i.name, i.start))
    for prev, cur in itertools.pairwise(ordered):
        if prev.name != cur.name:
            continue
        if (prev.dtype, prev.shape) != (cur.dtype, cur.shape):
            raise ValueError(
                f"tensor {cur.name!r} is {prev.dtype}{list(prev.shape)} in one item "
                f"and {cur.dtype}{list(cur.shape)} in another"
            )
        if cur.start < prev.stop:
            raise ValueError(f"items {prev.where} and {cur.where} overlap")


def stream_ids(items: Iterable[ItemHeader]) -> list[str]:
    return [sid for sid, _ in expected_streams(items)]


def expected_streams(items: Iterable[ItemHeader]) -> list[tuple[str, int]]:
    """The streams, in body order, and their raw sizes, as the items imply them.

    ``loc.0``: one byte per location value, the value itself or 255 for an escape.
    ``esc.K``: byte K of (value - 255) of every escaped location value, ``K < loc_width``.
    ``len.K``: byte K of every (run length - 1) of run-coded items with ``len_width > K``.
    ``val.ENTRY.DTYPE.K``: byte K of every value of items with that entry kind and dtype.
    Items contribute in header order; empty streams are omitted.
    """
    sizes: dict[str, int] = {}
    for it in items:
        for sid, n in it.stream_sizes():
            sizes[sid] = sizes.get(sid, 0) + n
    return sorted(((s, n) for s, n in sizes.items() if n), key=lambda s: _stream_order(s[0]))


def _stream_order(sid: str) -> tuple[int, str, int]:
    family, _, rest = sid.partition(".")
    rank = {"loc": 0, "esc": 1, "len": 2, "val": 3}[family]
    head, _, plane = rest.rpartition(".")
    return rank, head, int(plane)


# --- writing -------------------------------------------------------------------------


def pack_payload(
    *,
    base_version: int,
    target_version: int,
    attempt: str,
    owner: int,
    seq: int,
    mode: Mode,
    items: tuple[ItemHeader, ...],
    streams: Mapping[str, bytes],
    level: int = 1,
) -> bytes:
    """Compress the streams and the header and assemble a digest-sealed payload."""
    ids = stream_ids(items)
    if sorted(ids) != sorted(streams):
        raise MalformedPayload(f"streams given {sorted(streams)} but items imply {sorted(ids)}")
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    frames = [compressor.compress(streams[sid]) for sid in ids]
    header = PayloadHeader(
        base_version=base_version,
        target_version=target_version,
        attempt=attempt,
        owner=owner,
        seq=seq,
        mode=mode,
        items=items,
        streams=tuple(
            StreamHeader(id=sid, raw=len(streams[sid]), packed=len(f))
            for sid, f in zip(ids, frames, strict=True)
        ),
    )
    raw_header = header.model_dump_json().encode()
    check_limits(header, DEFAULT_LIMITS)  # never seal what a reader would refuse
    _check_counts(header.label, raw_header, DEFAULT_LIMITS)
    packed_header = compressor.compress(raw_header)
    body_len = sum(len(f) for f in frames)
    pre = _PREAMBLE.pack(
        MAGIC, FORMAT_VERSION, 0, len(packed_header), len(raw_header), body_len, 0
    )
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=DIGEST_PERSON)
    for part in (pre, packed_header, *frames):
        h.update(part)
    return b"".join((pre, h.digest(), packed_header, *frames))


# --- reading -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Payload:
    """A payload whose digest and header have been verified; streams not yet decoded.

    Made only by :func:`read_payload`. Receivers keep this object from the moment it
    is verified until it is applied, so a payload is parsed once on its way in.
    """

    header: PayloadHeader
    data: memoryview
    body_offset: int

    @property
    def size(self) -> int:
        """Bytes of the whole object, as a manifest lists them."""
        return len(self.data)

    @property
    def digest(self) -> bytes:
        """The payload's own personalised digest (bytes 32-47), already checked.

        It identifies the payload's bytes: two payloads with one id and different
        digests are a conflict. Not the object digest a manifest lists (that one is
        :func:`dcr.format.names.object_digest` of :attr:`data`).
        """
        return bytes(self.data[_PREAMBLE.size : PREAMBLE_SIZE])


def read_payload(data: bytes | memoryview, limits: DecodeLimits = DEFAULT_LIMITS) -> Payload:
    """Check framing and digest, then parse and validate the header. Decompresses only it."""
    buf = memoryview(data).cast("B")
    if len(buf) < PREAMBLE_SIZE:
        raise TruncatedPayload(
            f"Payload of {len(buf)} bytes is shorter than the {PREAMBLE_SIZE}-byte preamble."
        )
    magic, version, flags, h_packed, h_raw, body_len, reserved = _PREAMBLE.unpack_from(buf)
    if magic != MAGIC:
        raise MalformedPayload(f"Not a DCR payload: magic is {bytes(magic)!r}, want {MAGIC!r}.")
    PAYLOAD.check("A payload", version, MalformedPayload)
    if flags != 0 or reserved != 0:
        raise MalformedPayload(f"Reserved preamble fields are nonzero (flags={flags}, "
                               f"reserved={reserved}).")
    expected_len = PREAMBLE_SIZE + h_packed + body_len
    if len(buf) != expected_len:
        raise TruncatedPayload(
            f"Payload is {len(buf)} bytes but its preamble declares {expected_len} "
            f"(48 + header {h_packed} + body {body_len})."
        )
    want = bytes(buf[_PREAMBLE.size : PREAMBLE_SIZE])
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=DIGEST_PERSON)
    h.update(buf[: _PREAMBLE.size])
    h.update(buf[PREAMBLE_SIZE:])
    got = h.digest()
    if got != want:
        raise DigestMismatch(
            f"Payload digest mismatch (expected {want.hex()}, got {got.hex()}): "
            "the bytes were corrupted or truncated in transit or storage."
        )
    if h_raw > limits.max_header_bytes:
        raise LimitExceeded(
            f"Payload header declares {h_raw} bytes, over the limit of {limits.max_header_bytes}."
        )
    raw = _decompress_exact(buf[PREAMBLE_SIZE : PREAMBLE_SIZE + h_packed], h_raw, "header")
    _check_counts("Payload header", raw, limits)
    try:
        # Strict JSON mode: UTF-8 only, integers must be JSON integers, no coercion.
        header = PayloadHeader.model_validate_json(raw, strict=True)
    except ValidationError as e:
        what = "not valid JSON" if e.errors()[0]["type"] == "json_invalid" else "invalid"
        raise MalformedPayload(f"Payload header is {what}: {first_validation_error(e)}") from e
    check_limits(header, limits)
    packed = sum(s.packed for s in header.streams)
    if packed != body_len:
        raise MalformedPayload(
            f"{header.label}: streams declare {packed} compressed bytes but the body has "
            f"{body_len}."
        )
    return Payload(header=header, data=buf, body_offset=PREAMBLE_SIZE + h_packed)


def decode_streams(payload: Payload) -> dict[str, memoryview]:
    """Decompress every stream of a verified payload, each to exactly its declared size."""
    out: dict[str, memoryview] = {}
    offset = payload.body_offset
    for s in payload.header.streams:
        frame = payload.data[offset : offset + s.packed]
        out[s.id] = memoryview(_decompress_exact(frame, s.raw, f"stream {s.id!r}"))
        offset += s.packed
    return out


def _check_counts(what: str, raw: bytes, limits: DecodeLimits) -> None:
    """Refuse a header with too many items before it is parsed into models.

    Every item and stream is a JSON object, so ``{`` bytes (strings may hold more) bound
    the items from above; counting them costs a scan of the bytes, where parsing costs
    about 30 us and 1.6 KiB per item.
    """
    if len(raw) > limits.max_header_bytes:
        raise LimitExceeded(
            f"{what} is {len(raw)} bytes, over the limit of {limits.max_header_bytes}."
        )
    objects = raw.count(b"{")
    if objects > limits.max_items + MAX_STREAMS + 1:
        raise LimitExceeded(
            f"{what} holds {objects} JSON objects: more items than the limit of "
            f"{limits.max_items} (refused before parsing)."
        )


def check_limits(header: PayloadHeader, limits: DecodeLimits) -> None:
    """Raise :class:`LimitExceeded` if a parsed header declares more than ``limits`` allow:
    items, a tensor's elements or dimensions, one stream's or all streams' raw bytes."""
    if len(header.items) > limits.max_items:
        raise LimitExceeded(
            f"{header.label}: header lists {len(header.items)} items, over the limit of "
            f"{limits.max_items}."
        )
    for it in header.items:
        if it.numel > limits.max_elements or len(it.shape) > limits.max_ndim:
            raise LimitExceeded(
                f"{header.label}: tensor {it.name!r} of shape {list(it.shape)} is over the "
                f"limits ({limits.max_elements} elements, {limits.max_ndim} dims)."
            )
    total = 0
    for s in header.streams:
        if s.raw > limits.max_stream_bytes:
            raise LimitExceeded(
                f"{header.label}: stream {s.id!r} declares {s.raw} bytes, over the limit "
                f"of {limits.max_stream_bytes}."
            )
        total += s.raw
    if total > limits.max_total_bytes:
        raise LimitExceeded(
            f"{header.label}: streams declare {total} bytes in all, over the limit of "
            f"{limits.max_total_bytes}."
        )


def decompress_exact(frame: memoryview, size: int, *, subject: str, sized_by: str,
                     error: type[DcrError]) -> bytes:
    """Decompress one zstd frame that must hold exactly ``size`` bytes and nothing after.

    A payload's header and streams and a manifest's document are such frames; ``error``
    (``subject`` "The header", ``sized_by`` "header") names the part in its messages.
    """
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise error(f"{subject} is not a zstd frame: {e}.") from e
    if declared != size:
        raise error(f"{subject} frame declares {declared} bytes but the {sized_by} says {size}.")
    try:
        out = zstandard.ZstdDecompressor().decompress(
            frame, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise error(f"{subject} does not decompress: {e}.") from e
    if len(out) != size:
        raise error(f"{subject} decompressed to {len(out)} bytes, not {size}.")
    return out


def _decompress_exact(frame: memoryview, size: int, what: str) -> bytes:
    return decompress_exact(frame, size, subject=f"The {what}", sized_by="header",
                            error=MalformedPayload)


__all__ = [
    "DEFAULT_LIMITS",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_STREAMS",
    "DecodeLimits",
    "EntryKind",
    "ItemHeader",
    "LocCoding",
    "Mode",
    "Payload",
    "PayloadError",
    "PayloadHeader",
    "StreamHeader",
    "check_disjoint",
    "check_limits",
    "decode_streams",
    "expected_streams",
    "pack_payload",
    "read_payload",
    "stream_ids",
]
