"""Change detection on stored bit patterns.

Both sides are integer views of the same width, so ``-0.0 -> +0.0`` and NaN payload
changes count. The scan is chunked to keep the boolean scratch in cache and memory
bounded whatever the tensor size; no per-element Python runs.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from dcr.codec.planes import UInt

Positions = npt.NDArray[np.int64]

DEFAULT_CHUNK = 1 << 18  # elements per compare; 256 Ki keeps the mask in L2


def changed_positions(base: UInt, target: UInt, *, chunk: int = DEFAULT_CHUNK) -> Positions:
    """Flat indices (ascending) where ``base`` and ``target`` hold different bits."""
    if base.shape != target.shape or base.dtype != target.dtype:
        raise ValueError(
            f"cannot compare {base.dtype}{list(base.shape)} with {target.dtype}{list(target.shape)}"
        )
    b = base.reshape(-1)
    t = target.reshape(-1)
    n = b.size
    mask = np.empty(min(chunk, n), dtype=bool)
    found: list[Positions] = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        m = mask[: hi - lo]
        np.not_equal(b[lo:hi], t[lo:hi], out=m)
        idx = np.flatnonzero(m)
        if idx.size:
            idx += lo
            found.append(idx)
    if not found:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(found) if len(found) > 1 else found[0]
