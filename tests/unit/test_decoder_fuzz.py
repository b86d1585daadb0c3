"""Fuzzing the payload reader, decoder and apply step with hypothesis.

Four valid payloads (XOR with gap coding and one escaped gap, XOR with run coding and
no escapes, an overwrite-mode payload with F8_E4M3 / U16 / a 0-d F32 tensor whose
escaped location values take 1 and 4 bytes, and a mixed payload with BF16, F32, F8_E4M3,
F64, a 0-d BF16 tensor, two items of one tensor and escapes of 1 and 2 bytes in items
that share the ``esc.K`` streams) are mutated at random: bit flips, truncation,
insertion, deletion and overwriting of byte ranges.

* Digest intact (the mutated bytes go to the reader as they are): ``read_payload`` +
  ``decode`` + ``apply_items`` either succeed, and then only because the bytes equal
  the original, or raise a :class:`~dcr.errors.PayloadError` or
  :class:`~dcr.errors.TargetMismatch`; never another exception, and the targets are
  untouched whenever an error is raised.
* Re-sealed (the preamble, the header JSON text, the header's structure, the streams'
  raw bytes or the compressed body are mutated and the digest, lengths and ``packed``
  sizes recomputed, so validation past the digest is what is fuzzed): every outcome is a
  :class:`~dcr.errors.DcrError` with the targets untouched, or a successful apply whose
  result equals an independent reference decoding of what the re-sealed payload's
  header and streams describe (positions inside the items' ranges, nonzero XOR masks).

The structured-header fuzzer never replaces the top-level ``items`` with a JSON scalar:
that input crashes the reader with ``TypeError`` (a known bug, pinned by an
``xfail(strict=True)`` test in ``test_payload_attacks.py``).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import struct
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dcr.apply import expand
from dcr.codec.decode import Target, apply_items, decode
from dcr.codec.encode import PayloadBuilder, diff_range, encode_item
from dcr.errors import DcrError, PayloadError, TargetMismatch
from dcr.format.dtypes import DTYPES, dtype
from dcr.format.payload import DEFAULT_LIMITS, DecodeLimits, Payload, read_payload

PREAMBLE = struct.Struct("<8sHHIIQI")
PERSON = b"dcr-payload-v1"
HEAD = 48

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

# Tight enough that the re-sealed fuzzers can reach every limit, loose enough for the cases.
RESEALED_LIMITS = DecodeLimits(max_header_bytes=1 << 16, max_items=64,
                               max_stream_bytes=1 << 20, max_total_bytes=1 << 21,
                               max_elements=1 << 20, max_ndim=4)

# --- the valid payloads ------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    base: Mapping[str, tuple[str, tuple[int, ...], np.ndarray]]  # name -> dtype, shape, flat
    want: Mapping[str, np.ndarray]  # flat bits after a correct apply

    def __repr__(self) -> str:  # short names in hypothesis reports
        return f"Case({self.name})"


def _mix(n: int, width: int, salt: int) -> np.ndarray:
    """Deterministic pseudo-random bits of ``width`` bytes without numpy's RNG."""
    x = (np.arange(n, dtype=np.uint64) + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(29)
    return x.astype(np.dtype(f"<u{width}"))


class _Build:
    def __init__(self, mode: str) -> None:
        self.pb = PayloadBuilder(base_version=3, target_version=4, attempt="fuzz-1",
                                 owner=2, seq=9, mode=mode)
        self.base: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
        self.want: dict[str, np.ndarray] = {}

    def tensor(self, name: str, dt: str, shape: tuple[int, ...], changed: Sequence[int],
               entry: str, *, items: Sequence[tuple[int, int]] | None = None) -> None:
        n = int(np.prod(shape, dtype=np.int64))
        width = DTYPES[dt].itemsize
        base = _mix(n, width, salt=len(self.base) * 1000 + 1)
        new = base.copy()
        flip = _mix(len(changed), width, salt=77) | np.array(1, dtype=base.dtype)
        new[list(changed)] ^= flip
        for lo, hi in items or [(0, n)]:
            d = diff_range(name=name, dtype=dtype(dt), shape=shape, start=lo,
                           base=base[lo:hi], target=new[lo:hi], entry=entry)  # type: ignore[arg-type]
            assert d is not None
            self.pb.add(encode_item(d), dense_bytes=base[lo:hi].nbytes)
        self.base[name] = (dt, shape, base)
        self.want[name] = new

    def case(self, name: str) -> Case:
        return Case(name, self.pb.seal(), self.base, self.want)


def _cases() -> list[Case]:
    out = []
    b = _Build("mixed")
    b.tensor("w", "BF16", (10, 100), [3, 50, 51, 52, 400, 999], "xor")
    out.append(b.case("xor-gaps"))

    b = _Build("mixed")
    b.tensor("f", "F32", (4, 40), [*range(10, 30), *range(100, 140)], "xor")
    out.append(b.case("xor-runs"))

    b = _Build("overwrite")
    # run gaps 5, 339: one escape (339 - 255 = 84), loc_width 1
    b.tensor("e4m3", "F8_E4M3", (500,), [*range(5, 61), *range(400, 411)], "overwrite")
    b.tensor("scalar", "F32", (), [0], "overwrite")
    b.tensor("ids", "U16", (70000,), [0, 69999], "overwrite")  # gap 69998: loc_width 4
    out.append(b.case("overwrite"))

    b = _Build("mixed")
    # w[0:1000] gaps 1, 0, 996 (escape 741, loc_width 2); w[1000:2000] gaps 0, 399
    # (escape 144, loc_width 1): both items share esc.0, only the first has esc.1.
    b.tensor("w", "BF16", (10, 200), [1, 2, 999, 1000, 1400], "xor",
             items=[(0, 1000), (1000, 2000)])
    b.tensor("f", "F32", (4, 40), [*range(0, 16), 159], "xor")
    b.tensor("q", "F8_E4M3", (64,), [0, 9, 63], "overwrite")
    b.tensor("d", "F64", (3, 7), [7, 8, 20], "xor", items=[(7, 21)])
    b.tensor("z", "BF16", (), [0], "xor")
    out.append(b.case("mixed-dtypes"))
    return out


CASES = _cases()


def fresh_targets(case: Case) -> dict[str, Target]:
    return {name: Target(dtype=dt, shape=shape, bits=flat.copy().reshape(shape))
            for name, (dt, shape, flat) in case.base.items()}


def snapshot(targets: Mapping[str, Target]) -> dict[str, bytes]:
    return {name: t.bits.tobytes() for name, t in targets.items()}


def test_cases_decode_to_their_targets() -> None:
    """Control for the fuzzers: every unmutated case applies exactly."""
    assert len({c.name for c in CASES}) == 4
    for case in CASES:
        targets = fresh_targets(case)
        apply_items(decode(read_payload(case.data)), targets)
        for name, want in case.want.items():
            assert np.array_equal(targets[name].bits.reshape(-1), want), (case.name, name)
        assert reference_apply(read_payload(case.data), case).keys() == case.want.keys()


def test_cases_cover_the_codings_and_dtypes() -> None:
    items = [it for c in CASES for it in read_payload(c.data).header.items]
    assert {it.loc for it in items} == {"gaps", "runs"}
    assert {it.entry for it in items} == {"xor", "overwrite"}
    assert {"F32", "F8_E4M3", "BF16", "F64", "U16"} <= {it.dtype for it in items}
    assert () in {it.shape for it in items}
    assert {0, 1, 2, 4} <= {it.loc_width for it in items}
    assert {(it.loc, it.escapes > 0) for it in items} == {
        ("gaps", True), ("gaps", False), ("runs", True), ("runs", False)}
    mixed = read_payload(CASES[3].data).header.items
    assert [(it.where, it.escapes, it.loc_width) for it in mixed if it.escapes] == [
        ("w[0:1000]", 1, 2), ("w[1000:2000]", 1, 1)]


# --- sealing (from FORMAT.md) --------------------------------------------------------------


def _zc(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)


def seal(preamble_fields: Sequence[Any], header_frame: bytes, body: bytes) -> bytes:
    pre = PREAMBLE.pack(*preamble_fields)
    digest = hashlib.blake2b(pre + header_frame + body, digest_size=16, person=PERSON).digest()
    return pre + digest + header_frame + body


def reseal(data: bytes) -> bytes:
    digest = hashlib.blake2b(data[:32] + data[HEAD:], digest_size=16, person=PERSON).digest()
    return data[:32] + digest + data[HEAD:]


def seal_parts(raw_header: bytes, body: bytes) -> bytes:
    """A fresh preamble with lengths that match what follows; magic, version, flags valid."""
    hf = _zc(raw_header)
    return seal((b"\x89DCR\r\n\x1a\n", 1, 0, len(hf), len(raw_header), len(body), 0), hf, body)


def unpack(data: bytes) -> tuple[bytes, dict[str, Any], list[tuple[str, bytes]], bytes]:
    """(raw header JSON, header dict, [(stream id, raw bytes)], compressed body)."""
    h_packed = PREAMBLE.unpack_from(data)[3]
    d = zstandard.ZstdDecompressor()
    raw = d.decompress(data[HEAD : HEAD + h_packed])
    header = json.loads(raw)
    body = data[HEAD + h_packed :]
    streams, off = [], 0
    for s in header["streams"]:
        streams.append((s["id"], d.decompress(body[off : off + s["packed"]])))
        off += s["packed"]
    return raw, header, streams, body


# --- outcome checks ------------------------------------------------------------------------


def attempt(data: bytes, case: Case, limits: DecodeLimits) -> tuple[
        dict[str, Target], Payload | None, Exception | None]:
    """Read, decode, apply; on any DcrError check that the targets were not written."""
    targets = fresh_targets(case)
    before = snapshot(targets)
    err: DcrError | None = None
    payload: Payload | None = None
    try:
        payload = read_payload(data, limits)
        items = decode(payload)
        apply_items(items, targets)
    except DcrError as e:
        err = e
    else:  # the device path's torch expansion must give the same bits
        by_torch = fresh_targets(case)
        expand.apply_items(items, by_torch)
        assert snapshot(by_torch) == snapshot(targets), "torch expansion differs from C"
    if err is not None:
        assert snapshot(targets) == before, f"{type(err).__name__} after writing: {err}"
        return targets, None, err
    return targets, payload, None


def _values(raw: Mapping[str, bytes], cursor: Counter[str], prefix: str, n: int,
            width: int) -> list[int]:
    planes = []
    for k in range(width):
        sid = f"{prefix}.{k}"
        planes.append(raw[sid][cursor[sid] : cursor[sid] + n])
        cursor[sid] += n
    assert all(len(p) == n for p in planes)
    return [sum(planes[k][i] << (8 * k) for k in range(width)) for i in range(n)]


def _locations(raw: Mapping[str, bytes], cursor: Counter[str], n: int, escapes: int,
               width: int) -> list[int]:
    """``n`` one-byte location values from ``loc.0``; each 255 takes the next escape."""
    small = _values(raw, cursor, "loc", n, 1)
    assert small.count(255) == escapes, "escape count differs from the 255 bytes present"
    assert (escapes == 0) == (width == 0)
    rest = iter(_values(raw, cursor, "esc", escapes, width))
    out = [v if v < 255 else next(rest) + 255 for v in small]
    assert next(rest, None) is None
    return out


def _positions(loc: str, locs: list[int], lens: list[int]) -> Iterator[int]:
    if loc == "gaps":
        p = -1
        for g in locs:
            p += g + 1
            yield p
        return
    end = 0
    for g, ln in zip(locs, lens, strict=True):
        first = end + g
        yield from range(first, first + ln + 1)
        end = first + ln + 1


def reference_apply(payload: Payload, case: Case) -> dict[str, np.ndarray]:
    """Decode the payload's streams with plain Python, straight from FORMAT.md."""
    d = zstandard.ZstdDecompressor()
    raw: dict[str, bytes] = {}
    off = payload.body_offset
    for s in payload.header.streams:
        raw[s.id] = d.decompress(bytes(payload.data[off : off + s.packed]))
        off += s.packed
    cursor: Counter[str] = Counter()
    out = {name: flat.copy() for name, (_, _, flat) in case.base.items()}
    for it in payload.header.items:
        locs = _locations(raw, cursor, it.location_values, it.escapes, it.loc_width)
        lens = _values(raw, cursor, "len", it.runs, it.len_width) if it.loc == "runs" else []
        vals = _values(raw, cursor, f"val.{it.entry}.{it.dtype}", it.count,
                       DTYPES[it.dtype].itemsize)
        pos = list(_positions(it.loc, locs, lens))
        assert len(pos) == it.count
        assert all(a < b for a, b in itertools.pairwise(pos))
        assert all(0 <= p < it.stop - it.start for p in pos)
        flat = out[it.name]
        for p, v in zip(pos, vals, strict=True):
            if it.entry == "xor":
                assert v != 0
                flat[it.start + p] ^= flat.dtype.type(v)
            else:
                flat[it.start + p] = v
    assert all(cursor[sid] == len(buf) for sid, buf in raw.items()), "stream bytes left over"
    return out


def check_success(targets: Mapping[str, Target], payload: Payload, case: Case) -> None:
    """A successful apply wrote exactly what the payload describes, inside its items."""
    want = reference_apply(payload, case)
    for name, t in targets.items():
        got = t.bits.reshape(-1)
        assert np.array_equal(got, want[name]), name
        changed = np.flatnonzero(got != case.base[name][2])
        ranges = [(it.start, it.stop) for it in payload.header.items if it.name == name]
        assert all(any(lo <= p < hi for lo, hi in ranges) for p in changed.tolist())


# --- mutation strategies -------------------------------------------------------------------

OPS = ("flip", "truncate", "insert", "delete", "overwrite")


@st.composite
def mutated(draw: st.DrawFn, data: bytes, spans: Sequence[tuple[int, int]],
            ops: Sequence[str] = OPS, max_ops: int = 3) -> bytes:
    """Apply 1..max_ops random edits; each lands in one of ``spans`` (clipped to the data)."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(ops))
        lo, hi = draw(st.sampled_from(spans))
        hi = min(hi, len(buf))
        lo = min(lo, hi)
        pos = draw(st.integers(lo, max(lo, hi - 1)))
        if op == "flip":
            if buf:
                buf[min(pos, len(buf) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del buf[pos : pos + draw(st.integers(1, 16))]
        else:
            chunk = draw(st.binary(min_size=1, max_size=16))
            buf[pos : pos + len(chunk)] = chunk
    return bytes(buf)


def payload_spans(data: bytes) -> list[tuple[int, int]]:
    h_packed = PREAMBLE.unpack_from(data)[3]
    return [(0, 32), (32, HEAD), (HEAD, HEAD + h_packed), (HEAD + h_packed, len(data)),
            (0, len(data) + 1)]


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.sampled_from([0, 1, -1, 2, 3, 255, 256, 65536, 2**31 - 1, 2**31, 2**32, 2**40,
                     2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["xor", "overwrite", "gaps", "runs", "mixed", "BF16", "F32", "U8",
                     "loc.0", "esc.0", "esc.1", "w", "f", "z"]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _parent(root: Any, path: tuple[Any, ...]) -> Any:
    for p in path[:-1]:
        root = root[p]
    return root


@st.composite
def structural_edit(draw: st.DrawFn, header: dict[str, Any]) -> dict[str, Any]:
    """Edit the header's JSON tree: replace, nudge integers, delete, add keys, copy, swap."""
    h = copy.deepcopy(header)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(h))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = _parent(h, path), path[-1]
        op = draw(st.sampled_from(["replace", "nudge", "nudge", "delete", "add", "dup",
                                   "swap"]))
        if op == "nudge" and type(parent[key]) is int:
            parent[key] = parent[key] + draw(st.sampled_from([-256, -2, -1, 1, 2, 255]))
        elif op == "replace" or op == "nudge":
            new = draw(JSON_VALUES)
            if path == ("items",) and not isinstance(new, list | dict | str):
                new = []  # a scalar here is the known TypeError bug; see module docstring
            parent[key] = new
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(JSON_VALUES)
        elif op == "dup" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
            other = draw(st.integers(0, len(parent) - 1))
            parent[key], parent[other] = parent[other], parent[key]
    return h


# --- digest intact -----------------------------------------------------------------------


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_mutated_payload_fails_cleanly_unless_unchanged(case: Case, data: st.DataObject) -> None:
    bad = data.draw(mutated(case.data, payload_spans(case.data)), label="payload")
    targets, payload, err = attempt(bad, case, DEFAULT_LIMITS)
    if err is None:
        assert payload is not None
        assert bad == case.data, "a changed payload was accepted"
        for name, want in case.want.items():
            assert np.array_equal(targets[name].bits.reshape(-1), want)
    else:
        event(type(err).__name__)
        assert isinstance(err, PayloadError | TargetMismatch)
        assert bad != case.data


# --- re-sealed: validation past the digest -------------------------------------------------


def check_resealed(bad: bytes, case: Case) -> None:
    targets, payload, err = attempt(bad, case, RESEALED_LIMITS)
    if err is not None:
        event(type(err).__name__)
        return
    event("applied")
    assert payload is not None
    check_success(targets, payload, case)


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_resealed_preamble_mutation_fails_cleanly(case: Case, data: st.DataObject) -> None:
    bad = data.draw(mutated(case.data, [(0, 32)], ops=("flip", "overwrite")), label="payload")
    bad = reseal(bad[:32] + case.data[32:])  # keep the length; overwrite may run long
    check_resealed(bad, case)


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_resealed_header_text_mutation_fails_cleanly_or_applies_what_it_says(
    case: Case, data: st.DataObject
) -> None:
    raw, _, _, body = unpack(case.data)
    bad_raw = data.draw(mutated(raw, [(0, len(raw) + 1)]), label="header json")
    check_resealed(seal_parts(bad_raw, body), case)


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_resealed_header_structure_edit_fails_cleanly_or_applies_what_it_says(
    case: Case, data: st.DataObject
) -> None:
    _, header, _, body = unpack(case.data)
    edited = data.draw(structural_edit(header), label="header")
    check_resealed(seal_parts(json.dumps(edited).encode(), body), case)


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_resealed_stream_bytes_mutation_fails_cleanly_or_applies_what_it_says(
    case: Case, data: st.DataObject
) -> None:
    _, header, streams, _ = unpack(case.data)
    index = data.draw(st.integers(0, len(streams) - 1), label="stream")
    sid, raw = streams[index]
    new = data.draw(mutated(raw, [(0, len(raw) + 1)], ops=("flip", "overwrite", "overwrite",
                                                            "insert", "delete", "truncate")))
    streams[index] = (sid, new)
    if data.draw(st.booleans(), label="declare new raw size"):
        header["streams"][index]["raw"] = len(new)
    frames = [_zc(s) for _, s in streams]
    for s, f in zip(header["streams"], frames, strict=True):
        s["packed"] = len(f)
    check_resealed(seal_parts(json.dumps(header).encode(), b"".join(frames)), case)


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_resealed_compressed_body_mutation_fails_cleanly_or_applies_what_it_says(
    case: Case, data: st.DataObject
) -> None:
    raw, _, _, body = unpack(case.data)
    bad_body = data.draw(mutated(body, [(0, len(body) + 1)]), label="body")
    check_resealed(seal_parts(raw, bad_body), case)
