"""Records expanded where the weights live: location coding to positions with torch.

The host verifies, decompresses and validates every payload (``codec/decode.py``); what
reaches the device is each item's location coding as the payload carries it (``loc.0``
bytes, the rare escapes, run lengths) and its values, about 3 bytes a BF16 record. The
device joins the escapes, takes the prefix sums of the gaps or expands the runs, and the
applier scatters from there: no per-record work on the host and no 64-bit positions built
there. The same torch operations run on the CPU, where the tests check them bit for bit
against the codec's C kernel (``docs/apply.md``, "Expanding records on the device").

On CUDA one pinned host buffer (kept between applies) holds a set's compact arrays; one
copy per tensor runs on its own stream, so the copy of a later tensor overlaps the loader
call and the scatters of earlier ones. Nothing here synchronizes; the applier does, once
per set.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.codec.decode import DecodedItem, Target, check_apply
from dcr.codec.planes import ESCAPE

ALIGN = 16  # bytes: every array starts where a view of any element width may begin

_SIGNED: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                   8: torch.int64}


@dataclass(frozen=True, kw_only=True)
class CompactItem:
    """One item's location coding on the device, as the payload carries it."""

    start: int
    count: int
    runs: bool
    small: torch.Tensor  # uint8, ``loc.0``: one byte per location value, 255 escapes
    marks: torch.Tensor | None  # int64: where ``small`` holds 255, None without escapes
    escaped: torch.Tensor | None  # the escaped values minus 255, a signed view of its width
    lengths: torch.Tensor | None  # run lengths minus one, a signed view of its width


@dataclass(kw_only=True)
class CompactRecords:
    """One tensor's records on the device, still location-coded; its items ascend."""

    items: list[CompactItem]
    values: torch.Tensor  # every item's bits, concatenated: a signed view of the width
    ready: torch.cuda.Event | None = None  # the copy that brings them, on CUDA

    @property
    def count(self) -> int:
        return sum(i.count for i in self.items)

    def wait(self) -> None:
        """Make the current stream wait for the copy that brings these records."""
        if self.ready is not None:
            torch.cuda.current_stream(self.values.device).wait_event(self.ready)

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Ascending flat positions (int64) and their values, on the device."""
        self.wait()
        parts = [expand_item(i) for i in self.items]
        positions = parts[0] if len(parts) == 1 else torch.cat(parts)
        return positions, self.values


def _unsigned(t: torch.Tensor) -> torch.Tensor:
    """A signed view of unsigned values, widened to int64 with its sign bits cleared."""
    wide = t.to(torch.int64)
    width = t.element_size()
    return wide if width >= 8 or t.dtype == torch.uint8 else wide & ((1 << (8 * width)) - 1)


def expand_item(item: CompactItem) -> torch.Tensor:
    """An item's flat tensor positions, ascending, from its location coding; validated
    items only (``decode`` checked every escape, gap and run against the item's range)."""
    if item.marks is None and not item.runs:  # every gap under 255: its step fits the byte
        return torch.cumsum(item.small + 1, 0, dtype=torch.int64).add_(item.start - 1)
    values = item.small.to(torch.int64)
    if item.marks is not None:
        assert item.escaped is not None
        values.index_put_((item.marks,), _unsigned(item.escaped) + ESCAPE)
    if not item.runs:  # each value is the gap before its record
        values.add_(1)
        values[0] += item.start - 1
        return torch.cumsum(values, 0)
    assert item.lengths is not None
    lengths = _unsigned(item.lengths) + 1
    ends = torch.cumsum(values + lengths, 0)
    firsts = torch.cumsum(lengths, 0) - lengths  # the record each run begins with
    shifts = ends - lengths - firsts + item.start  # position minus record index, per run
    rec = torch.arange(item.count, dtype=torch.int64, device=values.device)
    return torch.repeat_interleave(shifts, lengths, output_size=item.count) + rec


def _marks(item: DecodedItem) -> npt.NDArray[np.int64] | None:
    """Where ``loc.0`` holds the escape byte: found on the host in the byte pass the
    decoder's escape count makes anyway, so the device needs no search and no sync."""
    return np.flatnonzero(item.small == ESCAPE) if item.escaped is not None else None


def _arrays(item: DecodedItem) -> list[npt.NDArray[Any]]:
    return [a for a in (item.small, _marks(item), item.escaped, item.len_values)
            if a is not None]


class Uploader:
    """Brings decoded records to the device a tensor at a time (see the module doc).

    ``pack`` (the default on CUDA) packs each tensor's arrays into the kept host buffer
    (pinned on CUDA) and copies them as one block; without it, on the CPU, the decoded
    arrays are used in place. On the CPU ``pack=True`` runs the same packing with
    synchronous copies: how the tests check its layout."""

    def __init__(self, device: torch.device, *, pack: bool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pack = self.cuda if pack is None else pack
        if self.cuda and not self.pack:
            raise ValueError("records reach a CUDA device packed")
        self._host = torch.empty(0, dtype=torch.uint8)
        self._stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                        if self.cuda else None)
        self.bytes = 0  # carried to the device by the last upload

    def upload(self, groups: Mapping[str, list[DecodedItem]]) -> dict[str, CompactRecords]:
        """Every tensor's records, in the order given (copies start in that order)."""
        if not self.pack:
            self.bytes = 0
            return {name: on_host(group) for name, group in groups.items()}
        if self._stream is not None:
            self._stream.synchronize()  # the pinned buffer is free: no copy still reads it
        arrays = {name: [_arrays(i) for i in group] for name, group in groups.items()}
        sizes = {name: _packed_size(group, arrays[name]) for name, group in groups.items()}
        total = sum(sizes.values())
        if self._host.numel() < total:
            self._host = torch.empty(max(total, self._host.numel() * 3 // 2),
                                     dtype=torch.uint8, pin_memory=self.cuda)
        host = self._host.numpy()
        device_buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        if self._stream is not None:  # device_buf's memory may be in use before now
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        out: dict[str, CompactRecords] = {}
        lo = 0
        for name, group in groups.items():
            hi = lo + sizes[name]
            layout = _pack(group, arrays[name], host, lo)
            ready = None
            if self._stream is None:
                device_buf[lo:hi].copy_(self._host[lo:hi])
            else:
                with torch.cuda.stream(self._stream):
                    device_buf[lo:hi].copy_(self._host[lo:hi], non_blocking=True)
                    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ready.record(self._stream)
            out[name] = _unpack(group, layout, device_buf, ready)
            lo = hi
        if self._stream is not None:
            device_buf.record_stream(self._stream)
        self.bytes = total
        return out


def on_host(group: list[DecodedItem]) -> CompactRecords:
    """On the CPU the decoded arrays are the compact records: views, no copy."""
    def view(a: npt.NDArray[Any] | None) -> torch.Tensor | None:
        return None if a is None else _readonly(_signed(a))
    items = [CompactItem(start=i.header.start, count=i.header.count,
                         runs=i.header.loc == "runs", small=_readonly(i.small),
                         marks=view(_marks(i)), escaped=view(i.escaped),
                         lengths=view(i.len_values))
             for i in group]
    values = (group[0].values if len(group) == 1
              else np.concatenate([i.values for i in group]))
    return CompactRecords(items=items, values=_readonly(_signed(values)))


def _readonly(a: npt.NDArray[Any]) -> torch.Tensor:
    """A tensor over a decoded array, which may be a read-only view of a decompressed
    stream; nothing here writes through it, so torch's warning about that is moot."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(a)


def apply_items(items: list[DecodedItem], targets: Mapping[str, Target]) -> int:
    """:func:`dcr.codec.decode.apply_items` with torch operations: the same checks, then
    each item expanded and scattered as the applier's device path does, on the CPU.
    Returns the records applied. The tests hold it to the C kernel's bits."""
    check_apply(items, targets)
    n = 0
    for item in items:
        flat = torch.from_numpy(_signed(targets[item.header.name].bits.reshape(-1)))
        positions, values = on_host([item]).expand()
        scatter(flat, positions, values, xor=item.header.entry == "xor")
        n += positions.numel()
    return n


CPU_BLOCK = 1 << 16  # records per gather and scatter on the CPU: their lines stay cached


def scatter(flat: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, *,
            xor: bool) -> None:
    """``flat[idx] ^= values`` (or ``=``) for distinct indices, with ``gather`` and
    ``scatter_``: on the CPU 3x faster than indexing, and plain kernels on CUDA. On the
    CPU in blocks, so the scatter finds in cache the lines its gather just read (1.7x
    faster than one pass each at 9 M records over 600 MB); on CUDA in one launch."""
    step = CPU_BLOCK if flat.device.type == "cpu" else max(1, idx.numel())
    for lo in range(0, idx.numel(), step):
        i, v = idx[lo : lo + step], values[lo : lo + step]
        flat.scatter_(0, i, flat.gather(0, i) ^ v if xor else v)


def _signed(a: npt.NDArray[np.unsignedinteger]) -> npt.NDArray[np.integer]:
    """torch has no unsigned 16/32/64-bit arithmetic: the same bits, signed."""
    return a if a.itemsize == 1 else a.view(np.dtype(f"<i{a.itemsize}"))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _packed_size(group: list[DecodedItem], arrays: list[list[npt.NDArray[Any]]]) -> int:
    return (sum(_aligned(a.nbytes) for per_item in arrays for a in per_item)
            + _aligned(sum(i.values.nbytes for i in group)))


def _pack(group: list[DecodedItem], arrays: list[list[npt.NDArray[Any]]],
          host: npt.NDArray[np.uint8], lo: int) -> list[tuple[int, int]]:
    """Copy a tensor's arrays into the pinned buffer from ``lo``: its values first (one
    run, every item's), then each item's location arrays; returns (offset, bytes) of each
    array in that order."""
    layout: list[tuple[int, int]] = []
    at = lo
    for i in group:
        host[at : at + i.values.nbytes] = i.values.view(np.uint8)
        at += i.values.nbytes
    layout.append((lo, at - lo))
    at = lo + _aligned(at - lo)
    for a in (a for per_item in arrays for a in per_item):
        host[at : at + a.nbytes] = a.view(np.uint8)
        layout.append((at, a.nbytes))
        at += _aligned(a.nbytes)
    return layout


def _unpack(group: list[DecodedItem], layout: list[tuple[int, int]], buf: torch.Tensor,
            ready: torch.cuda.Event | None) -> CompactRecords:
    spans = iter(layout)

    def take(width: int) -> torch.Tensor:
        at, n = next(spans)
        return buf[at : at + n].view(_SIGNED[width])

    values = take(group[0].values.itemsize)
    items: list[CompactItem] = []
    for i in group:
        small = take(1)
        marks = take(8) if i.escaped is not None else None
        escaped = take(i.escaped.itemsize) if i.escaped is not None else None
        lengths = take(i.len_values.itemsize) if i.len_values is not None else None
        items.append(CompactItem(start=i.header.start, count=i.header.count,
                                 runs=i.header.loc == "runs", small=small, marks=marks,
                                 escaped=escaped, lengths=lengths))
    return CompactRecords(items=items, values=values, ready=ready)
