"""The manifest: its model and committed JSON schema, its container, and hostile objects.

Every refusal names the value it refuses (a size, a version, a digest, a field), and
raises before anything is decompressed past a limit or parsed into models.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import zstandard

from dcr.codec.sums import fingerprint_as, piece_sum, whole_sum
from dcr.errors import ManifestError
from dcr.format.manifest import (
    DEFAULT_MANIFEST_LIMITS,
    SCHEMA_PATH,
    Manifest,
    ManifestLimits,
    json_schema,
    merge_manifests,
    open_document,
    seal_document,
)
from dcr.format.payload import MAGIC as PAYLOAD_MAGIC
from dcr.format.regions import Span, sum_text, whole

FP = "xxh3-128:" + "0" * 32
MAGIC = b"\x89DCM\r\n\x1a\n"


def manifest(**over: object) -> dict[str, object]:
    m: dict[str, object] = {
        "base_version": 1, "target_version": 2, "attempt": "a-1", "mode": "mixed",
        "payloads": [{"key": "v0000000002/a-1/o0000-s000000.dcrp", "owner": 0, "seq": 0,
                      "size": 100, "digest": "ab" * 16, "items": 1, "records": 5}],
        "tensors": [{"name": "w", "dtype": "BF16", "shape": [2, 2], "base": FP, "target": FP}],
        "stats": {"tensors": 1, "changed_elements": 5, "total_elements": 4,
                  "dense_bytes": 8, "payload_bytes": 100},
    }
    m.update(over)
    return m


def sealed(**over: object) -> bytes:
    return seal_document(json.dumps(manifest(**over)).encode())


def container(frame: bytes, raw: int, *, magic: bytes = MAGIC, version: int = 2,
              flags: int = 0, reserved: int = 0) -> bytes:
    """A container around ``frame`` built from FORMAT.md alone, digest included."""
    pre = struct.pack("<8sHHIII", magic, version, flags, len(frame), raw, reserved)
    digest = hashlib.blake2b(pre + frame, digest_size=16, person=b"dcr-manifest-v2").digest()
    return pre + digest + frame


def frame(doc: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(doc)


def test_committed_schema_matches_the_model() -> None:
    assert SCHEMA_PATH.read_text() == json_schema(), "run `make schema`"


def test_valid_manifest_roundtrips() -> None:
    m = Manifest.parse(sealed(), "t")
    assert Manifest.parse(m.pack(), "t") == m
    assert json.loads(open_document(m.pack(), "t")) == json.loads(m.document())
    assert m.format_version == 2


def test_a_container_built_from_the_spec_alone_is_read() -> None:
    doc = json.dumps(manifest()).encode()
    assert Manifest.parse(container(frame(doc), len(doc)), "t").attempt == "a-1"


def test_packing_is_deterministic_and_compresses_the_document() -> None:
    m = Manifest.parse(sealed(tensors=[
        {"name": f"model.layers.{i}.mlp.up_proj.weight", "dtype": "BF16", "shape": [8, 8],
         "base": FP, "target": FP} for i in range(50)]), "t")
    assert m.pack() == m.pack()
    assert len(m.pack()) < len(m.document()) / 5


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"target_version": 1}, "both 1"),
        ({"attempt": "../x"}, "attempt"),
        ({"mode": "fast"}, "mode"),
        ({"extra": 1}, "extra"),
        ({"format_version": 1}, "manifest document format version 1, but this DCR"),
        ({"format_version": 3}, "format_version"),
        ({"format": "dcr-payload"}, "format"),
        ({"base_version": "1"}, "base_version"),  # strict: no string for an integer
        ({"payloads": [{"key": "k", "owner": 0, "seq": 0, "size": 100, "digest": "zz",
                        "items": 1, "records": 1}]}, "digest"),
        ({"tensors": [{"name": "w", "dtype": "BF16", "shape": [2], "base": "xxh3-128:1",
                       "target": FP}]}, "tensors.0.base"),
    ],
)
def test_invalid_manifest_is_rejected_naming_the_field(override: dict[str, object],
                                                       needle: str) -> None:
    with pytest.raises(ManifestError, match=needle) as e:
        Manifest.parse(sealed(**override), "store/v2/manifest.dcrm")
    assert "store/v2/manifest.dcrm" in str(e.value)


def test_a_document_that_is_not_json_is_refused() -> None:
    with pytest.raises(ManifestError, match="invalid"):
        Manifest.parse(seal_document(b'{"base_version": 1,'), "t")


# --- hostile containers -----------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 1, 8, 39, 40, 41, -1])
def test_a_truncated_manifest_is_refused_naming_its_length(keep: int) -> None:
    cut = sealed()[:keep]
    with pytest.raises(ManifestError, match=rf"truncated.*\b{len(cut)} bytes"):
        Manifest.parse(cut, "t")


def test_a_padded_manifest_is_refused_naming_both_lengths() -> None:
    data = sealed()
    with pytest.raises(ManifestError, match=rf"{len(data) + 1} bytes, but its preamble "
                                            rf"declares {len(data)}"):
        Manifest.parse(data + b"\0", "t")


@pytest.mark.parametrize(("data", "needle"), [
    (json.dumps(manifest()).encode(), r"version 1 manifest, plain JSON"),
    (PAYLOAD_MAGIC + bytes(64), r"\(a payload\)"),
    (b"\x28\xb5\x2f\xfd" + bytes(64), r"magic is b'\(\\xb5/\\xfd"),  # a bare zstd frame
    (b"GARBAGE!" + bytes(64), "magic is b'GARBAGE!'"),
])
def test_an_object_of_another_encoding_is_refused_naming_its_magic(data: bytes,
                                                                   needle: str) -> None:
    with pytest.raises(ManifestError, match=rf"is not a DCR manifest: .*{needle}"):
        Manifest.parse(data, "t")


@pytest.mark.parametrize("version", [0, 1, 3, 0xFFFF])
def test_an_unknown_format_version_is_refused_naming_it(version: int) -> None:
    doc = json.dumps(manifest()).encode()
    with pytest.raises(ManifestError, match=rf"has manifest format version {version}, but "
                                            r"this DCR \S+ reads manifest format version 2"):
        Manifest.parse(container(frame(doc), len(doc), version=version), "t")


@pytest.mark.parametrize(("flags", "reserved"), [(1, 0), (0, 7)])
def test_nonzero_reserved_fields_are_refused(flags: int, reserved: int) -> None:
    doc = json.dumps(manifest()).encode()
    with pytest.raises(ManifestError, match=rf"flags={flags}, reserved={reserved}"):
        Manifest.parse(container(frame(doc), len(doc), flags=flags, reserved=reserved), "t")


def test_a_flipped_length_byte_is_a_length_mismatch() -> None:
    data = bytearray(sealed())
    data[12] ^= 0x01
    with pytest.raises(ManifestError, match=r"truncated or padded"):
        Manifest.parse(bytes(data), "t")


@pytest.mark.parametrize("offset", [16, 24, 39, 40, -1])
def test_a_flipped_byte_is_a_digest_mismatch_naming_both_digests(offset: int) -> None:
    """The declared JSON size, the digest itself, the frame's first and last bytes."""
    data = bytearray(sealed())
    data[offset] ^= 0x01
    with pytest.raises(ManifestError, match=r"digest mismatch \(expected [0-9a-f]{32}, got "
                                            r"[0-9a-f]{32}\)"):
        Manifest.parse(bytes(data), "t")


def test_a_declared_json_size_over_the_limit_is_refused_before_decompressing() -> None:
    """A bomb: 2 MiB of JSON in a few hundred bytes, against a 1 MiB limit; and a
    declared size over the default limit, whose frame is never looked at."""
    doc = json.dumps(manifest()).encode() + b" " * (2 << 20)
    small = ManifestLimits(max_json_bytes=1 << 20)
    data = container(frame(doc), len(doc))
    assert len(data) < 1024
    with pytest.raises(ManifestError, match=rf"declares {len(doc)} bytes of JSON, over the "
                                            rf"limit of {1 << 20} \(refused before"):
        Manifest.parse(data, "t", small)
    huge = DEFAULT_MANIFEST_LIMITS.max_json_bytes + 1
    with pytest.raises(ManifestError, match=rf"declares {huge} bytes of JSON"):
        Manifest.parse(container(b"not even a frame", huge), "t")


@pytest.mark.parametrize("declared", [0, 10, 1 << 20])
def test_a_frame_that_disagrees_with_the_declared_size_is_refused(declared: int) -> None:
    doc = json.dumps(manifest()).encode()
    with pytest.raises(ManifestError, match=rf"frame declares {len(doc)} bytes but the "
                                            rf"preamble says {declared}"):
        Manifest.parse(container(frame(doc), declared), "t")


def test_a_frame_without_its_content_size_is_refused() -> None:
    doc = json.dumps(manifest()).encode()
    with pytest.raises(ManifestError, match=rf"preamble says {len(doc)}"):
        Manifest.parse(container(frame(doc, content_size=False), len(doc)), "t")


@pytest.mark.parametrize(("body", "needle"), [
    (b"\x00" * 32, "not a zstd frame"),
    (b"trailing", "does not decompress"),
])
def test_a_document_that_is_not_exactly_one_frame_is_refused(body: bytes, needle: str) -> None:
    doc = json.dumps(manifest()).encode()
    data = body if needle == "not a zstd frame" else frame(doc) + body
    with pytest.raises(ManifestError, match=needle):
        Manifest.parse(container(data, len(doc)), "t")


def test_an_object_over_the_size_limit_is_refused_naming_its_size() -> None:
    data = sealed()
    with pytest.raises(ManifestError, match=rf"{len(data)} bytes, over the limit of 100"):
        Manifest.parse(data, "t", ManifestLimits(max_bytes=100))


def test_too_many_entries_are_refused_before_parsing() -> None:
    """The object count comes first: this document is not even JSON, yet the count
    refuses it."""
    doc = b"{" * 10
    with pytest.raises(ManifestError, match=r"holds 10 JSON objects: more payloads and "
                                            r"tensors than the limit of 4 \(refused before"):
        Manifest.parse(seal_document(doc), "t", ManifestLimits(max_entries=4))
    tensors = [{"name": f"t{i}", "dtype": "BF16", "shape": [1], "base": FP, "target": FP}
               for i in range(5)]
    with pytest.raises(ManifestError, match="holds 8 JSON objects"):
        Manifest.parse(sealed(tensors=tensors), "t", ManifestLimits(max_entries=5))
    assert len(Manifest.parse(sealed(tensors=tensors), "t",
                              ManifestLimits(max_entries=6)).tensors) == 5


def test_the_writer_refuses_what_a_reader_would_refuse() -> None:
    too_many = b"{" * (DEFAULT_MANIFEST_LIMITS.max_entries + 3)
    with pytest.raises(ManifestError, match="The manifest to seal holds"):
        seal_document(too_many)


def _many_tensors(n: int) -> bytes:
    tensors = [{"name": f"model.layers.{i}.w", "dtype": "BF16", "shape": [1], "base": FP,
                "target": FP} for i in range(n)]
    doc = Manifest.model_validate(manifest(tensors=tensors, stats={
        "tensors": n, "changed_elements": 0, "total_elements": n, "dense_bytes": 2 * n,
        "payload_bytes": 100})).document()
    return seal_document(doc)


def test_a_receiver_reads_no_more_entries_than_its_own_model_can_use() -> None:
    """A part well within the default limits (which admit 2^20 entries, about 12 s and
    1.35 GiB per reader) is refused by the limits of a receiver of 10 tensors, before
    it is parsed; one of its own size is read. Fails on 0961110, where every agent read
    any part within the defaults."""
    from dcr.format.manifest import limits_for

    own = limits_for(10)
    assert own.max_entries < 2000
    assert own.max_json_bytes < 5 << 20
    big = _many_tensors(own.max_entries + 1)
    assert len(Manifest.parse(big, "t").tensors) == own.max_entries + 1  # the defaults take it
    with pytest.raises(ManifestError, match=r"than the limit of|over the limit"):
        Manifest.parse(big, "t", own)
    assert len(Manifest.parse(_many_tensors(10), "t", own).tensors) == 10
    assert limits_for(10**7) == DEFAULT_MANIFEST_LIMITS  # never above the defaults


def test_a_relay_reads_the_attempt_from_the_documents_head_and_parses_nothing_else() -> None:
    """``manifest_attempt`` checks the container and the head: a document whose tail is
    not even JSON still names its attempt there (so nothing after the head was parsed);
    one whose fields are not in schema order, or a corrupt container, is refused."""
    from dcr.format.manifest import manifest_attempt

    good = Manifest.model_validate(manifest()).document()
    assert manifest_attempt(seal_document(good), "t") == "a-1"
    assert manifest_attempt(seal_document(good[:200] + b"{{{ not json"), "t") == "a-1"
    reordered = json.dumps({"attempt": "a-1", **manifest()}).encode()
    with pytest.raises(ManifestError, match="does not begin as a version 2 or 3 document"):
        manifest_attempt(seal_document(reordered), "t")
    bad = bytearray(seal_document(good))
    bad[-1] ^= 1
    with pytest.raises(ManifestError, match="digest mismatch"):
        manifest_attempt(bytes(bad), "t")


def ranks_part(base: int, target: int) -> Manifest:
    """A trainer rank's part: its share of the whole tensor's sums (format version 3)."""
    return Manifest.model_validate(manifest(
        format_version=3, payloads=[],
        tensors=[{"name": "w", "dtype": "BF16", "shape": [2, 2],
                  "base": sum_text(base), "target": sum_text(target)}]))


def test_ranks_parts_of_a_tensors_sums_add_into_the_whole_tensors_fingerprints() -> None:
    """Ranks each hold part of ``w``; merged, the manifest lists ``w`` once with the sum
    of their parts, which a reader of a whole copy recomputes (``whole_sum``)."""
    bits = np.arange(4, dtype=np.uint16)
    old = np.zeros(4, dtype=np.uint16)
    parts = [ranks_part(piece_sum(_range(2 * k, 2), old[2 * k: 2 * k + 2], whole((4,)))
                        or 0, piece_sum(_range(2 * k, 2), bits[2 * k: 2 * k + 2],
                                        whole((4,))) or 0) for k in range(2)]
    m = merge_manifests(parts, "a-1")
    assert m.format_version == 3
    assert [(t.name, t.base, t.target) for t in m.tensors] == [
        ("w", whole_sum(old), whole_sum(bits))]
    assert fingerprint_as(m.tensors[0].target, bits, lambda b: "unused") == whole_sum(bits)
    assert Manifest.parse(m.pack(), "t") == m


@pytest.mark.parametrize(("override", "needle"), [
    ({"tensors": [{"name": "w", "dtype": "BF16", "shape": [4], "base": "sum64:" + "0" * 16,
                   "target": "sum64:" + "0" * 16}]}, "exactly when it is version 3"),
    ({"format_version": 3}, "exactly when it is version 3"),
    ({"format_version": 3, "tensors": [{"name": "w", "dtype": "BF16", "shape": [4],
                                        "base": FP, "target": "sum64:" + "0" * 16}]},
     "of two kinds"),
])
def test_sums_as_fingerprints_need_version_3_and_one_kind_per_tensor(
        override: dict[str, object], needle: str) -> None:
    with pytest.raises(ManifestError, match=needle):
        Manifest.parse(sealed(**override), "t")


def test_a_tensor_listed_whole_by_two_parts_is_still_refused() -> None:
    part = Manifest.model_validate(manifest(payloads=[]))
    with pytest.raises(ManifestError, match="listed twice"):
        merge_manifests([part, part], "a-1")


def _range(start: int, count: int) -> Span:
    return start, (count,), (1,)
