"""The C kernels against numpy references: every width, unaligned buffers, tails, errors,
shifted scatters, and coded locations (gaps, runs, escapes) turned into positions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.codec import _native, locations  # type: ignore[attr-defined]
from dcr.codec.planes import escape_split


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


@pytest.mark.parametrize("shift", [-5, 0, 11])
def test_scatter_adds_the_shift_to_every_position(shift: int) -> None:
    t = np.arange(100, dtype=np.uint16)
    want = t.copy()
    pos = np.array([5, 17, 60, 88], dtype=np.int64)
    vals = np.array([1, 2, 3, 4], dtype=np.uint16)
    want[pos + shift] ^= vals
    _native.scatter(t, 2, pos, vals, True, shift)
    assert np.array_equal(t, want)


@pytest.mark.parametrize(("pos", "shift"), [(95, 5), (3, -4), (2**63 - 1, 1), (-(2**63), -1)])
def test_scatter_position_shifted_out_of_range_writes_nothing(pos: int, shift: int) -> None:
    t = np.arange(100, dtype=np.uint16)
    with pytest.raises(IndexError, match="outside a target of 100 elements"):
        _native.scatter(t, 2, np.array([1, pos], np.int64), np.ones(2, np.uint16), True, shift)
    assert np.array_equal(t, np.arange(100, dtype=np.uint16))


def coded(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An item's location streams as FORMAT.md codes them: loc.0 bytes, escapes (value
    minus 255, as uint64) and run lengths minus one (empty for gaps)."""
    locs = locations.encode(positions)
    small, escaped = escape_split(locs.loc_values)
    esc = np.zeros(0, np.uint64) if escaped is None else escaped.astype(np.uint64)
    lens = np.zeros(0, np.uint8) if locs.len_values is None else locs.len_values
    return small, esc, lens


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.floats(0.001, 1), st.integers(0, 100), st.integers(0, 2**32 - 1))
def test_positions_match_numpy_for_gaps_runs_and_escapes(span: int, rate: float, start: int,
                                                         seed: int) -> None:
    rng = np.random.default_rng(seed)
    positions = np.flatnonzero(rng.random(span) < rate).astype(np.int64)
    if positions.size == 0:
        positions = np.array([span - 1], np.int64)
    small, esc, lens = coded(positions)
    out = np.empty(positions.size, np.int64)
    _native.positions(small, esc, 8, lens, max(lens.itemsize, 1), start, span, out)
    assert np.array_equal(out, positions + start)


def test_positions_refuse_streams_that_do_not_match_the_records() -> None:
    small, esc, lens = coded(np.array([3, 300, 301, 999], np.int64))  # escapes: gaps 296 and 697
    out = np.empty(4, np.int64)
    with pytest.raises(ValueError, match="do not match 4 records and 0 escapes"):
        _native.positions(small, esc[:0], 8, lens, 1, 0, 1000, out)
    with pytest.raises(ValueError, match="do not match 5 records"):
        _native.positions(small, esc, 8, lens, 1, 0, 1000, np.empty(5, np.int64))
    with pytest.raises(ValueError, match="reach past the item's 999 elements"):
        _native.positions(small, esc, 8, lens, 1, 0, 999, out)
    runs_small, runs_esc, runs_lens = coded(np.arange(10, 50, dtype=np.int64))
    with pytest.raises(ValueError, match="reach past the item's 40 elements"):
        _native.positions(runs_small, runs_esc, 8, runs_lens, 1, 0, 40, np.empty(40, np.int64))
    with pytest.raises(ValueError, match="bad widths"):
        _native.positions(small, esc, 3, lens, 1, 0, 1000, out)
