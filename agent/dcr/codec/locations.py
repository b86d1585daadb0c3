"""Location coding: where in an item's element range the records sit.

``gaps`` for scattered changes, ``runs`` for clustered ones (a whole-tensor overwrite is one
run), chosen per item by which is smaller (agent/dcr/format/FORMAT.md, "Records").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dcr.codec.changes import Positions
from dcr.codec.planes import ESCAPE, U8, UInt, uint_dtype, width_for
from dcr.errors import MalformedPayload
from dcr.format.payload import LocCoding

RUNS_MIN_MEAN_LENGTH = 4  # runs win once a run averages this many records


@dataclass(frozen=True, kw_only=True)
class Locations:
    """Coded positions of one item."""

    loc: LocCoding
    count: int
    loc_values: UInt
    len_values: UInt | None

    @property
    def runs(self) -> int:
        return 0 if self.len_values is None else len(self.len_values)

    @property
    def len_width(self) -> int:
        return 0 if self.len_values is None else self.len_values.dtype.itemsize


def encode(positions: Positions) -> Locations:
    """Code ascending, distinct positions (relative to the item start)."""
    count = len(positions)
    if count == 0:
        raise ValueError("an item needs at least one record")
    steps = np.diff(positions, prepend=-1)  # gap + 1
    nruns = 1 + int(np.count_nonzero(steps[1:] != 1))
    if count >= RUNS_MIN_MEAN_LENGTH * nruns:
        breaks = np.flatnonzero(steps[1:] != 1) + 1
        starts = positions[np.concatenate(([0], breaks))]
        ends = positions[np.concatenate((breaks - 1, [count - 1]))] + 1
        prev_end = np.concatenate(([0], ends[:-1]))
        return Locations(
            loc="runs",
            count=count,
            loc_values=_narrow(starts - prev_end),
            len_values=_narrow(ends - starts - 1),
        )
    steps -= 1
    return Locations(loc="gaps", count=count, loc_values=_narrow(steps), len_values=None)


def _narrow(values: Positions) -> UInt:
    width = width_for(int(values.max()))
    return values.astype(uint_dtype(width))


def validate(where: str, locs: Locations, span: int) -> None:
    """Check that every position falls inside ``[0, span)`` without materialising them."""
    _check_reach(where, locs.count, _bounded_sum(where, locs.loc_values, span),
                 locs.len_values, span)


def validate_escaped(where: str, *, count: int, small: U8, escaped: UInt | None,
                     len_values: UInt | None, span: int) -> None:
    """:func:`validate` for location values still escape-coded (``loc.0`` bytes, 255
    marking a value whose excess over 255 is in ``escaped``), without joining them: an
    escaped value is at least 255, above every plain byte, so the largest value is the
    largest escape plus 255 when there are escapes; and the sum of the values is the sum
    of the bytes (255 for each escape) plus the sum of the escapes. The caller has
    checked every escape against ``span`` and their count against the 255 bytes."""
    escapes = escaped if escaped is not None and escaped.size else None
    top = (int(escapes.max()) + ESCAPE if escapes is not None
           else int(small.max()) if small.size else 0)
    if top > span:
        raise MalformedPayload(
            f"Item {where}: location value {top} exceeds the item's {span} elements."
        )
    total = int(small.sum(dtype=np.uint64))  # at most 255 per record: no overflow
    if escapes is not None:
        total += _bounded_sum(where, escapes, span)
    _check_reach(where, count, total, len_values, span)


def _check_reach(where: str, count: int, reach: int, len_values: UInt | None,
                 span: int) -> None:
    """The last position (``reach - 1``, from the location values' sum and the records)
    lies inside the item; for runs, the lengths add up to the records."""
    if len_values is None:
        reach += count
    else:
        lengths = _bounded_sum(where, len_values, span) + len(len_values)
        if lengths != count:
            raise MalformedPayload(
                f"Item {where}: run lengths add up to {lengths} records, header says {count}."
            )
        reach += lengths
    if reach > span:
        raise MalformedPayload(
            f"Item {where}: locations reach element {reach - 1}, past the item's "
            f"{span} elements."
        )


def _bounded_sum(where: str, values: UInt, span: int) -> int:
    """Sum exactly, after checking each value is at most ``span`` (so no overflow)."""
    if len(values) == 0:
        return 0
    top = int(values.max())
    if top > span:
        raise MalformedPayload(
            f"Item {where}: location value {top} exceeds the item's {span} elements."
        )
    step = 1 << 20  # 2**20 values of at most 2**40 each cannot overflow uint64
    return sum(int(values[i : i + step].sum(dtype=np.uint64)) for i in range(0, len(values), step))


def iter_positions(locs: Locations, *, block: int) -> Iterator[tuple[int, Positions]]:
    """Yield ``(first_record, positions)`` in blocks of at most ``block`` records.

    Call :func:`validate` first; this assumes positions lie in range.
    """
    if locs.len_values is None:
        carry = -1
        for lo in range(0, locs.count, block):
            steps = locs.loc_values[lo : lo + block].astype(np.int64) + 1
            pos = np.cumsum(steps)
            pos += carry
            carry = int(pos[-1])
            yield lo, pos
        return
    gaps = locs.loc_values.astype(np.int64)
    lengths = locs.len_values.astype(np.int64) + 1
    ends = np.cumsum(gaps + lengths)
    starts = ends - lengths
    first_record = np.cumsum(lengths) - lengths  # record index where each run begins
    for lo in range(0, locs.count, block):
        rec = np.arange(lo, min(locs.count, lo + block), dtype=np.int64)
        run = np.searchsorted(first_record, rec, side="right") - 1
        yield lo, starts[run] + (rec - first_record[run])
