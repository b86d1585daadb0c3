"""The additive region fingerprint (``dcr.codec.sums``) with torch operations, computed
where the weights live: nothing but the 8-byte sum reaches the host. A dozen elementwise
passes over int64 copies: bound by memory on a GPU; on a CPU the applier uses the C
kernel instead (``bench/region_sums.py``).

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
    element k of ``bits`` in row-major order is element k of the span). Rows of the last
    dimension at a time: an element's index is its row's first plus a step along it, so
    only the row starts are divided out of row-major positions."""
    offset, sizes, strides = span
    if tuple(bits.shape) != tuple(sizes):
        raise ValueError(f"bits of shape {list(bits.shape)} for a span of sizes {list(sizes)}")
    width = bits.element_size()
    inner, step = (sizes[-1], strides[-1]) if sizes else (1, 1)
    rows = bits.reshape(-1, inner) if inner else bits.reshape(0, 1)
    device = bits.device
    along = torch.arange(inner, dtype=torch.int64, device=device) * step
    total = torch.zeros((), dtype=torch.int64, device=device)
    per = max(1, CHUNK // max(inner, 1))
    for lo in range(0, rows.shape[0], per):
        r = torch.arange(lo, min(rows.shape[0], lo + per), dtype=torch.int64, device=device)
        first = torch.full_like(r, offset)
        outer = 1
        for n, t in zip(reversed(sizes[:-1]), reversed(strides[:-1]), strict=True):
            first += (r // outer % n) * t
            outer *= n
        for c in range(0, inner, CHUNK):  # more than once only for rows longer than CHUNK
            v = rows[lo : lo + per, c : c + CHUNK].to(torch.int64)
            if width < 8:
                v = v & ((1 << 8 * width) - 1)
            total += _fmix(v * _KEY + (first[:, None] + along[c : c + CHUNK])).sum()
    return int(total) & MASK64
