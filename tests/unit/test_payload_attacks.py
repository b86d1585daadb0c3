"""Hostile payloads: every way a payload can be wrong is rejected with the right error.

Covers the reader's whole validation order from ``agent/dcr/format/FORMAT.md``: framing (length,
magic, version, flags, reserved), the BLAKE2b digest, the compressed JSON header (schema,
unknown fields, item rules, disjoint items, the stream list the items imply), decode
limits (header size, item count, elements, dims, stream and total sizes: bomb guards),
each zstd stream frame, per-record checks (escape counts against the 255 bytes in
``loc.0``, escaped location values, locations past ``stop``, run lengths, zero XOR
masks), and the checks against the target tensors (missing, wrong dtype or shape,
read-only, non-contiguous), including items of two payloads that overlap when applied
together.

Every case asserts three things: the exact error class from :mod:`dcr.errors`, that the
message names the offending value, and that every target array is byte-for-byte as it
was. Most hostile payloads carry a *valid* digest (re-sealed here exactly as FORMAT.md
describes), so the checks after the digest are what rejects them.

Cases found by this suite (non-dict "items", deep nesting, huge integers, coerced types,
UTF-16 headers) are kept as regression tests.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import struct
import sys
import tracemalloc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import zstandard
from pydantic import ValidationError

from dcr.apply import expand
from dcr.codec.decode import DecodedItem, Target, apply_items, decode
from dcr.codec.encode import PayloadBuilder, diff_range, encode_item
from dcr.errors import (
    DigestMismatch,
    LimitExceeded,
    MalformedPayload,
    TargetMismatch,
    TruncatedPayload,
)
from dcr.format.dtypes import dtype
from dcr.format.payload import (
    DEFAULT_LIMITS,
    MAGIC,
    DecodeLimits,
    ItemHeader,
    pack_payload,
    read_payload,
)

PREAMBLE = struct.Struct("<8sHHIIQI")  # FORMAT.md: magic, version, flags, H, raw, B, reserved
PERSON = b"dcr-payload-v1"
HEAD = 48  # preamble + digest

# --- sealing helpers (written from FORMAT.md, independent of the library's writer) ------


def seal(
    header_frame: bytes,
    body: bytes,
    *,
    header_raw: int,
    magic: bytes = MAGIC,
    version: int = 1,
    flags: int = 0,
    reserved: int = 0,
    header_packed: int | None = None,
    body_length: int | None = None,
) -> bytes:
    """Assemble preamble + BLAKE2b digest + header frame + body, digest always valid."""
    pre = PREAMBLE.pack(
        magic,
        version,
        flags,
        len(header_frame) if header_packed is None else header_packed,
        header_raw,
        len(body) if body_length is None else body_length,
        reserved,
    )
    digest = hashlib.blake2b(pre + header_frame + body, digest_size=16, person=PERSON).digest()
    return pre + digest + header_frame + body


def reseal(data: bytes | bytearray) -> bytes:
    """Recompute the digest of (possibly edited) bytes, keeping every other byte."""
    data = bytes(data)
    digest = hashlib.blake2b(
        data[:32] + data[HEAD:], digest_size=16, person=PERSON
    ).digest()
    return data[:32] + digest + data[HEAD:]


def zc(raw: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=content_size).compress(raw)


def split(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(preamble, header frame, body) of a well-framed payload."""
    h_packed = PREAMBLE.unpack_from(data)[3]
    return data[:32], data[HEAD : HEAD + h_packed], data[HEAD + h_packed :]


def unpack(data: bytes) -> tuple[dict[str, Any], dict[str, bytearray]]:
    """The header as a JSON dict and every stream's raw bytes, in body order."""
    _, header_frame, body = split(data)
    d = zstandard.ZstdDecompressor()
    header = json.loads(d.decompress(header_frame))
    streams: dict[str, bytearray] = {}
    off = 0
    for s in header["streams"]:
        streams[s["id"]] = bytearray(d.decompress(body[off : off + s["packed"]]))
        off += s["packed"]
    return header, streams


def repack(
    header: Mapping[str, Any],
    streams: Mapping[str, bytes | bytearray],
    *,
    fix_packed: bool = True,
    raw_header: bytes | None = None,
) -> bytes:
    """Compress streams (in the mapping's order) and header, fix ``packed``, re-seal."""
    header = copy.deepcopy(dict(header))
    frames = {sid: zc(bytes(raw)) for sid, raw in streams.items()}
    if fix_packed and isinstance(header.get("streams"), list):
        for s in header["streams"]:
            if s["id"] in frames:
                s["packed"] = len(frames[s["id"]])
    if raw_header is None:
        raw_header = json.dumps(header).encode()
    return seal(zc(raw_header), b"".join(frames.values()), header_raw=len(raw_header))


def edit(
    data: bytes,
    header_fn: Callable[[dict[str, Any]], object] | None = None,
    streams_fn: Callable[[dict[str, bytearray]], object] | None = None,
) -> bytes:
    """Unpack, let the callers mutate header dict / stream bytes in place, re-seal."""
    header, streams = unpack(data)
    if header_fn is not None:
        header_fn(header)
    if streams_fn is not None:
        streams_fn(streams)
    return repack(header, streams)


def set_planes(streams: dict[str, bytearray], prefix: str, width: int, index: int,
               value: int) -> None:
    """Set record ``index`` of the byte-planed value sequence ``prefix.0 .. prefix.{w-1}``."""
    for k in range(width):
        streams[f"{prefix}.{k}"][index] = (value >> (8 * k)) & 0xFF


def get_planes(streams: Mapping[str, bytes | bytearray], prefix: str, width: int) -> list[int]:
    """Every value of the byte-planed sequence ``prefix.0 .. prefix.{w-1}``."""
    n = len(streams[f"{prefix}.0"])
    return [sum(streams[f"{prefix}.{k}"][i] << (8 * k) for k in range(width)) for i in range(n)]


ESCAPE = 255  # FORMAT.md: a loc.0 byte of 255 sends the value (minus 255) to esc.K


def locations_of(streams: Mapping[str, bytes | bytearray], loc_width: int) -> list[int]:
    """The location values of a one-item payload, decoded from loc.0 and esc.K (FORMAT.md)."""
    escaped = iter(get_planes(streams, "esc", loc_width) if loc_width else [])
    out = [v if v < ESCAPE else next(escaped) + ESCAPE for v in streams["loc.0"]]
    assert next(escaped, None) is None
    return out


def set_locations(header: dict[str, Any], streams: dict[str, bytearray],
                  values: list[int]) -> None:
    """Re-code every location value of a one-item payload as FORMAT.md says.

    Rewrites ``loc.0`` and the ``esc.K`` planes (smallest width that fits the largest
    escaped value), the item's ``escapes`` and ``loc_width``, and the header's stream list
    (ids in body order, ``raw`` sizes; ``repack`` fixes ``packed``).
    """
    assert len(header["items"]) == 1
    escaped = [v - ESCAPE for v in values if v >= ESCAPE]
    width = 0 if not escaped else next(w for w in (1, 2, 4, 8) if max(escaped) < 1 << (8 * w))
    rest = {sid: b for sid, b in streams.items() if sid.split(".")[0] not in ("loc", "esc")}
    streams.clear()
    streams["loc.0"] = bytearray(min(v, ESCAPE) for v in values)
    for k in range(width):
        streams[f"esc.{k}"] = bytearray((v >> (8 * k)) & 0xFF for v in escaped)
    streams.update(rest)
    header["items"][0]["escapes"] = len(escaped)
    header["items"][0]["loc_width"] = width
    sync_raw(header, streams)


def sync_raw(header: dict[str, Any], streams: Mapping[str, bytes | bytearray]) -> None:
    """Make the header's stream list the streams' ids and sizes, in the mapping's order."""
    header["streams"] = [{"id": sid, "raw": len(b), "packed": 1} for sid, b in streams.items()]


# --- good payloads ---------------------------------------------------------------------


@dataclass(frozen=True)
class Good:
    data: bytes
    base: dict[str, tuple[str, tuple[int, ...], np.ndarray]]  # name -> dtype, shape, bits
    target: dict[str, np.ndarray]


def _bf16_base() -> np.ndarray:
    return ((np.arange(1000, dtype=np.uint32) * 40503) % 65521).astype(np.uint16)


def _builder(mode: str = "mixed", *, owner: int = 0, seq: int = 0) -> PayloadBuilder:
    return PayloadBuilder(
        base_version=1, target_version=2, attempt="a-1", owner=owner, seq=seq, mode=mode
    )


def xor_gaps() -> Good:
    """BF16 w[10,100], five scattered changes: gap coding (gaps 3,46,0,0,946).

    The gap 946 is escaped: loc.0 holds 3,46,0,0,255 and esc.0/esc.1 hold 946 - 255 = 691
    (escapes 1, loc_width 2). Streams: loc.0 (5), esc.0 (1), esc.1 (1), val.xor.BF16.0
    and .1 (5 each).
    """
    base = _bf16_base()
    target = base.copy()
    target[[3, 50, 51, 52, 999]] ^= 0x0101
    d = diff_range(name="w", dtype=dtype("BF16"), shape=(10, 100), start=0, base=base,
                   target=target, entry="xor")
    assert d is not None
    pb = _builder()
    pb.add(encode_item(d), dense_bytes=base.nbytes)
    return Good(pb.seal(), {"w": ("BF16", (10, 100), base)}, {"w": target})


def xor_runs() -> Good:
    """F32 r[4,40], changes at 10..29 and 100..139: run coding (gaps 10,70; lens 19,39).

    No location value reaches 255: escapes 0, loc_width 0, no esc streams.
    """
    base = (np.arange(160, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
    target = base.copy()
    target[10:30] ^= 0x80000001
    target[100:140] ^= 0x00010000
    d = diff_range(name="r", dtype=dtype("F32"), shape=(4, 40), start=0, base=base,
                   target=target, entry="xor")
    assert d is not None
    pb = _builder()
    pb.add(encode_item(d), dense_bytes=base.nbytes)
    return Good(pb.seal(), {"r": ("F32", (4, 40), base)}, {"r": target})


def xor_runs_far() -> Good:
    """F32 r[4,100], changes at 10..29 and 300..339: run coding with an escaped run gap.

    Run gaps 10, 270 (loc.0 10,255; esc.0 270 - 255 = 15: escapes 1, loc_width 1), lengths
    19, 39. Streams: loc.0 (2), esc.0 (1), len.0 (2), val.xor.F32.0..3 (60 each).
    """
    base = (np.arange(400, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
    target = base.copy()
    target[10:30] ^= 0x80000001
    target[300:340] ^= 0x00010000
    d = diff_range(name="r", dtype=dtype("F32"), shape=(4, 100), start=0, base=base,
                   target=target, entry="xor")
    assert d is not None
    pb = _builder()
    pb.add(encode_item(d), dense_bytes=base.nbytes)
    return Good(pb.seal(), {"r": ("F32", (4, 100), base)}, {"r": target})


def two_tensors(*, owner: int = 0, w_start: int = 0) -> Good:
    """Tensor ``a`` (F8_E4M3, overwrite) and BF16 ``w`` from ``w_start`` on (XOR)."""
    a = np.arange(64, dtype=np.uint8)
    a_new = a.copy()
    a_new[[0, 7, 63]] = [0x7F, 0x00, 0x38]
    w = _bf16_base()
    w_new = w.copy()
    w_new[[3, 600, 999]] ^= 0x8000
    pb = _builder(owner=owner)
    da = diff_range(name="a", dtype=dtype("F8_E4M3"), shape=(64,), start=0, base=a,
                    target=a_new, entry="overwrite")
    dw = diff_range(name="w", dtype=dtype("BF16"), shape=(10, 100), start=w_start,
                    base=w[w_start:], target=w_new[w_start:], entry="xor")
    assert da is not None
    assert dw is not None
    pb.add(encode_item(da), dense_bytes=a.nbytes)
    pb.add(encode_item(dw), dense_bytes=w.nbytes)
    return Good(
        pb.seal(),
        {"a": ("F8_E4M3", (64,), a), "w": ("BF16", (10, 100), w)},
        {"a": a_new, "w": w_new},
    )


def targets_for(good: Good) -> dict[str, Target]:
    return {
        name: Target(dtype=dt, shape=shape, bits=bits.copy().reshape(shape))
        for name, (dt, shape, bits) in good.base.items()
    }


# Every case runs through both kernels: the codec's C scatter, and the torch expansion the
# applier's device path uses (dcr.apply.expand); both must refuse the same bytes the same way.
KERNELS: dict[str, Callable[[list[DecodedItem], Mapping[str, Target]], int]] = {
    "c": apply_items, "device": expand.apply_items}
_kernel = apply_items


@pytest.fixture(autouse=True, params=sorted(KERNELS))
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sys.modules[__name__], "_kernel", KERNELS[request.param])
    return str(request.param)


def run(data: bytes, targets: Mapping[str, Target],
        limits: DecodeLimits = DEFAULT_LIMITS) -> int:
    return _kernel(decode(read_payload(data, limits)), targets)


def assert_rejected(
    err: type[Exception],
    action: Callable[[], object],
    targets: Mapping[str, Target],
    *needles: object,
) -> Exception:
    """``action`` raises exactly ``err`` naming every needle; ``targets`` stay untouched."""
    before = {name: t.bits.copy() for name, t in targets.items()}
    with pytest.raises(err) as info:
        action()
    exc = info.value
    assert type(exc) is err, f"raised {type(exc).__name__}, want {err.__name__}: {exc}"
    msg = str(exc)
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in message {msg!r}"
    for name, t in targets.items():
        assert t.bits.dtype == before[name].dtype
        assert t.bits.tobytes() == before[name].tobytes(), f"target {name!r} was written"
    return exc


def reject(
    err: type[Exception],
    data: bytes,
    *needles: object,
    good: Good | None = None,
    limits: DecodeLimits = DEFAULT_LIMITS,
) -> Exception:
    targets = targets_for(good if good is not None else xor_gaps())
    return assert_rejected(err, lambda: run(data, targets, limits), targets, *needles)


# --- controls: the helpers themselves produce payloads the reader accepts ---------------


@pytest.mark.parametrize("make", [xor_gaps, xor_runs, xor_runs_far, two_tensors])
def test_good_payload_applies_exactly(make: Callable[[], Good]) -> None:
    good = make()
    targets = targets_for(good)
    assert run(good.data, targets) > 0
    for name, want in good.target.items():
        assert np.array_equal(targets[name].bits.reshape(-1), want)


@pytest.mark.parametrize("make", [xor_gaps, xor_runs, xor_runs_far, two_tensors])
def test_repacked_unmodified_payload_still_applies(make: Callable[[], Good]) -> None:
    good = make()
    assert reseal(good.data) == good.data
    repacked = edit(good.data)
    targets = targets_for(good)
    run(repacked, targets)
    for name, want in good.target.items():
        assert np.array_equal(targets[name].bits.reshape(-1), want)


def test_gaps_and_runs_fixtures_use_the_codings_the_attacks_assume() -> None:
    hg, sg = unpack(xor_gaps().data)
    it = hg["items"][0]
    assert (it["loc"], it["count"], it["escapes"], it["loc_width"]) == ("gaps", 5, 1, 2)
    assert list(sg) == ["loc.0", "esc.0", "esc.1", "val.xor.BF16.0", "val.xor.BF16.1"]
    assert list(sg["loc.0"]) == [3, 46, 0, 0, 255]
    assert get_planes(sg, "esc", 2) == [691]
    assert locations_of(sg, 2) == [3, 46, 0, 0, 946]
    hr, sr = unpack(xor_runs().data)
    it = hr["items"][0]
    assert (it["loc"], it["runs"], it["escapes"], it["loc_width"], it["len_width"]) == (
        "runs", 2, 0, 0, 1)
    assert list(sr) == ["loc.0", "len.0", *(f"val.xor.F32.{k}" for k in range(4))]
    assert list(sr["loc.0"]) == [10, 70]
    assert list(sr["len.0"]) == [19, 39]
    hf, sf = unpack(xor_runs_far().data)
    it = hf["items"][0]
    assert (it["loc"], it["runs"], it["escapes"], it["loc_width"], it["len_width"]) == (
        "runs", 2, 1, 1, 1)
    assert list(sf) == ["loc.0", "esc.0", "len.0", *(f"val.xor.F32.{k}" for k in range(4))]
    assert list(sf["loc.0"]) == [10, 255]
    assert list(sf["esc.0"]) == [15]
    assert list(sf["len.0"]) == [19, 39]


def test_set_locations_codes_exactly_what_the_writer_codes() -> None:
    """Control for the attacks below: the hand-written location coder matches the writer."""
    for make in (xor_gaps, xor_runs, xor_runs_far):
        header, streams = unpack(make().data)
        want_header, want_streams = copy.deepcopy(header), dict(streams)
        set_locations(header, streams, locations_of(streams, header["items"][0]["loc_width"]))
        assert streams == want_streams
        assert list(streams) == list(want_streams)
        for s in (*header["streams"], *want_header["streams"]):
            del s["packed"]
        assert header == want_header


# --- framing: length, magic, version, flags, reserved -----------------------------------


def test_empty_input_is_truncated() -> None:
    reject(TruncatedPayload, b"", "0 bytes", "48-byte preamble")


def test_input_shorter_than_preamble_is_truncated() -> None:
    reject(TruncatedPayload, xor_gaps().data[:47], "47 bytes")


def test_payload_missing_its_last_byte_is_truncated() -> None:
    data = xor_gaps().data
    reject(TruncatedPayload, data[:-1], f"{len(data) - 1} bytes", f"declares {len(data)}")


def test_payload_with_one_extra_trailing_byte_is_rejected_as_wrong_length() -> None:
    data = xor_gaps().data
    reject(TruncatedPayload, data + b"\x00", f"{len(data) + 1} bytes", f"declares {len(data)}")


def test_body_length_near_u64_max_is_truncated_not_overflowed() -> None:
    pre, hf, body = split(xor_gaps().data)
    raw = PREAMBLE.unpack(pre)[4]
    data = seal(hf, body, header_raw=raw, body_length=2**64 - 1)
    reject(TruncatedPayload, data, str(2**64 - 1))


def test_wrong_magic_is_rejected_even_with_valid_digest() -> None:
    pre, hf, body = split(xor_gaps().data)
    bad = b"\x89DCR\n\x1a\n\x00"  # newline translation ate the CR
    data = seal(hf, body, header_raw=PREAMBLE.unpack(pre)[4], magic=bad)
    reject(MalformedPayload, data, repr(bad))


def test_seven_bit_channel_magic_is_rejected() -> None:
    data = bytearray(xor_gaps().data)
    data[0] &= 0x7F
    reject(MalformedPayload, reseal(data), repr(bytes(data[:8])))


@pytest.mark.parametrize("version", [0, 2, 0xFFFF])
def test_unsupported_format_version_is_rejected(version: int) -> None:
    pre, hf, body = split(xor_gaps().data)
    data = seal(hf, body, header_raw=PREAMBLE.unpack(pre)[4], version=version)
    reject(MalformedPayload, data, f"version {version}")


@pytest.mark.parametrize(("flags", "reserved"), [(1, 0), (0x8000, 0), (0, 7), (0, 2**32 - 1)])
def test_nonzero_flags_or_reserved_are_rejected(flags: int, reserved: int) -> None:
    pre, hf, body = split(xor_gaps().data)
    data = seal(hf, body, header_raw=PREAMBLE.unpack(pre)[4], flags=flags, reserved=reserved)
    reject(MalformedPayload, data, f"flags={flags}", f"reserved={reserved}")


# --- digest ---------------------------------------------------------------------------


def _flip(data: bytes, offset: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[offset] ^= 1 << bit
    return bytes(out)


@pytest.mark.parametrize("region", ["digest", "header-first", "header-last", "body-first",
                                    "body-middle", "body-last"])
def test_flipped_bit_after_the_preamble_is_a_digest_mismatch(region: str) -> None:
    data = xor_gaps().data
    h_packed = PREAMBLE.unpack_from(data)[3]
    offset = {
        "digest": 40,
        "header-first": HEAD,
        "header-last": HEAD + h_packed - 1,
        "body-first": HEAD + h_packed,
        "body-middle": (HEAD + h_packed + len(data)) // 2,
        "body-last": len(data) - 1,
    }[region]
    bad = _flip(data, offset, 3)
    reject(DigestMismatch, bad, f"expected {bad[32:48].hex()}")


def test_flipped_bit_in_header_raw_field_is_a_digest_mismatch() -> None:
    data = xor_gaps().data
    reject(DigestMismatch, _flip(data, 16), data[32:48].hex())


def test_flipped_length_field_without_reseal_is_truncated() -> None:
    data = xor_gaps().data
    reject(TruncatedPayload, _flip(data, 20), f"{len(data)} bytes")


# --- header frame and decode limits ----------------------------------------------------


def test_header_over_max_header_bytes_is_a_limit_not_a_decompression() -> None:
    data = xor_gaps().data
    raw = PREAMBLE.unpack_from(data)[4]
    assert raw > 100
    reject(LimitExceeded, data, str(raw), "limit of 100",
           limits=DecodeLimits(max_header_bytes=100))


def test_header_bomb_declared_in_preamble_is_refused_before_decompressing() -> None:
    # An 8 MiB header of spaces compresses to a few hundred bytes.
    bomb = zc(b" " * (8 << 20))
    assert len(bomb) < 4096
    data = seal(bomb, b"", header_raw=8 << 20)
    reject(LimitExceeded, data, str(8 << 20), str(1 << 20),
           limits=DecodeLimits(max_header_bytes=1 << 20))


def test_header_frame_content_size_disagreeing_with_preamble_is_malformed() -> None:
    pre, hf, body = split(xor_gaps().data)
    raw = PREAMBLE.unpack(pre)[4]
    data = seal(hf, body, header_raw=raw - 1)
    reject(MalformedPayload, data, f"declares {raw} bytes", f"says {raw - 1}")


def test_header_frame_without_content_size_is_malformed() -> None:
    _, hf, body = split(xor_gaps().data)
    raw = zstandard.ZstdDecompressor().decompress(hf)
    data = seal(zc(raw, content_size=False), body, header_raw=len(raw))
    reject(MalformedPayload, data, "header frame declares -1 bytes", str(len(raw)))


def test_header_boundary_shifted_into_the_body_is_malformed() -> None:
    pre, hf, body = split(xor_gaps().data)
    raw = PREAMBLE.unpack(pre)[4]
    # One byte of the header frame is declared as body: same total length, valid digest.
    data = seal(hf[:-1], hf[-1:] + body, header_raw=raw)
    reject(MalformedPayload, data, "header")


def test_header_that_is_not_a_zstd_frame_is_malformed() -> None:
    raw = b'{"not": "compressed"}'
    data = seal(raw, b"", header_raw=len(raw))
    reject(MalformedPayload, data, "header is not a zstd frame")


def test_header_that_is_not_json_is_malformed() -> None:
    data = repack({}, {}, raw_header=b"items: [w]")
    reject(MalformedPayload, data, "not valid JSON", "column 1")


def test_header_that_is_not_utf8_is_malformed() -> None:
    data = repack({}, {}, raw_header=b'{"attempt": "\xff\xfe"}')
    reject(MalformedPayload, data, "not valid JSON", "column")


def test_header_json_that_is_a_list_is_malformed() -> None:
    data = repack({}, {}, raw_header=b"[1, 2, 3]")
    reject(MalformedPayload, data, "Payload header is invalid")


@pytest.mark.parametrize("where", ["top", "item", "stream"])
def test_header_with_an_unknown_field_is_malformed(where: str) -> None:
    def add(h: dict[str, Any]) -> None:
        {"top": h, "item": h["items"][0], "stream": h["streams"][0]}[where]["sneaky"] = 1

    reject(MalformedPayload, edit(xor_gaps().data, add), "sneaky", "Extra inputs")


def test_stream_with_zero_packed_size_is_malformed() -> None:
    header, streams = unpack(xor_gaps().data)
    header["streams"][0]["packed"] = 0
    data = repack(header, streams, fix_packed=False)
    reject(MalformedPayload, data, "streams.0.packed", "greater than or equal to 1")


def test_header_missing_a_field_is_malformed() -> None:
    reject(MalformedPayload, edit(xor_gaps().data, lambda h: h.pop("seq")), "seq", "required")


def test_too_many_items_is_a_limit() -> None:
    reject(LimitExceeded, two_tensors().data, "2 items", "limit of 1",
           good=two_tensors(), limits=DecodeLimits(max_items=1))


def _many_items_payload(n: int) -> tuple[bytes, int]:
    """A consistent payload of ``n`` one-element overwrite items; its raw header size."""
    one = ('{{"name": "t{}", "dtype": "U8", "shape": [1], "start": 0, "stop": 1, '
           '"entry": "overwrite", "loc": "gaps", "count": 1, "runs": 0, "escapes": 0, '
           '"loc_width": 0, "len_width": 0}}')
    loc, val = zc(bytes(n)), zc(b"\x01" * n)
    raw = ('{"base_version": 1, "target_version": 2, "attempt": "a-1", "owner": 0, "seq": 0, '
           '"mode": "overwrite", "items": [' + ", ".join(one.format(i) for i in range(n))
           + f'], "streams": [{{"id": "loc.0", "raw": {n}, "packed": {len(loc)}}}, '
           f'{{"id": "val.overwrite.U8.0", "raw": {n}, "packed": {len(val)}}}]}}').encode()
    return seal(zc(raw), loc + val, header_raw=len(raw)), len(raw)


def test_a_header_of_300000_items_is_refused_by_counting_before_it_is_parsed() -> None:
    """Fails on 5b0b0ae: the reader parsed every item into models before it compared the
    count with its limit (then 2**20), so 300,000 items were accepted after seconds and
    some 500 MiB. Now the header's objects are counted first, against 2**16 items, and
    refusing costs little beyond the header's own bytes."""
    data, raw_size = _many_items_payload(300_000)
    tracemalloc.start()
    try:
        reject(LimitExceeded, data, "300003 JSON objects", str(DEFAULT_LIMITS.max_items),
               "before parsing")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < raw_size + (32 << 20), (peak >> 20, raw_size >> 20)


def test_a_payload_over_the_default_item_limit_is_never_sealed() -> None:
    """Fails on 5b0b0ae: the writer sealed payloads that every reader would refuse."""
    n = DEFAULT_LIMITS.max_items + 1
    items = tuple(ItemHeader(name=f"t{i}", dtype="U8", shape=(1,), start=0, stop=1,
                             entry="overwrite", loc="gaps", count=1, runs=0, escapes=0,
                             loc_width=0, len_width=0) for i in range(n))
    with pytest.raises(LimitExceeded, match=f"{n} items, over the limit of {n - 1}"):
        pack_payload(base_version=1, target_version=2, attempt="a-1", owner=0, seq=0,
                     mode="overwrite", items=items,
                     streams={"loc.0": bytes(n), "val.overwrite.U8.0": b"\x01" * n})
    data, _ = _many_items_payload(n - 1)  # at the limit: read as usual
    assert len(read_payload(data).header.items) == n - 1


def test_tensor_over_max_elements_is_a_limit() -> None:
    reject(LimitExceeded, xor_gaps().data, "'w'", "[10, 100]", "999 elements",
           limits=DecodeLimits(max_elements=999))


def test_tensor_over_max_ndim_is_a_limit() -> None:
    reject(LimitExceeded, xor_gaps().data, "'w'", "[10, 100]", "1 dims",
           limits=DecodeLimits(max_ndim=1))


def test_huge_declared_stream_is_refused_before_any_decompression() -> None:
    """A 10 GB stream declared by a consistent header, carried by a 13-byte frame."""
    n = 10**10  # over the default 8 GiB per-stream limit
    item = {"name": "big", "dtype": "U8", "shape": [n], "start": 0, "stop": n,
            "entry": "xor", "loc": "gaps", "count": n, "runs": 0, "escapes": 0,
            "loc_width": 0, "len_width": 0}
    tiny = zc(b"\x01")
    header = {"base_version": 1, "target_version": 2, "attempt": "a-1", "owner": 0, "seq": 0,
              "mode": "mixed", "items": [item],
              "streams": [{"id": "loc.0", "raw": n, "packed": len(tiny)},
                          {"id": "val.xor.U8.0", "raw": n, "packed": len(tiny)}]}
    raw = json.dumps(header).encode()
    data = seal(zc(raw), tiny + tiny, header_raw=len(raw))
    reject(LimitExceeded, data, "'loc.0'", str(n), str(DEFAULT_LIMITS.max_stream_bytes))


def test_streams_over_the_total_limit_are_refused() -> None:
    # xor_gaps declares loc.0 (5), esc.0 (1), esc.1 (1) and two value planes (5 each): 17.
    reject(LimitExceeded, xor_gaps().data, "17 bytes in all", "limit of 16",
           limits=DecodeLimits(max_total_bytes=16))


def test_escape_stream_over_a_lowered_stream_limit_is_refused() -> None:
    # xor_runs_far: loc.0 2, esc.0 1, len.0 2, then four value planes of 60 bytes.
    good = xor_runs_far()
    reject(LimitExceeded, good.data, "'val.xor.F32.0'", "60 bytes", "limit of 59",
           good=good, limits=DecodeLimits(max_stream_bytes=59))
    reject(LimitExceeded, good.data, "245 bytes in all", "limit of 244",
           good=good, limits=DecodeLimits(max_total_bytes=244))


def test_stream_over_a_lowered_stream_limit_is_refused() -> None:
    reject(LimitExceeded, xor_gaps().data, "'loc.0'", "5 bytes", "limit of 4",
           limits=DecodeLimits(max_stream_bytes=4))


def test_stream_frame_declaring_more_than_its_raw_size_is_malformed() -> None:
    """A zstd bomb in place of a 5-byte stream: 1 MB of content in a tiny frame."""
    header, streams = unpack(xor_gaps().data)
    frames = [zc(bytes(v)) for v in streams.values()]
    frames[0] = zc(b"\x01" * 1_000_000)
    assert len(frames[0]) < 1000
    header["streams"][0]["packed"] = len(frames[0])
    raw = json.dumps(header).encode()
    data = seal(zc(raw), b"".join(frames), header_raw=len(raw))
    reject(MalformedPayload, data, "'loc.0'", "declares 1000000 bytes", "says 5")


@pytest.mark.parametrize(("sid", "size"), [("loc.0", 5), ("esc.1", 1), ("val.xor.BF16.1", 5)])
def test_stream_frame_without_content_size_is_malformed(sid: str, size: int) -> None:
    header, streams = unpack(xor_gaps().data)
    i = list(streams).index(sid)
    frames = [zc(bytes(v)) for v in streams.values()]
    frames[i] = zc(bytes(streams[sid]), content_size=False)
    header["streams"][i]["packed"] = len(frames[i])
    raw = json.dumps(header).encode()
    data = seal(zc(raw), b"".join(frames), header_raw=len(raw))
    reject(MalformedPayload, data, f"'{sid}'", "declares -1 bytes", f"says {size}.")


@pytest.mark.parametrize("sid", ["val.xor.BF16.0", "esc.0"])
def test_stream_frame_with_trailing_bytes_is_malformed(sid: str) -> None:
    header, streams = unpack(xor_gaps().data)
    i = list(streams).index(sid)
    frames = [zc(bytes(v)) for v in streams.values()]
    frames[i] += zc(b"")  # a second (empty) frame glued on
    header["streams"][i]["packed"] = len(frames[i])
    raw = json.dumps(header).encode()
    data = seal(zc(raw), b"".join(frames), header_raw=len(raw))
    reject(MalformedPayload, data, f"'{sid}'", "does not decompress")


@pytest.mark.parametrize("sid", ["val.xor.BF16.1", "esc.1"])
def test_stream_frame_cut_short_is_malformed(sid: str) -> None:
    header, streams = unpack(xor_gaps().data)
    i = list(streams).index(sid)
    frames = [zc(bytes(v)) for v in streams.values()]
    frames[i] = frames[i][:-2]
    header["streams"][i]["packed"] = len(frames[i])
    raw = json.dumps(header).encode()
    data = seal(zc(raw), b"".join(frames), header_raw=len(raw))
    reject(MalformedPayload, data, f"'{sid}'")


def test_body_longer_than_the_stream_frames_is_malformed() -> None:
    pre, hf, body = split(xor_gaps().data)
    data = seal(hf, body + b"\x00\x00\x00", header_raw=PREAMBLE.unpack(pre)[4])
    reject(MalformedPayload, data, f"{len(body)} compressed bytes", f"body has {len(body) + 3}")


def test_packed_sizes_that_do_not_add_up_to_body_length_are_malformed() -> None:
    header, _ = unpack(xor_gaps().data)
    body_len = sum(s["packed"] for s in header["streams"])
    header["streams"][0]["packed"] += 1
    raw = json.dumps(header).encode()
    data = seal(zc(raw), split(xor_gaps().data)[2], header_raw=len(raw))
    reject(MalformedPayload, data, f"{body_len + 1} compressed bytes", f"body has {body_len}")


def test_packed_sizes_shifting_a_frame_boundary_are_malformed() -> None:
    header, _ = unpack(xor_gaps().data)
    header["streams"][0]["packed"] -= 1
    header["streams"][1]["packed"] += 1
    raw = json.dumps(header).encode()
    data = seal(zc(raw), split(xor_gaps().data)[2], header_raw=len(raw))
    reject(MalformedPayload, data, "'loc.0'")


# --- header schema and item rules ------------------------------------------------------


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(h: dict[str, Any]) -> None:
        node = h
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return apply


@pytest.mark.parametrize(
    ("path", "value", "needles"),
    [
        (("items", 0, "stop"), 1001, ["[0, 1001)", "1000 elements"]),
        (("items", 0, "shape"), [10, 99], ["[0, 1000)", "990 elements"]),
        (("items", 0, "start"), 1000, ["[1000, 1000)"]),
        (("items", 0, "start"), -1, ["items.0.start", "greater than or equal to 0"]),
        (("items", 0, "shape"), [10, -100], ["items.0.shape.1"]),
        (("items", 0, "dtype"), "F12", ["unknown dtype 'F12'"]),
        (("items", 0, "name"), "", ["tensor name ''"]),
        (("items", 0, "name"), "w\nx", ["'w\\nx'", "control"]),
        (("items", 0, "name"), "w" * 1025, ["too long"]),
        (("items", 0, "entry"), "add", ["items.0.entry", "'xor' or 'overwrite'"]),
        (("items", 0, "loc"), "rle", ["items.0.loc", "'gaps' or 'runs'"]),
        (("items", 0, "loc_width"), 3, ["items.0.loc_width", "0, 1, 2, 4 or 8"]),
        (("items", 0, "loc_width"), 16, ["items.0.loc_width", "0, 1, 2, 4 or 8"]),
        (("items", 0, "escapes"), -1, ["items.0.escapes", "greater than or equal to 0"]),
        (("items", 0, "escapes"), True, ["items.0.escapes", "valid integer"]),
        (("items", 0, "escapes"), "1", ["items.0.escapes", "valid integer"]),
        (("items", 0, "escapes"), 1.0, ["items.0.escapes", "valid integer"]),
        (("items", 0, "count"), 0, ["items.0.count", "greater than or equal to 1"]),
        (("items", 0, "runs"), 1, ["gap coding takes runs=0"]),
        (("items", 0, "len_width"), 1, ["gap coding takes runs=0 and len_width=0"]),
        (("attempt",), "-leading-dash", ["attempt", "pattern"]),
        (("attempt",), "a" * 65, ["attempt", "pattern"]),
        (("owner",), 2**31, ["owner", "less than or equal to 2147483647"]),
        (("seq",), -1, ["seq", "greater than or equal to 0"]),
        (("mode",), "append", ["mode", "'mixed' or 'overwrite'"]),
        (("base_version",), -1, ["base_version", "greater than or equal to 0"]),
        (("base_version",), 2, ["base and target version are both 2"]),
        (("target_version",), 1, ["base and target version are both 1"]),
    ],
)
def test_header_field_out_of_range_is_malformed(
    path: tuple[Any, ...], value: Any, needles: list[str]
) -> None:
    reject(MalformedPayload, edit(xor_gaps().data, _set(path, value)), *needles)


def test_item_range_outside_the_tensor_is_malformed() -> None:
    good = two_tensors(w_start=600)
    reject(MalformedPayload, edit(good.data, _set(("items", 1, "stop"), 1400)),
           "'w'", "[600, 1400)", "1000 elements", good=good)


def test_item_count_larger_than_its_range_is_malformed() -> None:
    data = edit(xor_gaps().data, _set(("items", 0, "stop"), 4))
    reject(MalformedPayload, data, "w[0:4]", "5 records in a range of 4 elements")


def test_run_coded_item_with_more_runs_than_records_is_malformed() -> None:
    good = xor_runs()
    data = edit(good.data, _set(("items", 0, "runs"), 61))
    reject(MalformedPayload, data, "runs (61) <= count (60)", good=good)


def test_run_coded_item_without_len_width_is_malformed() -> None:
    good = xor_runs()
    data = edit(good.data, _set(("items", 0, "len_width"), 0))
    reject(MalformedPayload, data, "r[0:160]", "nonzero len_width", good=good)


def test_base_version_equal_to_target_version_is_malformed() -> None:
    data = edit(xor_gaps().data, _set(("target_version",), 1))
    reject(MalformedPayload, data, "both 1")


def test_overwrite_mode_with_an_xor_item_is_malformed() -> None:
    data = edit(xor_gaps().data, _set(("mode",), "overwrite"))
    reject(MalformedPayload, data, "mode is overwrite", "w[0:1000]")


def split_w() -> Good:
    """BF16 ``w`` as two items of one payload: w[0:500] and w[500:1000]."""
    base = _bf16_base()
    new = base.copy()
    new[[10, 450, 520, 990]] ^= 0x0003
    pb = _builder()
    for lo, hi in [(0, 500), (500, 1000)]:
        d = diff_range(name="w", dtype=dtype("BF16"), shape=(10, 100), start=lo,
                       base=base[lo:hi], target=new[lo:hi], entry="xor")
        assert d is not None
        pb.add(encode_item(d), dense_bytes=base[lo:hi].nbytes)
    return Good(pb.seal(), {"w": ("BF16", (10, 100), base)}, {"w": new})


def test_two_items_of_one_tensor_apply_when_disjoint() -> None:
    good = split_w()
    targets = targets_for(good)
    assert run(good.data, targets) == 4
    assert np.array_equal(targets["w"].bits.reshape(-1), good.target["w"])


def test_overlapping_items_in_one_payload_are_malformed() -> None:
    good = split_w()
    data = edit(good.data, _set(("items", 1, "start"), 400))
    reject(MalformedPayload, data, "w[0:500]", "w[400:1000]", "overlap", good=good)


def test_overlapping_items_in_one_payload_built_by_hand_are_malformed() -> None:
    """Two XOR items over the same elements: applying both would restore the old bits."""
    item = ItemHeader(name="w", dtype="BF16", shape=(10, 100), start=0, stop=10,
                      entry="xor", loc="gaps", count=1, runs=0, escapes=0, loc_width=0,
                      len_width=0)
    other = item.model_copy(update={"start": 5, "stop": 20})
    header = {"base_version": 1, "target_version": 2, "attempt": "a-1", "owner": 0,
              "seq": 0, "mode": "mixed",
              "items": [item.model_dump(), other.model_dump()],
              "streams": [{"id": "loc.0", "raw": 2, "packed": 1},
                          {"id": "val.xor.BF16.0", "raw": 2, "packed": 1},
                          {"id": "val.xor.BF16.1", "raw": 2, "packed": 1}]}
    streams = {"loc.0": b"\x00\x00", "val.xor.BF16.0": b"\x01\x01",
               "val.xor.BF16.1": b"\x00\x00"}
    reject(MalformedPayload, repack(header, streams), "w[0:10]", "w[5:20]", "overlap")


def test_same_tensor_with_two_dtypes_in_one_payload_is_malformed() -> None:
    good = two_tensors()

    def rename(h: dict[str, Any]) -> None:
        h["items"][0]["name"] = "w"
        h["items"][0]["shape"] = [64]
        h["items"][0]["start"] = 0

    reject(MalformedPayload, edit(good.data, rename), "'w'", "F8_E4M3[64]", "BF16[10, 100]",
           good=good)


@pytest.mark.parametrize(("index", "bad", "want"), [
    (0, "loc.1", "('loc.0', 5)"),  # old layout: a second location plane
    (1, "esc.2", "('esc.0', 1)"),
    (2, "loc.1", "('esc.1', 1)"),
])
def test_stream_with_a_wrong_id_is_malformed(index: int, bad: str, want: str) -> None:
    good = xor_gaps()
    raw = unpack(good.data)[0]["streams"][index]["raw"]

    def rename(h: dict[str, Any]) -> None:
        h["streams"][index]["id"] = bad

    reject(MalformedPayload, edit(good.data, rename), f"('{bad}', {raw})", want)


@pytest.mark.parametrize(("sid", "raw"), [("loc.0", 5), ("esc.1", 1)])
def test_stream_with_a_wrong_raw_size_is_malformed(sid: str, raw: int) -> None:
    def longer(s: dict[str, bytearray]) -> None:
        s[sid].append(0)

    def declare(h: dict[str, Any]) -> None:
        next(x for x in h["streams"] if x["id"] == sid)["raw"] = raw + 1

    reject(MalformedPayload, edit(xor_gaps().data, declare, longer), f"('{sid}', {raw + 1})",
           f"('{sid}', {raw})")


def test_escape_streams_missing_for_an_item_with_escapes_are_malformed() -> None:
    def drop_header(h: dict[str, Any]) -> None:
        h["streams"] = [x for x in h["streams"] if not x["id"].startswith("esc.")]

    def drop_streams(s: dict[str, bytearray]) -> None:
        del s["esc.0"], s["esc.1"]

    reject(MalformedPayload, edit(xor_gaps().data, drop_header, drop_streams),
           "('esc.0', 1)", "('esc.1', 1)")


def test_loc_width_wider_than_the_escape_streams_is_malformed() -> None:
    # loc_width 2 -> 4 implies esc.2 and esc.3 as well; the payload carries two planes.
    reject(MalformedPayload, edit(xor_gaps().data, _set(("items", 0, "loc_width"), 4)),
           "('esc.1', 1), ('val.xor.BF16.0', 5)", "('esc.3', 1)")


def test_escape_count_without_matching_stream_sizes_is_malformed() -> None:
    # escapes 1 -> 2 implies two bytes in each esc plane; the streams still hold one.
    reject(MalformedPayload, edit(xor_gaps().data, _set(("items", 0, "escapes"), 2)),
           "('esc.0', 1)", "('esc.0', 2)")


def test_missing_stream_is_malformed() -> None:
    def drop_header(h: dict[str, Any]) -> None:
        del h["streams"][3]

    def drop_stream(s: dict[str, bytearray]) -> None:
        del s["val.xor.BF16.1"]

    reject(MalformedPayload, edit(xor_gaps().data, drop_header, drop_stream),
           "('val.xor.BF16.1', 5)")


def test_extra_stream_is_malformed() -> None:
    def add_header(h: dict[str, Any]) -> None:
        h["streams"].append({"id": "len.0", "raw": 5, "packed": 1})

    def add_stream(s: dict[str, bytearray]) -> None:
        s["len.0"] = bytearray(5)

    reject(MalformedPayload, edit(xor_gaps().data, add_header, add_stream), "('len.0', 5)")


def test_streams_out_of_order_are_malformed() -> None:
    def swap_header(h: dict[str, Any]) -> None:
        h["streams"][0], h["streams"][1] = h["streams"][1], h["streams"][0]

    def swap_streams(s: dict[str, bytearray]) -> None:
        order = ["esc.0", "loc.0", "esc.1", "val.xor.BF16.0", "val.xor.BF16.1"]
        items = {k: s[k] for k in order}
        s.clear()
        s.update(items)

    reject(MalformedPayload, edit(xor_gaps().data, swap_header, swap_streams),
           "[('esc.0', 1), ('loc.0', 5)")


def test_escape_planes_out_of_order_are_malformed() -> None:
    def swap_header(h: dict[str, Any]) -> None:
        h["streams"][1], h["streams"][2] = h["streams"][2], h["streams"][1]

    def swap_streams(s: dict[str, bytearray]) -> None:
        order = ["loc.0", "esc.1", "esc.0", "val.xor.BF16.0", "val.xor.BF16.1"]
        items = {k: s[k] for k in order}
        s.clear()
        s.update(items)

    reject(MalformedPayload, edit(xor_gaps().data, swap_header, swap_streams),
           "[('loc.0', 5), ('esc.1', 1), ('esc.0', 1)")


def test_escape_stream_after_the_run_lengths_is_malformed() -> None:
    """FORMAT.md: loc.0, then esc.K, then len.K; the old order put len right after loc."""
    good = xor_runs_far()

    def swap_header(h: dict[str, Any]) -> None:
        h["streams"][1], h["streams"][2] = h["streams"][2], h["streams"][1]

    def swap_streams(s: dict[str, bytearray]) -> None:
        order = ["loc.0", "len.0", "esc.0", *(f"val.xor.F32.{k}" for k in range(4))]
        items = {k: s[k] for k in order}
        s.clear()
        s.update(items)

    reject(MalformedPayload, edit(good.data, swap_header, swap_streams),
           "[('loc.0', 2), ('len.0', 2), ('esc.0', 1)",
           "[('loc.0', 2), ('esc.0', 1), ('len.0', 2)", good=good)


# --- per-record checks (valid digest, valid header) -------------------------------------


def test_gap_reaching_past_stop_is_malformed() -> None:
    # gaps 3,46,0,0,946 put the last record on element 999; 947 puts it on 1000.
    # 946 and 947 are both escaped: only esc.0/esc.1 change (691 -> 692).
    data = edit(xor_gaps().data,
                streams_fn=lambda s: set_planes(s, "esc", 2, 0, 947 - ESCAPE))
    reject(MalformedPayload, data, "w[0:1000]", "reach element 1000", "1000 elements")


def test_unescaped_gap_reaching_past_stop_is_malformed() -> None:
    # gaps 3,46,0,0,946 -> 3,46,0,1,946: the last record moves from 999 to 1000.
    data = edit(xor_gaps().data, streams_fn=lambda s: set_planes(s, "loc", 1, 3, 1))
    reject(MalformedPayload, data, "w[0:1000]", "reach element 1000", "1000 elements")


@pytest.mark.parametrize("gaps", [[1200, 46, 0, 0, 946], [3, 46, 0, 0, 1001],
                                  [3, 46, 0, 0, 1255]])
def test_single_gap_larger_than_the_range_is_malformed(gaps: list[int]) -> None:
    """Escaped gaps whose escaped part (gap - 255) fits the range, the gap itself does not."""
    header, streams = unpack(xor_gaps().data)
    set_locations(header, streams, gaps)
    assert header["items"][0]["escapes"] == (2 if gaps[0] > 255 else 1)
    reject(MalformedPayload, repack(header, streams), "w[0:1000]",
           f"location value {max(gaps)} exceeds", "1000 elements")


@pytest.mark.parametrize(("gap", "width"), [(1256, 2), (0xFFFF, 2), (2**32 + 254, 4),
                                            (2**64 - 1 + ESCAPE, 8)])
def test_escaped_gap_larger_than_the_range_is_malformed(gap: int, width: int) -> None:
    """The escaped part itself (gap - 255) is past the range; the widest overflows uint64
    once 255 is added back, so the reader must check before it adds."""
    header, streams = unpack(xor_gaps().data)
    set_locations(header, streams, [3, 46, 0, 0, gap])
    assert (header["items"][0]["escapes"], header["items"][0]["loc_width"]) == (1, width)
    reject(MalformedPayload, repack(header, streams), "w[0:1000]",
           f"escaped location value {gap} ({gap - ESCAPE} + 255)", "1000 elements")


def test_escaped_run_gap_reaching_past_stop_is_malformed() -> None:
    good = xor_runs_far()
    # run gaps 10, 270 and lengths 20, 40 end at element 339; gap 331 ends at 400 = stop.
    data = edit(good.data, streams_fn=lambda s: set_planes(s, "esc", 1, 0, 331 - ESCAPE))
    reject(MalformedPayload, data, "r[0:400]", "reach element 400", "400 elements", good=good)


def test_escaped_run_gap_larger_than_the_range_is_malformed() -> None:
    good = xor_runs_far()
    # esc.0 = 255 codes the run gap 510, past r's 400 elements (255 itself is not).
    data = edit(good.data, streams_fn=lambda s: set_planes(s, "esc", 1, 0, 255))
    reject(MalformedPayload, data, "r[0:400]", "location value 510 exceeds", "400 elements",
           good=good)


# --- escape counts: the header's ``escapes`` against the 255 bytes in loc.0 --------------


def _escapes(n: int) -> Callable[[dict[str, Any]], None]:
    """Set item 0's ``escapes`` to ``n`` and resize its esc planes to match (valid header)."""
    def apply(h: dict[str, Any]) -> None:
        h["items"][0]["escapes"] = n
        for s in h["streams"]:
            if s["id"].startswith("esc."):
                s["raw"] = n

    return apply


def _esc_planes(n: int) -> Callable[[dict[str, bytearray]], None]:
    def apply(s: dict[str, bytearray]) -> None:
        for sid in s:
            if sid.startswith("esc."):
                s[sid] = (s[sid] + bytearray(n))[:n]

    return apply


def test_header_escape_count_larger_than_the_escape_bytes_present_is_malformed() -> None:
    # loc.0 is 3,46,0,0,255: one escape byte; the header says two (esc planes hold two).
    data = edit(xor_gaps().data, _escapes(2), _esc_planes(2))
    reject(MalformedPayload, data, "w[0:1000]", "loc.0 holds 1 escape bytes",
           "header says 2")


def test_header_escape_count_equal_to_all_location_values_is_checked_too() -> None:
    # escapes 5 = every location value is allowed by the header rules; loc.0 has one 255.
    data = edit(xor_gaps().data, _escapes(5), _esc_planes(5))
    reject(MalformedPayload, data, "w[0:1000]", "loc.0 holds 1 escape bytes",
           "header says 5")


def test_header_escape_count_smaller_than_the_escape_bytes_present_is_malformed() -> None:
    # loc.0 3,46,0,0,255 -> 255,46,0,0,255: two escape bytes, the header still says one.
    def mark(s: dict[str, bytearray]) -> None:
        s["loc.0"][0] = ESCAPE

    data = edit(xor_gaps().data, streams_fn=mark)
    reject(MalformedPayload, data, "w[0:1000]", "loc.0 holds 2 escape bytes",
           "header says 1")


def test_escape_byte_in_an_item_without_escapes_is_malformed() -> None:
    # xor_runs has escapes 0 and no esc streams; loc.0 10,70 -> 10,255.
    good = xor_runs()

    def mark(s: dict[str, bytearray]) -> None:
        s["loc.0"][1] = ESCAPE

    reject(MalformedPayload, edit(good.data, streams_fn=mark), "r[0:160]",
           "loc.0 holds 1 escape bytes", "header says 0", good=good)


def test_escape_count_is_checked_per_item_not_per_payload() -> None:
    """Two items share loc.0: moving an escape from one item's slice to the other's keeps
    the payload's total count of 255 bytes and every stream size, but not each item's."""
    base = _bf16_base()
    new = base.copy()
    new[[10, 400, 520, 530]] ^= 0x0003  # w[0:500] gaps 10, 389 (escaped); w[500:] 20, 9
    pb = _builder()
    for lo, hi in [(0, 500), (500, 1000)]:
        d = diff_range(name="w", dtype=dtype("BF16"), shape=(10, 100), start=lo,
                       base=base[lo:hi], target=new[lo:hi], entry="xor")
        assert d is not None
        pb.add(encode_item(d), dense_bytes=base[lo:hi].nbytes)
    good = Good(pb.seal(), {"w": ("BF16", (10, 100), base)}, {"w": new})
    header, streams = unpack(good.data)
    assert [(i["escapes"], i["loc_width"]) for i in header["items"]] == [(1, 1), (0, 0)]
    assert list(streams["loc.0"]) == [10, 255, 20, 9]

    def move(s: dict[str, bytearray]) -> None:
        s["loc.0"][1], s["loc.0"][2] = 10, ESCAPE

    reject(MalformedPayload, edit(good.data, streams_fn=move), "w[0:500]",
           "loc.0 holds 0 escape bytes", "header says 1", good=good)


@pytest.mark.parametrize(("make", "field", "value", "needles"), [
    # loc_width nonzero with escapes 0
    (xor_gaps, "escapes", 0, ["w[0:1000]", "0 escapes with loc_width 2", "5 location values"]),
    (xor_runs_far, "escapes", 0,
     ["r[0:400]", "0 escapes with loc_width 1", "2 location values"]),
    (xor_runs, "loc_width", 1, ["r[0:160]", "0 escapes with loc_width 1", "2 location values"]),
    (xor_runs, "loc_width", 8, ["r[0:160]", "0 escapes with loc_width 8"]),
    # escapes nonzero with loc_width 0
    (xor_gaps, "loc_width", 0, ["w[0:1000]", "1 escapes with loc_width 0", "5 location values"]),
    (xor_runs, "escapes", 1, ["r[0:160]", "1 escapes with loc_width 0", "2 location values"]),
    # more escapes than location values (gap coding: count; run coding: runs, not count)
    (xor_gaps, "escapes", 6, ["w[0:1000]", "6 escapes with loc_width 2", "5 location values"]),
    (xor_runs_far, "escapes", 3,
     ["r[0:400]", "3 escapes with loc_width 1", "for 2 location values"]),
    (xor_runs_far, "escapes", 60,
     ["r[0:400]", "60 escapes with loc_width 1", "for 2 location values"]),
    (xor_gaps, "escapes", 2**63,
     ["w[0:1000]", f"{2**63} escapes with loc_width 2", "5 location values"]),
])
def test_item_escape_fields_that_disagree_are_malformed(
    make: Callable[[], Good], field: str, value: int, needles: list[str]
) -> None:
    good = make()
    reject(MalformedPayload, edit(good.data, _set(("items", 0, field), value)), *needles,
           good=good)


def test_payload_in_the_old_byte_plane_location_layout_is_malformed() -> None:
    """Before escapes, gaps 3,46,0,0,946 went to planes loc.0/loc.1 with loc_width 2 and no
    ``escapes`` field. Such a payload must be refused, not read with the new layout."""
    header, streams = unpack(xor_gaps().data)
    del header["items"][0]["escapes"]
    old = {"loc.0": bytearray([3, 46, 0, 0, 946 & 0xFF]), "loc.1": bytearray([0, 0, 0, 0, 3])}
    old.update((k, v) for k, v in streams.items() if k.startswith("val."))
    sync_raw(header, old)
    reject(MalformedPayload, repack(header, old), "items.0.escapes", "Field required")


def test_old_layout_stream_list_with_the_new_fields_is_malformed() -> None:
    """The same old-layout streams under a header that does carry escapes 0, loc_width 2."""
    header, streams = unpack(xor_gaps().data)
    header["items"][0]["escapes"] = 0
    old = {"loc.0": bytearray([3, 46, 0, 0, 946 & 0xFF]), "loc.1": bytearray([0, 0, 0, 0, 3])}
    old.update((k, v) for k, v in streams.items() if k.startswith("val."))
    sync_raw(header, old)
    reject(MalformedPayload, repack(header, old), "0 escapes with loc_width 2")


def test_escapes_over_location_values_with_matching_stream_sizes_is_malformed() -> None:
    """escapes 6 > 5 gaps, even with esc planes sized for 6: the header rule rejects it."""
    data = edit(xor_gaps().data, _escapes(6), _esc_planes(6))
    reject(MalformedPayload, data, "w[0:1000]", "6 escapes with loc_width 2",
           "5 location values")


def test_gap_reaching_past_stop_of_a_sub_range_item_is_malformed() -> None:
    # Shrink the item to [0, 999): same records, the last one now lies past stop.
    data = edit(xor_gaps().data, _set(("items", 0, "stop"), 999))
    reject(MalformedPayload, data, "w[0:999]", "reach element 999", "999 elements")


def test_run_gap_reaching_past_stop_is_malformed() -> None:
    good = xor_runs()
    # gaps 10, 70 and lengths 20, 40 end at element 139; gap 91 ends at 160 = stop.
    data = edit(good.data, streams_fn=lambda s: set_planes(s, "loc", 1, 1, 91))
    reject(MalformedPayload, data, "r[0:160]", "reach element 160", "160 elements", good=good)


def test_run_lengths_not_summing_to_count_are_malformed() -> None:
    good = xor_runs()
    data = edit(good.data, streams_fn=lambda s: set_planes(s, "len", 1, 0, 18))
    reject(MalformedPayload, data, "r[0:160]", "add up to 59 records", "says 60", good=good)


def test_run_length_larger_than_the_range_is_malformed() -> None:
    good = xor_runs()
    data = edit(good.data, streams_fn=lambda s: set_planes(s, "len", 1, 1, 200))
    reject(MalformedPayload, data, "r[0:160]", "location value 200", good=good)


def test_xor_item_with_a_zero_mask_is_malformed() -> None:
    data = edit(xor_gaps().data, streams_fn=lambda s: set_planes(s, "val.xor.BF16", 2, 2, 0))
    reject(MalformedPayload, data, "w[0:1000]", "1 XOR masks are zero")


def test_xor_item_with_all_masks_zero_is_malformed_and_no_tensor_is_written() -> None:
    good = two_tensors()

    def zero(s: dict[str, bytearray]) -> None:
        for k in (0, 1):
            s[f"val.xor.BF16.{k}"][:] = bytes(3)

    reject(MalformedPayload, edit(good.data, streams_fn=zero), "3 XOR masks are zero",
           good=good)


# --- against the targets ---------------------------------------------------------------


def _apply(data: bytes, targets: Mapping[str, Target]) -> Callable[[], int]:
    return lambda: run(data, targets)


def test_missing_target_tensor_is_a_target_mismatch() -> None:
    good = two_tensors()
    targets = targets_for(good)
    del targets["w"]
    assert_rejected(TargetMismatch, _apply(good.data, targets), targets, "no tensor named 'w'")


def test_target_with_wrong_dtype_is_a_target_mismatch() -> None:
    good = two_tensors()
    targets = targets_for(good)
    targets["w"] = Target(dtype="F16", shape=(10, 100), bits=targets["w"].bits)
    assert_rejected(TargetMismatch, _apply(good.data, targets), targets,
                    "BF16[10, 100]", "F16[10, 100]")


def test_target_with_wrong_shape_is_a_target_mismatch() -> None:
    good = two_tensors()
    targets = targets_for(good)
    targets["w"] = Target(dtype="BF16", shape=(100, 10), bits=targets["w"].bits.reshape(100, 10))
    assert_rejected(TargetMismatch, _apply(good.data, targets), targets,
                    "BF16[10, 100]", "BF16[100, 10]")


def test_target_with_wrong_storage_width_is_a_target_mismatch() -> None:
    good = two_tensors()
    targets = targets_for(good)
    targets["w"] = Target(dtype="BF16", shape=(10, 100), bits=np.zeros(1000, np.uint32))
    assert_rejected(TargetMismatch, _apply(good.data, targets), targets,
                    "uint32[1000]", "uint16[1000]")


def test_target_with_too_few_elements_is_a_target_mismatch() -> None:
    good = two_tensors()
    targets = targets_for(good)
    targets["w"] = Target(dtype="BF16", shape=(10, 100), bits=np.zeros(999, np.uint16))
    assert_rejected(TargetMismatch, _apply(good.data, targets), targets, "uint16[999]")


def test_read_only_target_is_a_target_mismatch() -> None:
    good = two_tensors()
    targets = targets_for(good)
    targets["w"].bits.flags.writeable = False
    assert_rejected(TargetMismatch, _apply(good.data, targets), targets,
                    "'w'", "read-only or not contiguous")


def test_non_contiguous_target_is_a_target_mismatch() -> None:
    good = two_tensors()
    targets = targets_for(good)
    wide = np.zeros(2000, np.uint16)
    wide[::2] = good.base["w"][2]
    targets["w"] = Target(dtype="BF16", shape=(10, 100), bits=wide[::2])
    assert_rejected(TargetMismatch, _apply(good.data, targets), targets,
                    "'w'", "read-only or not contiguous")


def test_first_tensor_is_not_written_when_the_second_does_not_fit() -> None:
    good = two_tensors()
    targets = targets_for(good)
    targets["w"].bits.flags.writeable = False  # "a" comes first and would fit
    assert_rejected(TargetMismatch, _apply(good.data, targets), targets, "'w'")
    assert np.array_equal(targets["a"].bits, good.base["a"][2])


# --- several payloads applied together -------------------------------------------------


def _items(data: bytes) -> list[DecodedItem]:
    return decode(read_payload(data))


def test_disjoint_payloads_apply_together() -> None:
    """Control: owner 0 covers w[0:500], owner 1 covers w[500:1000]."""
    base = _bf16_base()
    new = base.copy()
    new[[1, 499, 500, 998]] ^= 0x0040
    items = []
    for owner, (lo, hi) in enumerate([(0, 500), (500, 1000)]):
        d = diff_range(name="w", dtype=dtype("BF16"), shape=(10, 100), start=lo,
                       base=base[lo:hi], target=new[lo:hi], entry="xor")
        assert d is not None
        pb = _builder(owner=owner)
        pb.add(encode_item(d), dense_bytes=base[lo:hi].nbytes)
        items += _items(pb.seal())
    bits = base.copy()
    assert apply_items(items, {"w": Target(dtype="BF16", shape=(10, 100), bits=bits)}) == 4
    assert np.array_equal(bits, new)


def test_second_payload_overlapping_the_first_writes_nothing_of_either() -> None:
    first = two_tensors(owner=0)            # a[0:64] and w[0:1000]
    second = two_tensors(owner=1, w_start=600)  # a[0:64] and w[600:1000] again
    targets = targets_for(first)
    items = _items(first.data) + _items(second.data)
    # Both tensors overlap; the first conflict reported is tensor "a" (sorted by name).
    assert_rejected(MalformedPayload, lambda: apply_items(items, targets), targets,
                    "items a[0:64] and a[0:64] overlap")


def test_second_payload_overlapping_only_one_tensor_writes_nothing_of_either() -> None:
    first = two_tensors(owner=0)
    base = first.base["w"][2]
    new = base.copy()
    new[700] ^= 1
    d = diff_range(name="w", dtype=dtype("BF16"), shape=(10, 100), start=600,
                   base=base[600:], target=new[600:], entry="xor")
    assert d is not None
    pb = _builder(owner=1)
    pb.add(encode_item(d), dense_bytes=base[600:].nbytes)
    targets = targets_for(first)
    items = _items(first.data) + _items(pb.seal())
    assert_rejected(MalformedPayload, lambda: apply_items(items, targets), targets,
                    "w[0:1000]", "w[600:1000]", "overlap")


def test_same_payload_applied_twice_in_one_call_writes_nothing() -> None:
    good = xor_gaps()
    targets = targets_for(good)
    items = _items(good.data)
    assert_rejected(MalformedPayload, lambda: apply_items(items + items, targets), targets,
                    "w[0:1000]", "overlap")


def test_payloads_disagreeing_on_a_tensor_dtype_write_nothing() -> None:
    first = xor_gaps()
    a = np.arange(1000, dtype=np.uint16)
    b = a.copy()
    b[5] ^= 1
    d = diff_range(name="w", dtype=dtype("F16"), shape=(10, 100), start=0, base=a, target=b,
                   entry="xor")
    assert d is not None
    item = encode_item(d)
    pb = _builder(owner=1)
    pb.add(item, dense_bytes=a.nbytes)
    targets = targets_for(first)
    items = _items(first.data) + _items(pb.seal())
    assert_rejected(MalformedPayload, lambda: apply_items(items, targets), targets,
                    "'w'", "BF16[10, 100]", "F16[10, 100]")


# --- writer side: pack_payload refuses streams the items do not imply -------------------


def test_pack_payload_refuses_streams_that_differ_from_the_items() -> None:
    item = ItemHeader(name="w", dtype="U8", shape=(4,), start=0, stop=4, entry="xor",
                      loc="gaps", count=1, runs=0, escapes=0, loc_width=0, len_width=0)
    with pytest.raises(MalformedPayload, match=r"loc\.1"):
        pack_payload(base_version=1, target_version=2, attempt="a-1", owner=0, seq=0,
                     mode="mixed", items=(item,),
                     streams={"loc.1": b"\x00", "val.xor.U8.0": b"\x01"})


def test_pack_payload_refuses_missing_escape_planes() -> None:
    item = ItemHeader(name="w", dtype="U8", shape=(600,), start=0, stop=600, entry="xor",
                      loc="gaps", count=1, runs=0, escapes=1, loc_width=2, len_width=0)
    with pytest.raises(MalformedPayload, match=r"\['esc\.0', 'esc\.1', 'loc\.0',"):
        pack_payload(base_version=1, target_version=2, attempt="a-1", owner=0, seq=0,
                     mode="mixed", items=(item,),
                     streams={"loc.0": b"\xff", "esc.0": b"\x2c", "val.xor.U8.0": b"\x01"})


@pytest.mark.parametrize(("escapes", "loc_width", "loc", "runs", "count", "needle"), [
    (0, 1, "gaps", 0, 2, "0 escapes with loc_width 1 for 2 location values"),
    (1, 0, "gaps", 0, 2, "1 escapes with loc_width 0 for 2 location values"),
    (3, 1, "gaps", 0, 2, "3 escapes with loc_width 1 for 2 location values"),
    (2, 1, "runs", 1, 2, "2 escapes with loc_width 1 for 1 location values"),
])
def test_item_header_refuses_inconsistent_escape_fields(
    escapes: int, loc_width: int, loc: str, runs: int, count: int, needle: str
) -> None:
    with pytest.raises(ValidationError, match=re.escape(needle)) as info:
        ItemHeader(name="w", dtype="U8", shape=(600,), start=0, stop=600, entry="xor",
                   loc=loc, count=count, runs=runs, escapes=escapes,  # type: ignore[arg-type]
                   loc_width=loc_width, len_width=1 if loc == "runs" else 0)  # type: ignore[arg-type]
    assert type(info.value) is ValidationError
    assert "w[0:600]" in str(info.value)


# --- known bugs ------------------------------------------------------------------------


def _raw_header_payload(raw: bytes) -> bytes:
    return repack({}, {}, raw_header=raw)


def test_header_items_that_is_a_number_is_malformed() -> None:
    header, _ = unpack(xor_gaps().data)
    header["items"] = 5
    reject(MalformedPayload, _raw_header_payload(json.dumps(header).encode()), "items")


def test_header_items_that_is_null_is_malformed() -> None:
    header, _ = unpack(xor_gaps().data)
    header["items"] = None
    reject(MalformedPayload, _raw_header_payload(json.dumps(header).encode()), "items")


def test_deeply_nested_header_json_is_malformed() -> None:
    reject(MalformedPayload, _raw_header_payload(b"[" * 100_000 + b"]" * 100_000), "JSON")


def test_header_integer_with_too_many_digits_is_malformed() -> None:
    header, _ = unpack(xor_gaps().data)
    raw = json.dumps(header).replace('"owner": 0', '"owner": ' + "1" * 5000).encode()
    reject(MalformedPayload, _raw_header_payload(raw), "number out of range")


@pytest.mark.parametrize(("field", "value"), [("owner", "0"), ("base_version", True),
                                              ("seq", 0.0)])
def test_header_integer_field_of_another_json_type_is_malformed(field: str, value: Any) -> None:
    reject(MalformedPayload, edit(xor_gaps().data, _set((field,), value)), field)


def test_header_in_utf16_is_malformed() -> None:
    header, streams = unpack(xor_gaps().data)
    data = repack(header, streams, raw_header=json.dumps(header).encode("utf-16"))
    reject(MalformedPayload, data, "JSON")


def test_escape_width_wider_than_needed_is_malformed() -> None:
    """One payload, one byte form: 691 fits two bytes, so a four-byte esc width is refused."""
    header, streams = unpack(xor_gaps().data)
    assert header["items"][0]["loc_width"] == 2
    for k in (2, 3):
        streams[f"esc.{k}"] = bytearray(1)
    order = ["loc.0", "esc.0", "esc.1", "esc.2", "esc.3"]
    streams = {sid: streams[sid] for sid in order + [s for s in streams if s not in order]}
    header["items"][0]["loc_width"] = 4
    sync_raw(header, streams)
    reject(MalformedPayload, repack(header, streams), "loc_width is 4", "691", "needs 2")


def test_run_length_width_wider_than_needed_is_malformed() -> None:
    good = xor_runs()
    header, streams = unpack(good.data)
    item = header["items"][0]
    assert item["len_width"] == 1
    streams["len.1"] = bytearray(item["runs"])
    order = [s for s in streams if not s.startswith("val")]
    streams = {sid: streams[sid] for sid in order + [s for s in streams if s.startswith("val")]}
    item["len_width"] = 2
    sync_raw(header, streams)
    reject(MalformedPayload, repack(header, streams), "len_width is 2", "needs 1", good=good)
