"""The additive region fingerprint (``dcr.codec.sums``) with torch operations, computed
where the weights live: nothing but the 8-byte sum reaches the host.

All arithmetic is modulo 2**64 in torch's int64 (products and sums wrap); ``>>`` on int64
is arithmetic, so every shifted value is masked, as in ``xxh3.py``.
"""

from __future__ import annotations

import torch

from dcr.codec.sums import FMIX, KEY, MASK64
from dcr.format.regions import Span

CHUNK = 1 << 24  # elements per pass: bounded temporaries (a few int64 copies of these)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >> 63 else c


_KEY, _M1, _M2 = _signed(KEY), _signed(FMIX[0]), _signed(FMIX[1])
_LOW31 = (1 << 31) - 1


def _fmix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M1
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M2
    return x ^ ((x >> 33) & _LOW31)


def span_sum_torch(bits: torch.Tensor, span: Span) -> int:
    """The sum of one span whose elements ``bits`` holds (any integer view, any layout:
    element k of ``bits`` in row-major order is element k of the span)."""
    offset, sizes, strides = span
    if tuple(bits.shape) != tuple(sizes):
        raise ValueError(f"bits of shape {list(bits.shape)} for a span of sizes {list(sizes)}")
    width = bits.element_size()
    flat = bits.reshape(-1)
    inner = [1] * len(sizes)  # elements per step of each dimension, in row-major order
    for d in range(len(sizes) - 2, -1, -1):
        inner[d] = inner[d + 1] * sizes[d + 1]
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for lo in range(0, flat.numel(), CHUNK):
        v = flat[lo : lo + CHUNK].to(torch.int64)
        if width < 8:
            v = v & ((1 << 8 * width) - 1)
        k = torch.arange(lo, lo + v.numel(), dtype=torch.int64, device=bits.device)
        index = torch.full_like(k, offset)
        for n, t, step in zip(sizes, strides, inner, strict=True):
            index += (k // step % n) * t
        total += _fmix(v * _KEY + index).sum()
    return int(total) & MASK64
