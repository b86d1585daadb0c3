"""xxh3-128 of a tensor's bits, computed where the tensor lives.

A manifest's fingerprints are xxh3-128 of each canonical tensor's bytes
(``dcr.checkpoint.fingerprint``). On a GPU, hashing them on the host means copying every
weight across PCIe after every apply. xxh3's long-input loop splits in two: within each
1 KiB block the eight 64-bit accumulators only add (each 8-byte word contributes itself to
one lane and a 32x32-bit product to another), and only between blocks do they scramble.
So the device computes every block's eight lane sums in parallel with torch integer
operations (reading each byte once), the host receives those sums (64 bytes per KiB,
1/16 of the tensor) and folds them in order through the scramble (``_native.xxh3_fold``),
then adds the last partial block and the last stripe and finalizes as xxh3 does. The
result is the same 128 bits as the reference library, which the tests check on the CPU
over every length class; inputs of at most 240 bytes (xxh3's short paths) are hashed on
the host.

All arithmetic is modulo 2**64 in torch's int64 (a 32x32-bit product and sums wrap);
``>>`` on int64 is arithmetic, so every shifted value is masked.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from dcr.codec import _native  # type: ignore[attr-defined]

SECRET = bytes.fromhex(  # xxh3's default secret (192 bytes)
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
STRIPE = 64
STRIPES_PER_BLOCK = (len(SECRET) - STRIPE) // 8  # 16
BLOCK = STRIPE * STRIPES_PER_BLOCK  # 1024 bytes
SHORT_MAX = 240  # xxh3 hashes inputs up to this many bytes by other paths
MASK64 = (1 << 64) - 1
PRIME32_1, PRIME32_2, PRIME32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
PRIME64_1, PRIME64_2, PRIME64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
PRIME64_4, PRIME64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
PRIME_MX1 = 0x165667919E3779F9
INIT_ACC = (PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5,
            PRIME32_1)
CHUNK_BLOCKS = 1 << 15  # blocks per pass on the device: 32 MiB of input, bounded temporaries


def _le64(at: int) -> int:
    return int.from_bytes(SECRET[at : at + 8], "little")


# stripe s of a block reads the secret from byte 8*s: key (s, lane) is the word at 8*(s+lane)
_STRIPE_KEYS = np.array([[_le64(8 * (s + i)) for i in range(8)]
                         for s in range(STRIPES_PER_BLOCK)], dtype=np.uint64).view(np.int64)
_SCRAMBLE_KEYS = np.array([_le64(len(SECRET) - STRIPE + 8 * i) for i in range(8)],
                          dtype=np.uint64)
_LAST_KEYS = [_le64(len(SECRET) - STRIPE - 7 + 8 * i) for i in range(8)]
_SWAP = [1, 0, 3, 2, 5, 4, 7, 6]  # a word adds itself into the neighbouring lane
_LOW32 = 0xFFFFFFFF


def fingerprint(t: torch.Tensor) -> str:
    """``xxh3-128:<hex>`` of ``t``'s bytes in row-major order, as
    :func:`dcr.checkpoint.fingerprint` gives for the same bits on the host."""
    flat = t.contiguous().view(-1)
    data = flat.view(torch.uint8) if flat.element_size() == 1 else _bytes(flat)
    n = data.numel()
    if n <= SHORT_MAX:
        return "xxh3-128:" + xxhash.xxh3_128_hexdigest(data.cpu().numpy().tobytes())
    full = (n - 1) // BLOCK
    tail_stripes = ((n - 1) - BLOCK * full) // STRIPE
    words = full * BLOCK + tail_stripes * STRIPE
    if data.storage_offset() % 8:
        data = data.clone()
    w = data[:words].view(torch.int64)
    keys = torch.from_numpy(_STRIPE_KEYS).to(w.device)
    sums = [_lane_sums(w[lo * 128 : min(full, lo + CHUNK_BLOCKS) * 128].view(-1, 16, 8), keys)
            for lo in range(0, full, CHUNK_BLOCKS)]
    tail = _lane_sums(w[full * 128 :].view(1, tail_stripes, 8), keys[:tail_stripes])
    last = data[n - STRIPE :].clone().view(torch.int64).view(1, 8)  # maybe unaligned
    host = torch.cat([*sums, tail, last]).cpu().numpy()  # the one copy to the host: 1/16
    acc = np.array(INIT_ACC, dtype=np.uint64)
    _native.xxh3_fold(acc, np.ascontiguousarray(host[:full]), _SCRAMBLE_KEYS)
    lanes = [(int(a) + int(b)) & MASK64 for a, b in zip(acc, host[full].view(np.uint64),
                                                          strict=True)]
    _accumulate_512(lanes, [int(x) for x in host[full + 1].view(np.uint64)], _LAST_KEYS)
    low = _merge(lanes, 11, (n * PRIME64_1) & MASK64)
    high = _merge(lanes, len(SECRET) - STRIPE - 11, ~(n * PRIME64_2) & MASK64)
    return f"xxh3-128:{high:016x}{low:016x}"


def _bytes(flat: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor (its element views as uint8, little-endian)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(ints).view(torch.uint8)


def _lane_sums(w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per block (dim 0), each lane's sum over its stripes (dim 1) of xxh3's round: the
    32x32-bit product of the word XOR its key, plus the neighbouring lane's word."""
    if w.numel() == 0:  # a last block of no whole stripes
        return torch.zeros((w.shape[0], 8), dtype=torch.int64, device=w.device)
    dk = w ^ keys
    products = (dk & _LOW32) * ((dk >> 32) & _LOW32)
    return products.sum(dim=1) + w.sum(dim=1)[:, _SWAP]


def _accumulate_512(acc: list[int], data: list[int], keys: list[int]) -> None:
    for i in range(8):
        dk = data[i] ^ keys[i]
        acc[i ^ 1] = (acc[i ^ 1] + data[i]) & MASK64
        acc[i] = (acc[i] + (dk & _LOW32) * (dk >> 32)) & MASK64


def _merge(acc: list[int], at: int, start: int) -> int:
    h = start
    for i in range(4):
        a = acc[2 * i] ^ _le64(at + 16 * i)
        b = acc[2 * i + 1] ^ _le64(at + 16 * i + 8)
        p = a * b
        h = (h + ((p & MASK64) ^ (p >> 64))) & MASK64
    h ^= h >> 37
    h = (h * PRIME_MX1) & MASK64
    return h ^ (h >> 32)
