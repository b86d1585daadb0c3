"""Decoding and in-place apply to tensors held in canonical layout.

``decode`` checks every record; ``apply_items`` checks every item against the targets before
it writes an element, so a payload that fails a check leaves them untouched. XOR entries must
be applied exactly once; overwrites are idempotent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dcr.codec import _native, locations  # type: ignore[attr-defined]
from dcr.codec.locations import Locations
from dcr.codec.planes import ESCAPE, U8, UInt, escape_join, join, width_for
from dcr.errors import MalformedPayload, TargetMismatch
from dcr.format.dtypes import DTYPES
from dcr.format.payload import ItemHeader, Payload, check_disjoint, decode_streams

APPLY_BLOCK = 1 << 22  # records per scatter; bounds temporaries to ~64 MiB


@dataclass(frozen=True, kw_only=True)
class DecodedItem:
    """One item's records, still location-coded: ``small`` is ``loc.0`` (one byte per
    location value, 255 escaping to ``escaped``, which holds the value minus 255),
    ``len_values`` the run lengths minus one of a ``runs`` item, ``values`` the bits."""

    header: ItemHeader
    small: U8
    escaped: UInt | None
    len_values: UInt | None
    values: UInt

    @property
    def locations(self) -> Locations:
        """The location values joined (one array, 8 bytes each): for :meth:`blocks`."""
        return Locations(loc=self.header.loc, count=self.header.count,
                         loc_values=escape_join(self.small, self.escaped),
                         len_values=self.len_values)

    def positions(self, out: npt.NDArray[np.int64]) -> None:
        """Write the item's flat tensor indices (ascending) to ``out``, one per record, in
        one pass of the native kernel, without joining the escapes first."""
        esc = self.escaped if self.escaped is not None else _EMPTY
        lens = self.len_values if self.len_values is not None else _EMPTY
        h = self.header
        _native.positions(self.small, esc, esc.itemsize, lens, lens.itemsize, h.start,
                          h.stop - h.start, out)

    def blocks(self, block: int = APPLY_BLOCK) -> Iterator[tuple[npt.NDArray[np.int64], UInt]]:
        """Yield (flat tensor indices, values) in blocks of at most ``block`` records."""
        for lo, pos in locations.iter_positions(self.locations, block=block):
            pos += self.header.start
            yield pos, self.values[lo : lo + len(pos)]


_EMPTY: U8 = np.zeros(0, dtype=np.uint8)


@dataclass(frozen=True, kw_only=True)
class Target:
    """A tensor in canonical layout, seen as raw bits (``DType.bits``), to patch in place."""

    dtype: str
    shape: tuple[int, ...]
    bits: UInt


def decode(payload: Payload) -> list[DecodedItem]:
    """Split a verified payload's streams into items and validate every record."""
    header = payload.header
    streams = {
        sid: np.frombuffer(buf, dtype=np.uint8) for sid, buf in decode_streams(payload).items()
    }
    cursor = dict.fromkeys(streams, 0)

    def take(sid: str, n: int) -> U8:
        lo = cursor[sid]
        cursor[sid] = lo + n
        return streams[sid][lo : lo + n]

    def planes(parts: dict[str, U8], family: str, width: int) -> UInt:
        return join([parts[f"{family}.{k}"] for k in range(width)], width)

    items: list[DecodedItem] = []
    for it in header.items:
        where = f"{it.where} of {header.label}"
        span = it.stop - it.start
        parts = {sid: take(sid, n) for sid, n in it.stream_sizes()}
        small = parts["loc.0"]
        marked = int(np.count_nonzero(small == ESCAPE))
        if marked != it.escapes:
            raise MalformedPayload(
                f"Item {where}: loc.0 holds {marked} escape bytes (255), header says "
                f"{it.escapes}."
            )
        escaped = planes(parts, "esc", it.loc_width) if it.escapes else None
        if escaped is not None:
            top = int(escaped.max())
            if top > span:
                raise MalformedPayload(
                    f"Item {where}: escaped location value {top + ESCAPE} ({top} + {ESCAPE}) "
                    f"exceeds the item's {span} elements."
                )
            _check_width(where, "loc_width", it.loc_width, top)
        len_values = planes(parts, "len", it.len_width) if it.loc == "runs" else None
        if len_values is not None:
            _check_width(where, "len_width", it.len_width, int(len_values.max()))
        size = DTYPES[it.dtype].itemsize
        values = planes(parts, f"val.{it.entry}.{it.dtype}", size)
        locations.validate_escaped(where, count=it.count, small=small, escaped=escaped,
                                   len_values=len_values, span=span)
        if it.entry == "xor":
            zeros = it.count - int(np.count_nonzero(values))
            if zeros:
                raise MalformedPayload(f"Item {where}: {zeros} XOR masks are zero.")
        items.append(DecodedItem(header=it, small=small, escaped=escaped,
                                 len_values=len_values, values=values))
    return items


def _check_width(where: str, field: str, width: int, top: int) -> None:
    """One payload has one byte form: widths must be the narrowest that fit."""
    if width != width_for(top):
        raise MalformedPayload(
            f"Item {where}: {field} is {width} but its largest value {top} needs "
            f"{width_for(top)} (widths must be the narrowest that fit)."
        )


def check_targets(items: Iterable[DecodedItem], targets: Mapping[str, Target]) -> None:
    """Raise :class:`TargetMismatch` unless every item fits its target tensor."""
    for item in items:
        h = item.header
        t = targets.get(h.name)
        if t is None:
            raise TargetMismatch(f"Item {h.where}: the target has no tensor named {h.name!r}.")
        if (t.dtype, tuple(t.shape)) != (h.dtype, h.shape):
            raise TargetMismatch(
                f"Item {h.where}: payload says {h.dtype}{list(h.shape)}, target tensor is "
                f"{t.dtype}{list(t.shape)}."
            )
        want = DTYPES[h.dtype].bits
        if t.bits.dtype != want or t.bits.size != h.numel:
            raise TargetMismatch(
                f"Item {h.where}: target storage is {t.bits.dtype}[{t.bits.size}], "
                f"expected {want}[{h.numel}]."
            )
        if not (t.bits.flags.writeable and t.bits.flags.c_contiguous):
            raise TargetMismatch(
                f"Item {h.where}: target tensor {h.name!r} is read-only or not contiguous."
            )


def check_apply(items: list[DecodedItem], targets: Mapping[str, Target]) -> None:
    """What :func:`apply_items` checks before its first write: the items are disjoint
    and each fits its target."""
    try:
        check_disjoint(i.header for i in items)
    except ValueError as e:
        raise MalformedPayload(f"Items to apply conflict: {e}.") from e
    check_targets(items, targets)


def apply_items(
    items: list[DecodedItem], targets: Mapping[str, Target], *, threads: int = 1
) -> int:
    """Validate everything, then apply every record in place. Returns records applied.

    With ``threads > 1`` items are applied concurrently (numpy releases the GIL while it
    scatters); items never overlap, so the result does not depend on the order.
    """
    check_apply(items, targets)

    def apply_one(item: DecodedItem) -> int:
        flat = targets[item.header.name].bits.reshape(-1)
        xor = item.header.entry == "xor"
        n = 0
        for pos, vals in item.blocks():
            _native.scatter(flat, flat.itemsize, pos, np.ascontiguousarray(vals), xor)
            n += len(pos)
        return n

    if threads <= 1 or len(items) < 2:
        return sum(map(apply_one, items))
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(apply_one, items))
