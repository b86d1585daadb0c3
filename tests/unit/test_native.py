"""The C kernels against numpy references: every width, unaligned buffers, tails, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.codec import _native  # type: ignore[attr-defined]


def unaligned(a: np.ndarray) -> np.ndarray:
    """The same values at an odd byte offset, as safetensors may store them."""
    raw = np.zeros(a.nbytes + 1, dtype=np.uint8)
    raw[1:] = a.view(np.uint8)
    out = raw[1:].view(a.dtype)
    assert a.size == 0 or a.itemsize == 1 or out.ctypes.data % a.itemsize != 0
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]),
    st.integers(0, 300),
    st.floats(0, 1),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_scan_matches_numpy(itemsize: int, n: int, rate: float, shift: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dt = np.dtype(f"<u{itemsize}")
    a = rng.integers(0, np.iinfo(dt).max, size=n, dtype=dt, endpoint=True)
    b = a.copy()
    mask = rng.random(n) < rate
    b[mask] ^= rng.integers(1, np.iinfo(dt).max, size=int(mask.sum()), dtype=dt, endpoint=True)
    if shift:
        a, b = unaligned(a), unaligned(b)
    pos = np.empty(max(n, 1), np.int64)
    old = np.empty(max(n, 1), dt)
    new = np.empty(max(n, 1), dt)
    k = _native.scan(a, b, itemsize, pos, old, new, 7)
    want = np.flatnonzero(a != b)
    assert k == len(want)
    assert np.array_equal(pos[:k], want + 7)
    assert np.array_equal(old[:k], a[want])
    assert np.array_equal(new[:k], b[want])


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("xor", [True, False])
def test_scatter_matches_numpy_on_unaligned_targets(itemsize: int, xor: bool) -> None:
    rng = np.random.default_rng(itemsize)
    dt = np.dtype(f"<u{itemsize}")
    t = unaligned(rng.integers(0, 200, size=1000, dtype=dt))
    want = t.copy()
    pos = np.sort(rng.choice(1000, 77, replace=False)).astype(np.int64)
    vals = rng.integers(1, 200, size=77, dtype=dt)
    if xor:
        want[pos] ^= vals
    else:
        want[pos] = vals
    _native.scatter(t, itemsize, pos, vals, xor)
    assert np.array_equal(t, want)


@pytest.mark.parametrize("bad", [-1, 1000, 2**62])
def test_scatter_out_of_range_position_writes_nothing(bad: int) -> None:
    t = np.arange(1000, dtype=np.uint16)
    before = t.copy()
    pos = np.array([1, 2, bad], dtype=np.int64)
    with pytest.raises(IndexError, match=f"position {bad} of record 2"):
        _native.scatter(t, 2, pos, np.ones(3, np.uint16), True)
    assert np.array_equal(t, before)


def test_scan_rejects_bad_arguments() -> None:
    a = np.zeros(10, np.uint16)
    out = np.empty(10, np.int64)
    vals = np.empty(10, np.uint16)
    with pytest.raises(ValueError, match="itemsize must be 1, 2, 4 or 8, got 3"):
        _native.scan(a, a, 3, out, vals, vals, 0)
    with pytest.raises(ValueError, match="differ"):
        _native.scan(a, a[:9], 2, out, vals, vals, 0)
    with pytest.raises(ValueError, match="too small"):
        _native.scan(a, a, 2, out[:5], vals, vals, 0)
    with pytest.raises(TypeError):
        _native.scan(a, a, 2, np.empty(10, np.int64)[::-1], vals, vals, 0)


def test_scatter_rejects_mismatched_values_and_read_only_targets() -> None:
    t = np.zeros(10, np.uint16)
    with pytest.raises(ValueError, match="do not match"):
        _native.scatter(t, 2, np.array([1], np.int64), np.ones(2, np.uint16), True)
    ro = np.zeros(10, np.uint16)
    ro.flags.writeable = False
    with pytest.raises(TypeError):
        _native.scatter(ro, 2, np.array([1], np.int64), np.ones(1, np.uint16), True)
