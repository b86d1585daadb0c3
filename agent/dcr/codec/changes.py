"""Change detection on stored bit patterns.

Both sides are integer views of the same width, so ``-0.0 -> +0.0`` and NaN payload
changes count. The scan is chunked so the boolean mask and the gathered values stay in
cache and memory stays bounded whatever the tensor size; no per-element Python runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from dcr.codec.planes import UInt

Positions = npt.NDArray[np.int64]
A = TypeVar("A", bound=npt.NDArray[Any])

DEFAULT_CHUNK = 1 << 18  # elements per compare; 256 Ki keeps the mask in L2


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
    b = base.reshape(-1)
    t = target.reshape(-1)
    n = b.size
    mask = np.empty(min(chunk, n), dtype=bool)
    pos: list[Positions] = []
    old: list[UInt] = []
    new: list[UInt] = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        bc, tc, m = b[lo:hi], t[lo:hi], mask[: hi - lo]
        np.not_equal(bc, tc, out=m)
        idx = np.flatnonzero(m)
        if idx.size:
            old.append(bc[idx])  # gathered while the chunk is still in cache
            new.append(tc[idx])
            idx += lo
            pos.append(idx)
    if not pos:
        empty = np.empty(0, dtype=b.dtype)
        return Changes(positions=np.empty(0, dtype=np.int64), old=empty, new=empty)
    return Changes(positions=_cat(pos), old=_cat(old), new=_cat(new))


def _cat(parts: list[A]) -> A:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)  # type: ignore[return-value]
