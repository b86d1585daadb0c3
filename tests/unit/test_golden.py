"""Golden payloads: byte-exact fixtures that pin format v1 as ``FORMAT.md`` describes it.

Three payloads are built deterministically (arithmetic arrays, fixed attempt id, owner,
seq and versions, zstd level 1) and compared with files committed under
``tests/fixtures/``:

* ``golden_xor_gaps.dcrp``: mode ``mixed``, XOR entries with gap coding (BF16 with one
  gap of 699 escaped in 2 bytes, F32 with no escapes);
* ``golden_runs_overwrite.dcrp``: mode ``overwrite``, run coding (F8_E4M3, a run gap of
  372 escaped in 1 byte), gap coding with a gap of 69996 escaped in 4 bytes (U16), a 0-d
  I64 tensor; the two escaping items share ``esc.0`` while only one reaches ``esc.3``;
* ``golden_mixed_dtypes.dcrp``: mode ``mixed``, XOR and overwrite entries in one
  payload (F16 runs, U8 and BOOL overwrite, F64 sub-range item, BF16 split over two
  items), no location value reaching 255 and so no escape streams.

For each, the tests check that (a) encoding today yields exactly the fixture bytes,
(b) decoding the fixture and applying it to the known base yields the known target bit
for bit, and (c) the preamble fields sit at the offsets FORMAT.md gives (magic, version,
flags, header/body lengths, reserved, digest); the header and the raw location streams
(``loc.0`` bytes with 255 as the escape, ``esc.K`` planes of value - 255) are pinned too.

Regenerate the fixtures (only after a deliberate format or encoder change) with::

    DCR_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_golden.py

Regeneration rewrites only the ``.dcrp`` files; if the base/target arrays themselves
change, update ``TARGET_DIGESTS`` by hand (the failing assertion prints the new value).
The compressed bytes depend on the zstd library bundled with ``zstandard``; if an upgrade
of it alone breaks (a) while (b) and (c) pass, the format is unchanged and regenerating
is safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from dcr.apply import expand
from dcr.codec.decode import Target, apply_items, decode
from dcr.codec.encode import PayloadBuilder, diff_range, encode_item
from dcr.format.dtypes import DTYPES, dtype
from dcr.format.payload import read_payload

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REGEN = os.environ.get("DCR_REGEN_GOLDEN") == "1"


@dataclass(frozen=True)
class Golden:
    data: bytes
    base: dict[str, tuple[str, tuple[int, ...], np.ndarray]]  # name -> dtype, shape, flat bits
    target: dict[str, np.ndarray]  # flat bits


def _bits(n: int, width: int, salt: int) -> np.ndarray:
    """Fixed pseudo-random bits from integer arithmetic only (no RNG, stable forever)."""
    x = (np.arange(n, dtype=np.uint64) + np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(31)
    return x.astype(np.dtype(f"<u{width}"))


class _Payload:
    def __init__(self, mode: str, *, seq: int) -> None:
        self.pb = PayloadBuilder(base_version=4, target_version=5, attempt="a-golden01",
                                 owner=3, seq=seq, mode=mode, level=1)
        self.base: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
        self.target: dict[str, np.ndarray] = {}

    def tensor(self, name: str, dt: str, shape: tuple[int, ...], changed: Sequence[int],
               entry: str, *, items: Sequence[tuple[int, int]] | None = None) -> None:
        n = int(np.prod(shape, dtype=np.int64))
        width = DTYPES[dt].itemsize
        base = _bits(n, width, salt=len(self.base) + 1)
        if dt == "BOOL":
            base &= 1
        new = base.copy()
        if dt == "BOOL":
            new[list(changed)] ^= 1
        else:
            new[list(changed)] ^= _bits(len(changed), width, salt=99) | np.array(1, base.dtype)
        for lo, hi in items or [(0, n)]:
            d = diff_range(name=name, dtype=dtype(dt), shape=shape, start=lo,
                           base=base[lo:hi], target=new[lo:hi], entry=entry)  # type: ignore[arg-type]
            assert d is not None
            self.pb.add(encode_item(d), dense_bytes=base[lo:hi].nbytes)
        self.base[name] = (dt, shape, base)
        self.target[name] = new

    def seal(self) -> Golden:
        return Golden(self.pb.seal(), self.base, self.target)


def xor_gaps() -> Golden:
    p = _Payload("mixed", seq=0)
    p.tensor("model.layers.0.mlp.down_proj.weight", "BF16", (16, 64),
             [0, 5, 77, 78, 300, 1000, 1023], "xor")
    p.tensor("model.norm.weight", "F32", (64,), [31], "xor")
    return p.seal()


def runs_overwrite() -> Golden:
    p = _Payload("overwrite", seq=1)
    p.tensor("lm_head.weight", "F8_E4M3", (32, 32), [*range(64, 128), *range(500, 540)],
             "overwrite")
    p.tensor("model.embed_tokens.ids", "U16", (70000,), [2, 69999], "overwrite")
    p.tensor("step", "I64", (), [0], "overwrite")
    return p.seal()


def mixed_dtypes() -> Golden:
    p = _Payload("mixed", seq=2)
    p.tensor("a.f16", "F16", (8, 16), [*range(0, 20), 64, 127], "xor")
    p.tensor("b.u8", "U8", (50,), [1, 2, 3, 40], "overwrite")
    p.tensor("c.f64", "F64", (4, 5), [11, 19], "xor", items=[(10, 20)])
    p.tensor("d.mask", "BOOL", (30,), [0, 29], "overwrite")
    p.tensor("e.bf16", "BF16", (2, 100), [5, 99, 100, 150], "xor",
             items=[(0, 100), (100, 200)])
    return p.seal()


GOLDEN: dict[str, Callable[[], Golden]] = {
    "golden_xor_gaps.dcrp": xor_gaps,
    "golden_runs_overwrite.dcrp": runs_overwrite,
    "golden_mixed_dtypes.dcrp": mixed_dtypes,
}


def write_fixtures() -> list[Path]:
    """Rebuild every golden payload and write it under ``tests/fixtures/``."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    out = []
    for name, build in GOLDEN.items():
        path = FIXTURES / name
        path.write_bytes(build().data)
        out.append(path)
    return out


@pytest.fixture(scope="module", autouse=True)
def _maybe_regenerate() -> None:
    if REGEN:
        write_fixtures()


def fixture_bytes(name: str) -> bytes:
    path = FIXTURES / name
    assert path.is_file(), f"{path} is missing; run with DCR_REGEN_GOLDEN=1 to create it"
    return path.read_bytes()


NAMES = list(GOLDEN)

# --- (a) encoding today is byte-identical ---------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_encoding_today_reproduces_the_fixture_bytes(name: str) -> None:
    built = GOLDEN[name]().data
    want = fixture_bytes(name)
    assert len(built) == len(want), f"zstd {zstandard.ZSTD_VERSION}"
    assert built == want, f"first difference at byte {_first_diff(built, want)}"


@pytest.mark.parametrize("name", NAMES)
def test_encoding_is_deterministic_within_a_process(name: str) -> None:
    assert GOLDEN[name]().data == GOLDEN[name]().data


def _first_diff(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


# --- (b) the fixture decodes to the known target -------------------------------------------


@pytest.mark.parametrize("kernel", ["c", "device"])
@pytest.mark.parametrize("name", NAMES)
def test_fixture_applied_to_known_base_gives_known_target(name: str, kernel: str) -> None:
    """Through the codec's C kernel, and through the torch expansion of the applier's
    device path (``dcr.apply.expand``)."""
    golden = GOLDEN[name]()
    targets = {n: Target(dtype=dt, shape=shape, bits=flat.copy().reshape(shape))
               for n, (dt, shape, flat) in golden.base.items()}
    items = decode(read_payload(fixture_bytes(name)))
    records = (apply_items if kernel == "c" else expand.apply_items)(items, targets)
    assert records == sum(int(np.count_nonzero(golden.base[n][2] != t))
                          for n, t in golden.target.items())
    for n, want in golden.target.items():
        got = targets[n].bits.reshape(-1)
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes(), n


# Digests of the known targets, pinned so that (b) does not rest on the generator alone.
TARGET_DIGESTS = {
    "golden_xor_gaps.dcrp": "2badf334bd2c69c2a328b63e4b85d133",
    "golden_runs_overwrite.dcrp": "439f66662797489665c431e86bfa8d82",
    "golden_mixed_dtypes.dcrp": "136c31b2873495b10d3a81b40ab134df",
}


def _targets_digest(golden: Golden) -> str:
    h = hashlib.blake2b(digest_size=16)
    for n in sorted(golden.target):
        h.update(n.encode() + b"\0" + golden.base[n][2].tobytes() + golden.target[n].tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", NAMES)
def test_known_base_and_target_arrays_are_the_pinned_ones(name: str) -> None:
    assert _targets_digest(GOLDEN[name]()) == TARGET_DIGESTS[name]


# --- (c) preamble fields at the offsets FORMAT.md gives ------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_fixture_preamble_fields_sit_at_their_documented_offsets(name: str) -> None:
    data = fixture_bytes(name)
    assert data[0:8] == bytes([0x89, 0x44, 0x43, 0x52, 0x0D, 0x0A, 0x1A, 0x0A])
    assert data[0:8] == b"\x89DCR\r\n\x1a\n"
    assert int.from_bytes(data[8:10], "little") == 1  # format_version
    assert int.from_bytes(data[10:12], "little") == 0  # flags
    h_packed = int.from_bytes(data[12:16], "little")
    h_raw = int.from_bytes(data[16:20], "little")
    body = int.from_bytes(data[20:28], "little")
    assert int.from_bytes(data[28:32], "little") == 0  # reserved
    assert struct.unpack_from("<8sHHIIQI", data) == (
        b"\x89DCR\r\n\x1a\n", 1, 0, h_packed, h_raw, body, 0)
    assert len(data) == 48 + h_packed + body

    digest = hashlib.blake2b(data[:32] + data[48:], digest_size=16,
                             person=b"dcr-payload-v1").digest()
    assert data[32:48] == digest

    frame = data[48 : 48 + h_packed]
    assert zstandard.frame_content_size(frame) == h_raw
    raw = zstandard.ZstdDecompressor().decompress(frame)
    assert len(raw) == h_raw
    header = json.loads(raw.decode("utf-8"))
    assert sum(s["packed"] for s in header["streams"]) == body

    # Each stream frame records its content size, equal to the header's ``raw``.
    off = 48 + h_packed
    for s in header["streams"]:
        assert zstandard.frame_content_size(data[off : off + s["packed"]]) == s["raw"]
        off += s["packed"]
    assert off == len(data)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_header_identifies_the_payload(name: str) -> None:
    header = read_payload(fixture_bytes(name)).header
    assert (header.base_version, header.target_version) == (4, 5)
    assert (header.attempt, header.owner) == ("a-golden01", 3)
    assert header.seq == NAMES.index(name)
    assert header.mode == ("overwrite" if name == "golden_runs_overwrite.dcrp" else "mixed")


def test_xor_gaps_fixture_header_matches_the_spec_example_shape() -> None:
    header = read_payload(fixture_bytes("golden_xor_gaps.dcrp")).header
    w, norm = header.items
    assert (w.name, w.dtype, w.shape, w.start, w.stop) == (
        "model.layers.0.mlp.down_proj.weight", "BF16", (16, 64), 0, 1024)
    # gaps 0, 4, 71, 0, 221, 699, 22: one escape, 699 - 255 = 444 needs 2 bytes
    assert (w.entry, w.loc, w.count, w.runs, w.escapes, w.loc_width, w.len_width) == (
        "xor", "gaps", 7, 0, 1, 2, 0)
    assert (norm.loc, norm.count, norm.escapes, norm.loc_width) == ("gaps", 1, 0, 0)
    assert [(s.id, s.raw) for s in header.streams] == [
        ("loc.0", 8), ("esc.0", 1), ("esc.1", 1),
        ("val.xor.BF16.0", 7), ("val.xor.BF16.1", 7),
        ("val.xor.F32.0", 1), ("val.xor.F32.1", 1), ("val.xor.F32.2", 1), ("val.xor.F32.3", 1),
    ]


def test_runs_overwrite_fixture_uses_runs_and_one_and_four_byte_escapes() -> None:
    header = read_payload(fixture_bytes("golden_runs_overwrite.dcrp")).header
    lm, ids, step = header.items
    # run gaps 64, 372 (one escape: 117, 1 byte), run lengths 63, 39
    assert (lm.loc, lm.count, lm.runs, lm.entry) == ("runs", 104, 2, "overwrite")
    assert (lm.escapes, lm.loc_width, lm.len_width) == (1, 1, 1)
    # gaps 2, 69996 (one escape: 69741, 4 bytes)
    assert (ids.loc, ids.escapes, ids.loc_width, ids.count) == ("gaps", 1, 4, 2)
    assert (step.shape, step.start, step.stop, step.count) == ((), 0, 1, 1)
    assert (step.escapes, step.loc_width) == (0, 0)
    assert [(s.id, s.raw) for s in header.streams] == [
        ("loc.0", 5), ("esc.0", 2), ("esc.1", 1), ("esc.2", 1), ("esc.3", 1), ("len.0", 2),
        ("val.overwrite.F8_E4M3.0", 104),
        *((f"val.overwrite.I64.{k}", 1) for k in range(8)),
        ("val.overwrite.U16.0", 2), ("val.overwrite.U16.1", 2),
    ]


def test_mixed_dtypes_fixture_has_no_escapes() -> None:
    header = read_payload(fixture_bytes("golden_mixed_dtypes.dcrp")).header
    assert len(header.items) == 6
    assert all((it.escapes, it.loc_width) == (0, 0) for it in header.items)
    assert {it.loc for it in header.items} == {"gaps", "runs"}
    ids = [s.id for s in header.streams]
    assert ids[:2] == ["loc.0", "len.0"]
    assert not [sid for sid in ids if sid.startswith("esc.")]


def _raw_streams(data: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The header JSON and every stream's raw bytes, read straight from FORMAT.md."""
    h_packed = int.from_bytes(data[12:16], "little")
    d = zstandard.ZstdDecompressor()
    header = json.loads(d.decompress(data[48 : 48 + h_packed]))
    streams, off = {}, 48 + h_packed
    for s in header["streams"]:
        streams[s["id"]] = d.decompress(data[off : off + s["packed"]])
        off += s["packed"]
    return header, streams


def _planes(planes: Sequence[bytes]) -> list[int]:
    return [sum(p[i] << (8 * k) for k, p in enumerate(planes)) for i in range(len(planes[0]))]


@pytest.mark.parametrize(("name", "loc0", "esc", "items"), [
    # w: gaps 0,4,71,0,221,699,22 (699 -> 255 + 444); norm: gap 31
    ("golden_xor_gaps.dcrp", [0, 4, 71, 0, 221, 255, 22, 31], [[444]],
     [(0, 0, 1, 2), (1, 0, 0, 0)]),
    # lm_head: run gaps 64, 372 (-> 255 + 117); ids: gaps 2, 69996 (-> 255 + 69741); step: 0
    ("golden_runs_overwrite.dcrp", [64, 255, 2, 255, 0], [[117], [69741]],
     [(0, 0, 1, 1), (1, 0, 1, 4), (2, 0, 0, 0)]),
    # a.f16 run gaps 0, 44, 62; b.u8 1,0,0,36; c.f64 1,7; d.mask 0,28; e.bf16 5,93 and 0,49
    ("golden_mixed_dtypes.dcrp", [0, 44, 62, 1, 0, 0, 36, 1, 7, 0, 28, 5, 93, 0, 49], [],
     [(i, 0, 0, 0) for i in range(6)]),
])
def test_fixture_location_streams_hold_the_escape_coding(
    name: str, loc0: list[int], esc: list[list[int]], items: list[tuple[int, int, int, int]]
) -> None:
    """loc.0 holds each location value or 255; esc.K holds plane K of (value - 255),
    items in header order, each item contributing to the planes below its loc_width."""
    header, streams = _raw_streams(fixture_bytes(name))
    assert list(streams["loc.0"]) == loc0
    hitems = header["items"]
    for i, _, escapes, width in items:
        assert (hitems[i]["escapes"], hitems[i]["loc_width"]) == (escapes, width)
    assert sum(it["escapes"] for it in hitems) == loc0.count(255)
    # Decode every item's escapes from the shared planes, cursor per plane.
    cursor = dict.fromkeys(streams, 0)
    got = []
    for it in hitems:
        if not it["escapes"]:
            continue
        planes = []
        for k in range(it["loc_width"]):
            sid = f"esc.{k}"
            planes.append(streams[sid][cursor[sid] : cursor[sid] + it["escapes"]])
            cursor[sid] += it["escapes"]
        got.append(_planes(planes))
        # loc_width is the smallest width that holds the item's largest escaped value
        widest = max(got[-1])
        assert it["loc_width"] == next(w for w in (1, 2, 4, 8) if widest < 1 << (8 * w))
    assert got == esc
    assert all(cursor[s] == len(streams[s]) for s in streams if s.startswith("esc."))
