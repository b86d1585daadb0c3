"""Additive fingerprints of canonical elements: what a rank holding part of a tensor checks.

The sum of a region (``dcr.format.regions``) is, modulo 2**64, the sum over its elements of
``fmix64(bits * K + index)``: ``bits`` the element's bits read unsigned, ``index`` its flat
position in the canonical tensor, ``K`` odd and ``fmix64`` Murmur3's finalizer (a bijection).
Being a sum over elements, it composes: owners that each hold part of a tensor add what they
own and a receiver adds their parts; a rank adds its spans in any order. One wrong element
always changes the sum (``bits * K + index`` is one to one in the bits, and ``fmix64`` is a
bijection); several cancel with a chance of about 2**-64. It checks that a rank holds what
the owner meant, as the whole-tensor fingerprints do: it is no defence against whoever
writes the manifest (``docs/security.md``).

The C kernel (``_native.span_sum``) sums one span's bits, given in the span's row-major
order with the span's geometry; ``span_sum_torch`` is the same sum with torch
operations (``dcr.apply.sums``), for tensors on a device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from dcr.codec import _native  # type: ignore[attr-defined]
from dcr.format.regions import Span, extent, sum_text, whole

MASK64 = (1 << 64) - 1
KEY = 0x9E3779B97F4A7C15
FMIX = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)


def span_sum(bits: npt.NDArray[np.unsignedinteger], span: Span) -> int:
    """The sum of one span whose elements ``bits`` holds, in the span's row-major order."""
    offset, sizes, strides = span
    flat = np.ascontiguousarray(bits).reshape(-1)
    return int(_native.span_sum(flat, flat.itemsize, offset, np.asarray(sizes, np.int64),
                                np.asarray(strides, np.int64)))


def whole_sum(bits: npt.NDArray[np.unsignedinteger]) -> str:
    """``sum64:`` of a whole canonical tensor whose bits ``bits`` holds in row-major order:
    what a manifest lists for a tensor its owners each hold part of."""
    flat = np.ascontiguousarray(bits).reshape(-1)
    return sum_text(span_sum(flat, whole(flat.shape)[0]))


def fingerprint_as(want: str, bits: npt.NDArray[np.unsignedinteger],
                   xxh3: Callable[[npt.NDArray[np.unsignedinteger]], str]) -> str:
    """The fingerprint of a whole canonical tensor's ``bits`` of the kind ``want`` is (a
    manifest's, ``TensorEntry``): the sum for ``sum64:``, else ``xxh3`` of them."""
    return whole_sum(bits) if want.startswith("sum64:") else xxh3(bits)


def gather(flat: npt.NDArray[np.unsignedinteger], span: Span) -> npt.NDArray[np.unsignedinteger]:
    """A span's elements of a flat canonical tensor, in row-major order (a copy). The span
    must lie inside ``flat`` (:func:`dcr.format.regions.check_spans`)."""
    offset, sizes, strides = span
    if not all(sizes):
        return flat[:0]
    item = flat.itemsize
    view = np.lib.stride_tricks.as_strided(flat[offset:], shape=sizes,
                                           strides=[t * item for t in strides], writeable=False)
    return np.ascontiguousarray(view)


def region_sum(flat: npt.NDArray[np.unsignedinteger], spans: Sequence[Span]) -> int:
    """The sum of a region of a whole canonical tensor's flat bits."""
    return sum(span_sum(gather(flat, s), s) for s in spans) & MASK64


CHUNK = 1 << 22  # span elements enumerated at once where an owner holds a region in pieces


def index_sum(bits: npt.NDArray[np.unsignedinteger], index: npt.NDArray[np.int64]) -> int:
    """The sum over elements given one by one: ``bits[k]`` at canonical ``index[k]``."""
    flat = np.ascontiguousarray(bits).reshape(-1)
    return int(_native.index_sum(flat, flat.itemsize, np.ascontiguousarray(index, np.int64)))


def span_at(span: Span, k: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The canonical indices of a span's elements at row-major positions ``k``."""
    offset, sizes, strides = span
    out = np.full_like(k, offset)
    step = 1
    for n, t in zip(reversed(sizes), reversed(strides), strict=True):
        out += (k // step % n) * t
        step *= n
    return out


def locate(view: Span, index: npt.NDArray[np.int64]
           ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    """Which canonical ``index`` values a view with nested strides holds, and at which
    row-major position: each index decomposed by the view's strides, largest first."""
    offset, sizes, strides = view
    rel = index - offset
    inside = rel >= 0
    local = np.zeros_like(index)
    for d in sorted(range(len(sizes)), key=lambda d: -strides[d]):
        k = rel // strides[d] if strides[d] else np.zeros_like(rel)
        inside &= k < sizes[d]
        rel -= k * strides[d]
        local += k * math.prod(sizes[d + 1:])
    return inside & (rel == 0), local


def piece_sum(piece: Span, bits: npt.NDArray[np.unsignedinteger], spans: Sequence[Span]
              ) -> int | None:
    """An owner's part of a region's sum: over the region's elements inside ``piece``, a
    view of the canonical tensor with nested strides (a contiguous range, or a block of
    rows' columns) whose elements ``bits`` holds in row-major order. None when no span
    of the region meets the piece."""
    if not math.prod(piece[1]):
        return None
    p_lo, p_hi = extent(piece)
    flat = np.ascontiguousarray(bits).reshape(-1)
    total, met = 0, False
    for span in spans:
        count = math.prod(span[1])
        lo, hi = extent(span)
        if not count or hi < p_lo or lo > p_hi:
            continue
        met = True
        if span[2] == (1,):  # a range of the tensor: what it shares with the piece is a view
            if lo <= p_lo and p_hi <= hi:
                total += span_sum(flat, piece)
                continue
            if piece[2] == (1,):
                a, b = max(lo, p_lo), min(hi, p_hi)
                total += span_sum(flat[a - p_lo : b - p_lo + 1], (a, (b - a + 1,), (1,)))
                continue
        for first in range(0, count, CHUNK):
            index = span_at(span, np.arange(first, min(count, first + CHUNK), dtype=np.int64))
            inside, local = locate(piece, index)
            total += index_sum(flat[local[inside]], index[inside])
    return total & MASK64 if met else None


def delta_sum(spans: Sequence[Span], index: npt.NDArray[np.int64],
              old: npt.NDArray[np.unsignedinteger], new: npt.NDArray[np.unsignedinteger]
              ) -> int:
    """How a region's sum moves when the elements at canonical ``index`` change from
    ``old`` to ``new``: what a publish adds to the owner's part over the baseline, a pass
    over the changes instead of the shard. The spans must nest (``check_spans``)."""
    total = 0
    for span in spans:
        if not math.prod(span[1]):
            continue
        if span[2] == (1,):
            lo, hi = extent(span)
            inside = (index >= lo) & (index <= hi)
        else:
            inside = locate(span, index)[0]
        at = index[inside]
        total += index_sum(new[inside], at) - index_sum(old[inside], at)
    return total & MASK64
