"""xxh3-128 with its heavy half in torch (``dcr.apply.xxh3``) equals the reference library.

The manifest's fingerprints come from the ``xxhash`` package; the device-side check must
give the same 128 bits for every length: xxh3's short paths (up to 240 bytes, hashed on the
host), one stripe, a partial first block, exact multiples of the 1 KiB block, a last stripe
that overlaps the last whole stripe, many blocks across the chunking of the device pass,
every element width, and tensors that are views at an unaligned byte offset.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from dcr.apply import xxh3
from dcr.checkpoint import fingerprint

LENGTHS = [0, 1, 16, 17, 128, 129, 240, 241, 255, 256, 1023, 1024, 1025, 1087, 1088, 1089,
           2048, 4095, 4097, 16 * 1024 + 63, 100_003]


def _reference(data: bytes) -> str:
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(data)


@pytest.mark.parametrize("n", LENGTHS)
def test_bytes_of_every_length_class_hash_as_the_library_does(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, size=n, dtype=np.uint8)
    assert xxh3.fingerprint(torch.from_numpy(data)) == _reference(data.tobytes())


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                torch.int64, torch.int32, torch.int16, torch.uint8,
                                torch.float8_e4m3fn, torch.bool])
def test_every_element_width_matches_the_manifest_fingerprint(dt: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (3, 1_337 * 8), generator=gen, dtype=torch.uint8)
    t = raw.view(dt) if dt != torch.bool else (raw & 1).view(torch.bool)
    bits = t.contiguous().view(-1)
    host = (bits.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        bits.element_size()]).numpy())
    assert xxh3.fingerprint(t) == fingerprint(host)


def test_many_blocks_across_the_device_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several passes of the device loop (a small chunk here), with a ragged last one."""
    monkeypatch.setattr(xxh3, "CHUNK_BLOCKS", 7)
    data = np.random.default_rng(9).integers(0, 256, size=50 * 1024 + 700, dtype=np.uint8)
    assert xxh3.fingerprint(torch.from_numpy(data)) == _reference(data.tobytes())


def test_views_at_unaligned_offsets_and_strided_tensors() -> None:
    base = torch.randint(-(1 << 15), 1 << 15, (10_000,), dtype=torch.int16)
    for lo in (1, 3, 7):
        view = base[lo:]  # a byte offset of 2, 6, 14: not a multiple of 8
        assert xxh3.fingerprint(view) == fingerprint(view.numpy())
    m = base[:9_000].view(90, 100).t()  # hashed in row-major order of the view
    assert xxh3.fingerprint(m) == fingerprint(m.contiguous().numpy())


def test_one_flipped_bit_anywhere_changes_the_fingerprint() -> None:
    t = torch.zeros(5_000, dtype=torch.int16)
    clean = xxh3.fingerprint(t)
    for at in (0, 511, 512, 2_499, 4_967, 4_999):  # first block, a block edge, last stripe
        bad = t.clone()
        bad[at] ^= 1 << 9
        assert xxh3.fingerprint(bad) != clean, at
        assert xxh3.fingerprint(bad) == fingerprint(bad.numpy())
