"""The element types DCR moves, named as safetensors names them.

Every comparison and every write works on the stored bit pattern, so each dtype maps to
the unsigned integer type of the same width. Float equality would miss ``-0.0 -> +0.0``
and changes in NaN payloads; integer views do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcr.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class DType:
    """One element type: its safetensors name, width, and float-ness."""

    name: str
    itemsize: int
    is_float: bool

    @property
    def bits(self) -> np.dtype[np.unsignedinteger]:
        """The unsigned integer view used for every comparison and write."""
        return np.dtype(f"<u{self.itemsize}")


_TABLE: tuple[DType, ...] = (
    DType(name="F64", itemsize=8, is_float=True),
    DType(name="F32", itemsize=4, is_float=True),
    DType(name="F16", itemsize=2, is_float=True),
    DType(name="BF16", itemsize=2, is_float=True),
    DType(name="F8_E4M3", itemsize=1, is_float=True),
    DType(name="F8_E5M2", itemsize=1, is_float=True),
    DType(name="I64", itemsize=8, is_float=False),
    DType(name="I32", itemsize=4, is_float=False),
    DType(name="I16", itemsize=2, is_float=False),
    DType(name="I8", itemsize=1, is_float=False),
    DType(name="U64", itemsize=8, is_float=False),
    DType(name="U32", itemsize=4, is_float=False),
    DType(name="U16", itemsize=2, is_float=False),
    DType(name="U8", itemsize=1, is_float=False),
    DType(name="BOOL", itemsize=1, is_float=False),
)

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}


def dtype(name: str) -> DType:
    """Look a dtype up by its safetensors name, or fail naming it."""
    try:
        return DTYPES[name]
    except KeyError:
        known = ", ".join(sorted(DTYPES))
        raise ConfigError(f"Unsupported dtype {name!r}; supported: {known}.") from None
