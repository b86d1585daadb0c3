"""Where a loader's copy puts each changed element: strided views, inverted.

Each changed canonical position maps through the copy's source view to the destination's
storage index. This is exact for views whose strides nest (each a multiple of the next, no
overlap), as slicing, narrowing, selecting and transposing make; others are unsupported.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from dcr.errors import AttemptError


class UnsupportedView(AttemptError):
    """A copy's source or destination view cannot be inverted exactly."""


@dataclass(frozen=True, kw_only=True)
class View:
    """A strided view of a storage: offset, sizes and strides in elements."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> View:
        return cls(
            offset=int(t.storage_offset()),
            sizes=tuple(int(s) for s in t.shape),
            strides=tuple(int(s) for s in t.stride()),
        )

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def is_rowmajor(v: View) -> bool:
    """Whether the view's elements are contiguous in storage, in row-major order."""
    expect = 1
    for size, stride in zip(reversed(v.sizes), reversed(v.strides), strict=True):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def _nested_order(v: View) -> list[int]:
    """Dims by decreasing stride, after checking the strides nest without overlap."""
    dims = [d for d, s in enumerate(v.sizes) if s != 1]
    if any(v.strides[d] <= 0 for d in dims):
        raise UnsupportedView(f"view {v} has a zero or negative stride (broadcast or flip)")
    dims.sort(key=lambda d: -v.strides[d])
    for big, small in itertools.pairwise(dims):
        sb, ss = v.strides[big], v.strides[small]
        if sb % ss or (v.sizes[small] - 1) * ss >= sb:
            raise UnsupportedView(f"view {v} has strides that do not nest")
    return dims


def locate(src: View, positions: torch.Tensor) -> tuple[slice | torch.Tensor, torch.Tensor]:
    """For ascending storage positions, which lie in ``src`` and at which row-major index.

    Returns ``(inside, flat)``: which of ``positions`` are inside (a slice, or a boolean
    mask) and, for those, their row-major index within the view.
    """
    if is_rowmajor(src):  # a contiguous block: binary search, no pass over the rest
        bounds = torch.tensor([src.offset, src.offset + src.numel], device=positions.device)
        lo, hi = (int(i) for i in torch.searchsorted(positions, bounds))
        return slice(lo, hi), positions[lo:hi] - src.offset
    order = _nested_order(src)
    rest = positions - src.offset
    inside = rest >= 0
    coords: dict[int, torch.Tensor] = {}
    for d in order:
        c = torch.div(rest, src.strides[d], rounding_mode="floor")
        rest = rest - c * src.strides[d]
        inside &= (c >= 0) & (c < src.sizes[d])
        coords[d] = c
    inside &= rest == 0
    flat = torch.zeros_like(positions)
    for d, size in enumerate(src.sizes):
        flat = flat * size + (coords.get(d, 0))
    return inside, flat[inside]


def storage_index(dst: View, flat: torch.Tensor) -> torch.Tensor:
    """Storage indices of row-major positions ``flat`` of the view ``dst``."""
    if is_rowmajor(dst):
        return flat + dst.offset
    out = torch.full_like(flat, dst.offset)
    rest = flat
    for d in reversed(range(len(dst.sizes))):
        size = dst.sizes[d]
        out += (rest % size) * dst.strides[d]
        rest = torch.div(rest, size, rounding_mode="floor")
    return out


def check_invertible(v: View) -> None:
    _nested_order(v)
