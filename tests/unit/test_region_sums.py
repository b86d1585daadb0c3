"""Region sums: the additive fingerprint a rank holding part of a tensor checks.

The C kernels (``_native.span_sum``, ``index_sum``) and torch's (``dcr.apply.sums``) give
the sum a plain Python loop over the definition gives, for every element width and span
shape; owners' parts add up to the whole region's sum however the tensor is cut; one
flipped bit anywhere changes it; spans outside the tensor are refused before anything
is read; manifests and profiles carry regions and sums, and keep their old bytes without.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcr.apply import sums as torch_sums
from dcr.apply.sums import span_sum_torch
from dcr.codec.sums import FMIX, KEY, MASK64, piece_sum, region_sum
from dcr.errors import ConfigError
from dcr.format.manifest import Manifest, RegionSum, Stats
from dcr.format.profile import ReceiverProfile, merge
from dcr.format.regions import Span, check_spans, region_key, sum_text

UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _definition(flat: np.ndarray, spans: list[Span]) -> int:
    """The sum as ``dcr.codec.sums`` defines it, one element at a time."""
    total = 0
    for offset, sizes, strides in spans:
        for k in np.ndindex(*sizes):
            i = offset + sum(a * b for a, b in zip(k, strides, strict=True))
            x = (int(flat[i]) * KEY + i) & MASK64
            x ^= x >> 33
            x = (x * FMIX[0]) & MASK64
            x ^= x >> 33
            x = (x * FMIX[1]) & MASK64
            total += x ^ (x >> 33)
    return total & MASK64


SPANS: list[list[Span]] = [
    [(0, (48,), (1,))],  # the whole tensor
    [(8, (3, 4), (8, 1))],  # a block of rows' columns
    [(1, (8, 3), (6, 2))],  # every other column of each row
    [(0, (8, 6), (1, 8))],  # transposed
    [(5, (), ())],  # one element, as a 0-d view
    [(0, (0, 4), (8, 1))],  # empty
    [(0, (2, 8), (8, 1)), (0, (2, 8), (8, 1))],  # a multiset: a replicated write, twice
]


@pytest.mark.parametrize("chunk", [1 << 24, 5], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("spans", SPANS, ids=[str(i) for i in range(len(SPANS))])
def test_the_kernels_and_torch_sum_as_the_definition_says(
        width: int, spans: list[Span], chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's passes in chunks of 5 elements too: rows split, and several rows a pass."""
    monkeypatch.setattr(torch_sums, "CHUNK", chunk)
    dt = UNSIGNED[width]
    flat = np.random.default_rng(width).integers(0, np.iinfo(dt).max, size=48, dtype=dt,
                                                 endpoint=True)
    want = _definition(flat, spans)
    assert region_sum(flat, spans) == want
    t = torch.from_numpy(flat.view(f"i{width}") if width > 1 else flat)
    assert t.dtype == SIGNED[width]
    got = sum(span_sum_torch(t.as_strided(s, st, o), (o, s, st)) for o, s, st in spans)
    assert got & MASK64 == want


def test_owners_parts_add_up_to_the_region_however_the_tensor_is_cut() -> None:
    """A 16 x 12 tensor cut into dim-0 chunks (FSDP), column blocks (row-parallel TP)
    and single rows; a receiver's region (a TP rank's column half, with a second span)
    summed from the parts equals its sum over the whole tensor."""
    rows, cols = 16, 12
    flat = np.random.default_rng(7).integers(0, 1 << 16, size=rows * cols, dtype=np.uint16)
    m = flat.reshape(rows, cols)
    region: list[Span] = [(6, (rows, 6), (cols, 1)), (0, (2, 3), (cols, 1))]
    whole = region_sum(flat, region)
    cuts: list[list[tuple[Span, np.ndarray]]] = [
        [((r0 * cols, ((r1 - r0) * cols,), (1,)), m[r0:r1]) for r0, r1 in
         ((0, 5), (5, 11), (11, 16))],
        [((c0, (rows, c1 - c0), (cols, 1)), m[:, c0:c1]) for c0, c1 in ((0, 4), (4, 12))],
        [((r * cols, (cols,), (1,)), m[r]) for r in range(rows)],
    ]
    for pieces in cuts:
        parts = [piece_sum(p, b, region) for p, b in pieces]
        assert sum(x for x in parts if x is not None) & MASK64 == whole
    assert piece_sum((100, (5,), (1,)), m[8, 4:9], [(0, (2, 3), (cols, 1))]) is None


def test_one_flipped_bit_anywhere_changes_the_sum() -> None:
    """A wrong element changes its term (bits * KEY + index is one to one in the bits,
    fmix64 is a bijection), so every single-bit error is caught, not most."""
    flat = np.random.default_rng(3).integers(0, 1 << 16, size=6 * 8, dtype=np.uint16)
    spans: list[Span] = [(0, (6, 8), (8, 1))]
    want = region_sum(flat, spans)
    for i in range(flat.size):
        for bit in range(16):
            hurt = flat.copy()
            hurt[i] ^= np.uint16(1 << bit)
            assert region_sum(hurt, spans) != want, (i, bit)
    swapped = flat.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert flat[0] == flat[1] or region_sum(swapped, spans) != want  # places count too


def test_spans_outside_the_tensor_are_refused_naming_them() -> None:
    check_spans("w", [(8, (3, 4), (8, 1))], (6, 8))
    with pytest.raises(ConfigError, match=r"reaching element 48 .*the tensor has 48"):
        check_spans("w", [(21, (4, 4), (8, 1))], (6, 8))
    with pytest.raises(ConfigError, match="one stride per size"):
        check_spans("w", [(0, (4, 4), (8,))], (6, 8))
    check_spans("w", [(10**9, (0,), (1,))], (6, 8))  # empty: reads nothing


def test_a_hostile_profile_region_fails_the_owner_before_any_read() -> None:
    """A receiver's profile travels to the owner; a span past the tensor's end is refused
    by name before the owner gathers a byte (numpy's as_strided would read past it)."""
    from dcr.checkpoint import ArrayCheckpoint
    from dcr.owner.diff import target_sums

    source = ArrayCheckpoint({"w": ("F32", (6, 8), np.zeros(48, dtype=np.uint32))})
    (info,) = list(source)
    with pytest.raises(ConfigError, match=r"'w' \[6, 8\] has a span reaching element 4000"):
        target_sums(source, info, [((0, (2,), (4000,)),)])


def test_profiles_merge_regions_of_every_rank_and_only_for_xor_tensors() -> None:
    a = ReceiverProfile(tensors={"w": "xor", "v": "xor"},
                        regions={"w": (((0, (4,), (1,)),),), "v": (((0, (2,), (1,)),),)})
    b = ReceiverProfile(tensors={"w": "xor", "v": "overwrite"},
                        regions={"w": (((4, (4,), (1,)),),)})
    m = merge([a, b, a])
    assert m.regions == {"w": (((0, (4,), (1,)),), ((4, (4,), (1,)),))}
    assert ReceiverProfile.model_validate_json(m.model_dump_json()) == m


def test_manifests_add_owners_parts_and_keep_their_bytes_without_sums() -> None:
    spans: tuple[Span, ...] = ((0, (4,), (1,)),)
    base = {"base_version": 0, "target_version": 1, "attempt": "a-0000000000aa",
            "mode": "mixed", "payloads": (), "tensors": (),
            "stats": Stats(tensors=0, changed_elements=0, total_elements=0, dense_bytes=0,
                           payload_bytes=0)}
    plain = Manifest(**base)  # type: ignore[arg-type]
    assert b"sums" not in plain.document()  # the bytes of a manifest before regions
    parts = (RegionSum(tensor="w", spans=spans, sum=sum_text(MASK64)),
             RegionSum(tensor="w", spans=spans, sum=sum_text(2)))
    m = Manifest(**base, sums=parts)  # type: ignore[arg-type]
    again = Manifest.parse(m.pack(), "t")
    assert again == m
    assert again.region_sums() == {region_key("w", spans): sum_text(1)}  # modulo 2**64
    with pytest.raises(ValueError, match="String should match pattern"):
        RegionSum(tensor="w", spans=spans, sum="xxh3-128:" + "0" * 32)


def test_spans_whose_strides_do_not_nest_are_refused() -> None:
    """An owner finds a change's place in a region by its strides, largest first, which is
    exact only for strides that nest (as slicing, narrowing and transposing make)."""
    check_spans("w", [(0, (8, 6), (1, 8))], (6, 8))  # transposed: nests
    with pytest.raises(ConfigError, match=r"strides do not nest \(sizes \[3, 4\], strides "):
        check_spans("w", [(0, (3, 4), (4, 3))], (6, 8))  # rows overlap columns
    with pytest.raises(ConfigError, match="do not nest"):
        check_spans("w", [(0, (3, 4), (0, 1))], (6, 8))  # a broadcast row
