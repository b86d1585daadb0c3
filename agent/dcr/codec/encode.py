"""Encoding: records of changed elements -> items -> a sealed payload.

A :class:`PayloadBuilder` puts every item's locations and values into shared byte-plane
streams, so hundreds of small tensors cost one set of zstd frames, not one each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcr.codec import locations
from dcr.codec.changes import DEFAULT_CHUNK, Positions, find_changes
from dcr.codec.planes import U8, UInt, escape_split, split
from dcr.format.dtypes import DType
from dcr.format.payload import EntryKind, ItemHeader, Mode, pack_payload, stream_ids


@dataclass(frozen=True, kw_only=True)
class ItemDelta:
    """The records of one item: positions relative to ``start`` and their entry values."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    stop: int
    entry: EntryKind
    positions: Positions
    values: UInt  # XOR masks (old ^ new) or new bits, in ``dtype.bits``


def diff_range(
    *,
    name: str,
    dtype: DType,
    shape: tuple[int, ...],
    start: int,
    base: UInt,
    target: UInt,
    entry: EntryKind,
    chunk: int = DEFAULT_CHUNK,
) -> ItemDelta | None:
    """Compare one element range of a tensor; ``None`` when nothing changed."""
    ch = find_changes(base, target, chunk=chunk)
    if ch.positions.size == 0:
        return None
    values = np.bitwise_xor(ch.old, ch.new, out=ch.old) if entry == "xor" else ch.new
    return ItemDelta(
        name=name,
        dtype=dtype,
        shape=shape,
        start=start,
        stop=start + base.size,
        entry=entry,
        positions=ch.positions,
        values=values,
    )


def whole_range(
    *, name: str, dtype: DType, shape: tuple[int, ...], start: int, target: UInt
) -> ItemDelta:
    """Every element of a range as an overwrite: for paths where one change moves all bits."""
    return ItemDelta(
        name=name,
        dtype=dtype,
        shape=shape,
        start=start,
        stop=start + target.size,
        entry="overwrite",
        positions=np.arange(target.size, dtype=np.int64),
        values=np.array(target, copy=True),
    )


@dataclass(frozen=True, kw_only=True)
class EncodedItem:
    header: ItemHeader
    planes: dict[str, U8]  # stream id -> this item's bytes of that stream


def encode_item(delta: ItemDelta) -> EncodedItem:
    locs = locations.encode(delta.positions)
    small, escaped = escape_split(locs.loc_values)
    esc_width = 0 if escaped is None else escaped.dtype.itemsize
    header = ItemHeader(
        name=delta.name,
        dtype=delta.dtype.name,
        shape=delta.shape,
        start=delta.start,
        stop=delta.stop,
        entry=delta.entry,
        loc=locs.loc,
        count=locs.count,
        runs=locs.runs,
        escapes=0 if escaped is None else len(escaped),
        loc_width=esc_width,  # type: ignore[arg-type]
        len_width=locs.len_width,  # type: ignore[arg-type]
    )
    planes: dict[str, U8] = {"loc.0": small}
    if escaped is not None:
        for k, p in enumerate(split(escaped, esc_width)):
            planes[f"esc.{k}"] = p
    if locs.len_values is not None:
        for k, p in enumerate(split(locs.len_values, locs.len_width)):
            planes[f"len.{k}"] = p
    for k, p in enumerate(split(delta.values, delta.dtype.itemsize)):
        planes[f"val.{delta.entry}.{delta.dtype.name}.{k}"] = p
    return EncodedItem(header=header, planes=planes)


@dataclass(kw_only=True)
class PayloadBuilder:
    """Collects encoded items for one payload and seals them."""

    base_version: int
    target_version: int
    attempt: str
    owner: int
    seq: int
    mode: Mode
    level: int = 1
    items: list[EncodedItem] = field(default_factory=list)
    dense_bytes: int = 0

    def add(self, item: EncodedItem, *, dense_bytes: int) -> None:
        if self.mode == "overwrite" and item.header.entry != "overwrite":
            raise ValueError(f"item {item.header.where} carries XOR entries in overwrite mode")
        self.items.append(item)
        self.dense_bytes += dense_bytes

    @property
    def records(self) -> int:
        return sum(i.header.count for i in self.items)

    def seal(self) -> bytes:
        headers = tuple(i.header for i in self.items)
        streams: dict[str, bytes] = {}
        for sid in stream_ids(headers):
            parts = [i.planes[sid] for i in self.items if sid in i.planes]
            streams[sid] = np.concatenate(parts).tobytes()
        return pack_payload(
            base_version=self.base_version,
            target_version=self.target_version,
            attempt=self.attempt,
            owner=self.owner,
            seq=self.seq,
            mode=self.mode,
            items=headers,
            streams=streams,
            level=self.level,
        )
