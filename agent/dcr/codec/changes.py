"""Change detection on stored bit patterns.

Both sides are integer views of one width, so ``-0.0 -> +0.0`` and NaN payload changes
count. A C kernel (``_native.c``) compares, finds and gathers in one pass without the GIL,
chunk by chunk so its buffers stay bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from dcr.codec import _native  # type: ignore[attr-defined]
from dcr.codec.planes import UInt

Positions = npt.NDArray[np.int64]
A = TypeVar("A", bound=npt.NDArray[Any])

DEFAULT_CHUNK = 1 << 20  # elements per scan call; bounds the output buffers


@dataclass(frozen=True, kw_only=True)
class Changes:
    """Changed flat indices (ascending) with their old and new bits."""

    positions: Positions
    old: UInt
    new: UInt


def find_changes(base: UInt, target: UInt, *, chunk: int = DEFAULT_CHUNK) -> Changes:
    """Every element where ``base`` and ``target`` hold different bits."""
    if base.shape != target.shape or base.dtype != target.dtype:
        raise ValueError(
            f"cannot compare {base.dtype}{list(base.shape)} with {target.dtype}{list(target.shape)}"
        )
    b = np.ascontiguousarray(base).reshape(-1)
    t = np.ascontiguousarray(target).reshape(-1)
    n = b.size
    size = min(chunk, n)
    pos_buf = np.empty(size, dtype=np.int64)
    old_buf = np.empty(size, dtype=b.dtype)
    new_buf = np.empty(size, dtype=b.dtype)
    pos: list[Positions] = []
    old: list[UInt] = []
    new: list[UInt] = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        k = _native.scan(b[lo:hi], t[lo:hi], b.itemsize, pos_buf, old_buf, new_buf, lo)
        if k:
            pos.append(pos_buf[:k].copy())
            old.append(old_buf[:k].copy())
            new.append(new_buf[:k].copy())
    if not pos:
        empty = np.empty(0, dtype=b.dtype)
        return Changes(positions=np.empty(0, dtype=np.int64), old=empty, new=empty)
    return Changes(positions=_cat(pos), old=_cat(old), new=_cat(new))


def _cat(parts: list[A]) -> A:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)  # type: ignore[return-value]
