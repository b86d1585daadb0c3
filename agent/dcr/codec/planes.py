"""Byte planes: each byte position of a value stream coded as its own stream, so zstd's
Huffman stage fits each distribution alone (agent/dcr/format/FORMAT.md, "Streams").

Everything here is little-endian and vectorised.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

UInt = npt.NDArray[np.unsignedinteger]
U8 = npt.NDArray[np.uint8]

_UINT: dict[int, np.dtype[np.unsignedinteger]] = {
    w: np.dtype(f"<u{w}") for w in (1, 2, 4, 8)
}


def uint_dtype(width: int) -> np.dtype[np.unsignedinteger]:
    return _UINT[width]


def width_for(max_value: int) -> int:
    """The smallest of 1, 2, 4, 8 bytes that holds ``max_value``."""
    for w in (1, 2, 4):
        if max_value < 1 << (8 * w):
            return w
    return 8


def split(values: UInt, width: int) -> list[U8]:
    """Plane k holds byte k of every value (as strided views; no copy)."""
    as_bytes = np.ascontiguousarray(values, dtype=_UINT[width]).view(np.uint8)
    cols = as_bytes.reshape(-1, width)
    return [cols[:, k] for k in range(width)]


def join(planes: list[U8], width: int) -> UInt:
    """Inverse of :func:`split`: interleave ``width`` equal-length planes into values."""
    n = len(planes[0]) if planes else 0
    out = np.empty((n, width), dtype=np.uint8)
    for k, plane in enumerate(planes):
        out[:, k] = plane
    return out.reshape(-1).view(_UINT[width])


ESCAPE = 255


def escape_split(values: UInt) -> tuple[U8, UInt | None]:
    """Code unsigned values as one byte each, 255 marking an escape to ``value - 255``.

    Location values are near-geometric: most fit a byte, a few do not. Keeping every
    value in one byte stream lets zstd's Huffman stage code the rare large ones with a
    long code word, where byte planes would spend at least a bit per value on a high
    plane that is almost all zeros. Escapes are returned narrowed to the smallest width.
    """
    small = np.minimum(values, ESCAPE).astype(np.uint8)
    big = values[small == ESCAPE]
    if big.size == 0:
        return small, None
    rest = big.astype(np.uint64) - ESCAPE
    return small, rest.astype(_UINT[width_for(int(rest.max()))])


def escape_join(small: U8, escaped: UInt | None) -> npt.NDArray[np.uint64]:
    """Inverse of :func:`escape_split`; the caller checks the escape count first."""
    out = small.astype(np.uint64)
    if escaped is not None and escaped.size:
        out[small == ESCAPE] = escaped.astype(np.uint64) + ESCAPE
    return out
