"""Property tests of the codec: every delta round-trips to the target's exact bits.

Covers every dtype width, shapes from 0-d to odd multi-dimensional ones, change rates
from one element to all of them, signed zeros, NaN payloads and infinities, both entry
kinds, both location codings, items split across ranges, and XOR's non-idempotence.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.codec import locations
from dcr.codec.decode import Target, apply_items, decode
from dcr.codec.encode import ItemDelta, PayloadBuilder, diff_range, encode_item
from dcr.codec.planes import escape_join, escape_split
from dcr.format.dtypes import DTYPES, dtype
from dcr.format.payload import read_payload

SPECIAL_BF16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFC0, 0x0001, 0x7F81]


def seal(*deltas, mode="mixed", seq=0):  # type: ignore[no-untyped-def]
    pb = PayloadBuilder(
        base_version=1, target_version=2, attempt="a-test", owner=0, seq=seq, mode=mode
    )
    for d in deltas:
        pb.add(encode_item(d), dense_bytes=d.values.nbytes)
    return pb.seal()


def roundtrip(base, target, shape, dt, entry, item_elements=None):  # type: ignore[no-untyped-def]
    n = base.size
    step = item_elements or max(n, 1)
    deltas = []
    for lo in range(0, n, step):
        d = diff_range(
            name="t", dtype=dt, shape=shape, start=lo, base=base[lo : lo + step],
            target=target[lo : lo + step], entry=entry,
        )
        if d is not None:
            deltas.append(d)
    out = base.copy()
    if deltas:
        items = decode(read_payload(seal(*deltas, mode="mixed" if entry == "xor" else "overwrite")))
        apply_items(items, {"t": Target(dtype=dt.name, shape=shape, bits=out)})
    return out


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    dt = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    info = np.iinfo(dt.bits)
    base = rng.integers(0, info.max, size=n, dtype=dt.bits, endpoint=True)
    target = base.copy()
    rate = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    mask = rng.random(n) < rate
    if n and draw(st.booleans()):
        mask[rng.integers(0, n)] = True
    target[mask] = rng.integers(0, info.max, size=int(mask.sum()), dtype=dt.bits, endpoint=True)
    if dt.name == "BF16" and n:
        k = min(n, len(SPECIAL_BF16))
        target[:k] = np.array(SPECIAL_BF16[:k], dtype=np.uint16)
    entry = draw(st.sampled_from(["xor", "overwrite"]))
    item_elements = draw(st.sampled_from([None, 1, 7, 64]))
    return base, target, shape, dt, entry, item_elements


@settings(max_examples=300, deadline=None)
@given(cases())
def test_any_delta_roundtrips_to_target_bits(case) -> None:  # type: ignore[no-untyped-def]
    base, target, shape, dt, entry, item_elements = case
    out = roundtrip(base, target, shape, dt, entry, item_elements)
    assert np.array_equal(out, target)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=300, unique=True),
    st.integers(5001, 70000),
)
def test_locations_roundtrip_for_any_position_set(positions, span) -> None:  # type: ignore[no-untyped-def]
    pos = np.array(sorted(positions), dtype=np.int64)
    locs = locations.encode(pos)
    locations.validate("t", locs, span)
    got = np.concatenate([p for _, p in locations.iter_positions(locs, block=17)])
    assert np.array_equal(got, pos)


def test_signed_zero_and_nan_payload_changes_are_detected() -> None:
    base = np.array([0x0000, 0x7FC0, 0x7F80, 0x3F80], dtype=np.uint16)  # +0, NaN, +Inf, 1.0
    target = np.array([0x8000, 0x7FC1, 0x7F80, 0x3F80], dtype=np.uint16)  # -0, NaN', +Inf, 1.0
    d = diff_range(name="t", dtype=dtype("BF16"), shape=(4,), start=0, base=base, target=target,
                   entry="xor")
    assert d is not None
    assert d.positions.tolist() == [0, 1]
    assert np.array_equal(roundtrip(base, target, (4,), dtype("BF16"), "xor"), target)


def test_whole_tensor_change_is_one_run() -> None:
    base = np.zeros(10_000, dtype=np.uint16)
    target = np.ones(10_000, dtype=np.uint16)
    d = diff_range(name="t", dtype=dtype("BF16"), shape=(100, 100), start=0, base=base,
                   target=target, entry="overwrite")
    assert d is not None
    item = encode_item(d)
    assert (item.header.loc, item.header.runs) == ("runs", 1)
    assert np.array_equal(roundtrip(base, target, (100, 100), dtype("BF16"), "overwrite"), target)


def test_sparse_changes_use_gap_coding_with_narrowest_width() -> None:
    base = np.zeros(100_000, dtype=np.uint16)
    target = base.copy()
    target[[10, 300, 99_999]] = 1
    d = diff_range(name="t", dtype=dtype("BF16"), shape=(100_000,), start=0, base=base,
                   target=target, entry="xor")
    assert d is not None
    h = encode_item(d).header
    # gaps 10, 289, 99698: two escapes, the widest 99698 - 255 = 99443 needs 4 bytes
    assert (h.loc, h.escapes, h.loc_width, h.count) == ("gaps", 2, 4, 3)


def test_xor_payload_applied_twice_restores_the_old_bits() -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**16, size=1000, dtype=np.uint16)
    target = base.copy()
    target[::10] ^= 1
    d = diff_range(name="t", dtype=dtype("BF16"), shape=(1000,), start=0, base=base,
                   target=target, entry="xor")
    assert d is not None
    items = decode(read_payload(seal(d)))
    out = base.copy()
    t = {"t": Target(dtype="BF16", shape=(1000,), bits=out)}
    apply_items(items, t)
    assert np.array_equal(out, target)
    apply_items(items, t)  # why receivers must deduplicate payloads: XOR is not idempotent
    assert np.array_equal(out, base)


def test_overwrite_payload_is_idempotent() -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2**32, size=500, dtype=np.uint32)
    target = base.copy()
    target[::7] += 1
    d = diff_range(name="t", dtype=dtype("F32"), shape=(500,), start=0, base=base,
                   target=target, entry="overwrite")
    assert d is not None
    items = decode(read_payload(seal(d, mode="overwrite")))
    out = base.copy()
    t = {"t": Target(dtype="F32", shape=(500,), bits=out)}
    apply_items(items, t)
    apply_items(items, t)
    assert np.array_equal(out, target)


def test_many_small_tensors_share_streams() -> None:
    rng = np.random.default_rng(2)
    deltas, bases, targets = [], {}, {}
    for i in range(50):
        b = rng.integers(0, 2**16, size=64, dtype=np.uint16)
        t = b.copy()
        t[rng.integers(0, 64, 3)] ^= 1
        bases[f"n{i}"], targets[f"n{i}"] = b, t
        d = diff_range(name=f"n{i}", dtype=dtype("BF16"), shape=(64,), start=0, base=b,
                       target=t, entry="xor")
        assert d is not None
        deltas.append(d)
    p = read_payload(seal(*deltas))
    assert len(p.header.items) == 50
    assert len(p.header.streams) == 3  # loc.0 and the two planes of val.xor.BF16
    outs = {n: b.copy() for n, b in bases.items()}
    apply_items(decode(p), {n: Target(dtype="BF16", shape=(64,), bits=o) for n, o in outs.items()})
    assert all(np.array_equal(outs[n], targets[n]) for n in outs)


@pytest.mark.parametrize("level", [1, 3, 19])
def test_zstd_level_changes_size_not_result(level: int) -> None:
    rng = np.random.default_rng(3)
    base = rng.integers(0, 2**16, size=20_000, dtype=np.uint16)
    target = base.copy()
    target[rng.random(20_000) < 0.02] ^= 1
    d = diff_range(name="t", dtype=dtype("BF16"), shape=(20_000,), start=0, base=base,
                   target=target, entry="xor")
    assert d is not None
    pb = PayloadBuilder(base_version=0, target_version=1, attempt="a", owner=0, seq=0,
                        mode="mixed", level=level)
    pb.add(encode_item(d), dense_bytes=base.nbytes)
    out = base.copy()
    apply_items(decode(read_payload(pb.seal())),
                {"t": Target(dtype="BF16", shape=(20_000,), bits=out)})
    assert np.array_equal(out, target)


# --- escaped location values -------------------------------------------------------------


@pytest.mark.parametrize(("gap", "escapes", "loc_width", "esc"), [
    (0, 0, 0, None),
    (254, 0, 0, None),  # the largest value that is its own byte
    (255, 1, 1, 0),  # 255 itself escapes, to 0
    (256, 1, 1, 1),
    (510, 1, 1, 255),  # the largest escape that fits one byte
    (511, 1, 2, 256),
    (65790, 1, 2, 65535),
    (65791, 1, 4, 65536),
])
def test_gap_escape_boundaries_roundtrip(gap: int, escapes: int, loc_width: int,
                                         esc: int | None) -> None:
    n = gap + 2
    base = np.zeros(n, dtype=np.uint8)
    target = base.copy()
    target[[gap, n - 1]] = 1  # gaps: gap, 0
    d = diff_range(name="t", dtype=dtype("U8"), shape=(n,), start=0, base=base,
                   target=target, entry="xor")
    assert d is not None
    item = encode_item(d)
    h = item.header
    assert (h.loc, h.count, h.escapes, h.loc_width) == ("gaps", 2, escapes, loc_width)
    assert item.planes["loc.0"].tolist() == [min(gap, 255), 0]
    assert sorted(k for k in item.planes if k.startswith("esc.")) == [
        f"esc.{k}" for k in range(loc_width)]
    if esc is not None:
        got = sum(int(item.planes[f"esc.{k}"][0]) << (8 * k) for k in range(loc_width))
        assert got == esc
    sid = [s.id for s in read_payload(seal(d)).header.streams]
    assert sid[: 1 + loc_width] == ["loc.0", *(f"esc.{k}" for k in range(loc_width))]
    assert np.array_equal(roundtrip(base, target, (n,), dtype("U8"), "xor"), target)


def test_run_gap_escape_roundtrips() -> None:
    base = np.zeros(2000, dtype=np.uint16)
    target = base.copy()
    target[300:340] = 1  # run gap 300: escaped (45)
    target[1500:1600] = 2  # run gap 1160: escaped (905, 2 bytes)
    d = diff_range(name="t", dtype=dtype("BF16"), shape=(2000,), start=0, base=base,
                   target=target, entry="overwrite")
    assert d is not None
    item = encode_item(d)
    h = item.header
    assert (h.loc, h.runs, h.escapes, h.loc_width, h.len_width) == ("runs", 2, 2, 2, 1)
    assert item.planes["loc.0"].tolist() == [255, 255]
    assert item.planes["esc.0"].tolist() == [45, 905 & 0xFF]
    assert item.planes["esc.1"].tolist() == [0, 905 >> 8]
    assert item.planes["len.0"].tolist() == [39, 99]
    assert np.array_equal(roundtrip(base, target, (2000,), dtype("BF16"), "overwrite"), target)


def test_eight_byte_escape_decodes_without_materialising_the_tensor() -> None:
    """A gap past 2**32 + 255 needs loc_width 8; decode checks it without a target."""
    n = 2**33
    pos = np.array([7, 2**32 + 300, n - 1], dtype=np.int64)  # gaps 7, 2**32 + 292, ...
    delta = ItemDelta(name="big", dtype=dtype("U8"), shape=(n,), start=0, stop=n,
                      entry="overwrite", positions=pos,
                      values=np.array([1, 2, 3], dtype=np.uint8))
    h = encode_item(delta).header
    assert (h.loc, h.escapes, h.loc_width) == ("gaps", 2, 8)
    (item,) = decode(read_payload(seal(delta, mode="overwrite")))
    got = np.concatenate([p for p, _ in item.blocks()])
    assert got.tolist() == pos.tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 254, 255, 256, 510, 511, 65790, 65791, 2**32 + 254,
                                 2**32 + 255, 2**63]) | st.integers(0, 2**64 - 1),
                max_size=50))
def test_escape_split_and_join_are_inverse(values: list[int]) -> None:
    arr = np.array(values, dtype=np.uint64)
    small, escaped = escape_split(arr)
    assert small.dtype == np.uint8
    assert small.tolist() == [min(v, 255) for v in values]
    big = [v - 255 for v in values if v >= 255]
    if not big:
        assert escaped is None
    else:
        assert escaped is not None
        assert escaped.tolist() == big
        assert escaped.dtype.itemsize == next(w for w in (1, 2, 4, 8) if max(big) < 1 << (8 * w))
    assert escape_join(small, escaped).tolist() == values


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 1200), min_size=1, max_size=40),
    st.integers(0, 3),
)
def test_payload_roundtrips_any_gaps_around_the_escape(gaps: list[int], tail: int) -> None:
    pos = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
    n = int(pos[-1]) + 1 + tail
    base = np.zeros(n, dtype=np.uint8)
    target = base.copy()
    target[pos] = 1
    d = diff_range(name="t", dtype=dtype("U8"), shape=(n,), start=0, base=base,
                   target=target, entry="xor")
    assert d is not None
    h = encode_item(d).header
    if h.loc == "gaps":
        assert h.escapes == sum(g >= 255 for g in gaps)
    assert np.array_equal(roundtrip(base, target, (n,), dtype("U8"), "xor"), target)
