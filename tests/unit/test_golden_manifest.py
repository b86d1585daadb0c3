"""Golden manifest: a byte-exact fixture that pins manifest format v2 as ``FORMAT.md`` says.

``tests/fixtures/golden_manifest.dcrm`` is one owner's manifest part of a two-payload
attempt over three tensors (one unchanged, so its base and target fingerprints are
equal), built from fixed values and sealed at the writers' zstd level. The tests check
that (a) sealing it today yields exactly the fixture bytes, (b) the preamble fields, the
digest and the frame sit where FORMAT.md puts them, and the document is the pinned JSON
text, and (c) the fixture reads back to the same manifest.

Regenerate (only after a deliberate format change) with::

    DCR_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_golden_manifest.py

As for the golden payloads, the compressed bytes depend on the zstd library bundled with
``zstandard``: if an upgrade of it alone breaks (a) while (b) and (c) pass, the format is
unchanged and regenerating is safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import zstandard

from dcr.format.manifest import Manifest, PayloadEntry, Stats, TensorEntry

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "golden_manifest.dcrm"
REGEN = os.environ.get("DCR_REGEN_GOLDEN") == "1"


def _fp(salt: int) -> str:
    return "xxh3-128:" + hashlib.blake2b(bytes([salt]), digest_size=16).hexdigest()


def golden() -> Manifest:
    attempt = "a-golden01"
    payloads = tuple(
        PayloadEntry(key=f"v0000000005/{attempt}/o0003-s{seq:06d}.dcrp", owner=3, seq=seq,
                     size=size, digest=hashlib.blake2b(bytes([seq]), digest_size=16).hexdigest(),
                     items=items, records=records)
        for seq, size, items, records in ((0, 1234, 2, 8), (1, 567, 1, 3))
    )
    tensors = (
        TensorEntry(name="model.layers.0.mlp.down_proj.weight", dtype="BF16", shape=(16, 64),
                    base=_fp(1), target=_fp(2)),
        TensorEntry(name="model.norm.weight", dtype="F32", shape=(64,), base=_fp(3),
                    target=_fp(3)),
        TensorEntry(name="step", dtype="I64", shape=(), base=_fp(4), target=_fp(5)),
    )
    return Manifest(base_version=4, target_version=5, attempt=attempt, mode="mixed",
                    payloads=payloads, tensors=tensors,
                    stats=Stats(tensors=3, changed_elements=11, total_elements=1089,
                                dense_bytes=2312, payload_bytes=1801))


DOCUMENT = (
    '{"format":"dcr-manifest","format_version":2,"base_version":4,"target_version":5,'
    '"attempt":"a-golden01","mode":"mixed","payloads":['
    '{"key":"v0000000005/a-golden01/o0003-s000000.dcrp","owner":3,"seq":0,"size":1234,'
    f'"digest":"{hashlib.blake2b(bytes([0]), digest_size=16).hexdigest()}","items":2,'
    '"records":8},'
    '{"key":"v0000000005/a-golden01/o0003-s000001.dcrp","owner":3,"seq":1,"size":567,'
    f'"digest":"{hashlib.blake2b(bytes([1]), digest_size=16).hexdigest()}","items":1,'
    '"records":3}],'
    '"tensors":['
    '{"name":"model.layers.0.mlp.down_proj.weight","dtype":"BF16","shape":[16,64],'
    f'"base":"{_fp(1)}","target":"{_fp(2)}"}},'
    f'{{"name":"model.norm.weight","dtype":"F32","shape":[64],"base":"{_fp(3)}",'
    f'"target":"{_fp(3)}"}},'
    f'{{"name":"step","dtype":"I64","shape":[],"base":"{_fp(4)}","target":"{_fp(5)}"}}],'
    '"stats":{"tensors":3,"changed_elements":11,"total_elements":1089,"dense_bytes":2312,'
    '"payload_bytes":1801}}'
).encode()


@pytest.fixture(scope="module", autouse=True)
def _maybe_regenerate() -> None:
    if REGEN:
        FIXTURE.write_bytes(golden().pack())


def fixture_bytes() -> bytes:
    assert FIXTURE.is_file(), f"{FIXTURE} is missing; run with DCR_REGEN_GOLDEN=1 to create it"
    return FIXTURE.read_bytes()


def test_sealing_today_reproduces_the_fixture_bytes() -> None:
    built, want = golden().pack(), fixture_bytes()
    assert len(built) == len(want), f"zstd {zstandard.ZSTD_VERSION}"
    assert built == want


def test_the_document_is_the_pinned_compact_json() -> None:
    assert golden().document() == DOCUMENT


def test_fixture_fields_sit_at_their_documented_offsets() -> None:
    data = fixture_bytes()
    assert data[0:8] == bytes([0x89, 0x44, 0x43, 0x4D, 0x0D, 0x0A, 0x1A, 0x0A])
    assert int.from_bytes(data[8:10], "little") == 2  # format_version
    assert int.from_bytes(data[10:12], "little") == 0  # flags
    packed = int.from_bytes(data[12:16], "little")
    raw = int.from_bytes(data[16:20], "little")
    assert int.from_bytes(data[20:24], "little") == 0  # reserved
    assert struct.unpack_from("<8sHHIII", data) == (b"\x89DCM\r\n\x1a\n", 2, 0, packed, raw, 0)
    assert len(data) == 40 + packed
    assert data[24:40] == hashlib.blake2b(data[:24] + data[40:], digest_size=16,
                                          person=b"dcr-manifest-v2").digest()
    frame = data[40:]
    assert zstandard.frame_content_size(frame) == raw == len(DOCUMENT)
    assert zstandard.ZstdDecompressor().decompress(frame) == DOCUMENT
    assert json.loads(DOCUMENT)["format_version"] == 2


def test_fixture_reads_back_to_the_manifest_it_was_built_from() -> None:
    assert Manifest.parse(fixture_bytes(), str(FIXTURE)) == golden()
