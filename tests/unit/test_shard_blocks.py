"""A shard that is a block of its canonical tensor (FSDP2's row chunk of a tensor-parallel
column split): ``ShardMap(kind="columns", span=rows, cols=columns)``. Its changes land at
their canonical positions, the blocks of a tiling each own their elements once, and maps
that name no block of the tensor are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from dcr.errors import ConfigError
from dcr.owner.shards import ShardMap

SHAPE = (7, 10)
# rows split 4 + 3 (torch.chunk), columns 6 + 4: four blocks, uneven both ways
TILES = [((0, 4), (0, 6)), ((0, 4), (6, 10)), ((4, 7), (0, 6)), ((4, 7), (6, 10))]


def block(rows: tuple[int, int], cols: tuple[int, int], rank: int) -> ShardMap:
    return ShardMap(kind="columns", canonical=("w",), shape=SHAPE, dtype="BF16", rank=rank,
                    ranks=len(TILES), span=rows, cols=cols)


@pytest.mark.parametrize("entry", ["xor", "overwrite"])
def test_the_blocks_of_a_tiling_carry_every_change_to_its_canonical_place(entry: str) -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**16, SHAPE, dtype=np.uint16)
    target = base.copy()
    target[rng.random(SHAPE) < 0.3] ^= 0x0101
    rebuilt = base.reshape(-1).copy()
    owned = np.zeros(base.size, dtype=np.int64)
    for rank, (rows, cols) in enumerate(TILES):
        m = block(rows, cols, rank)
        local_base = np.ascontiguousarray(base[rows[0]:rows[1], cols[0]:cols[1]])
        local_target = np.ascontiguousarray(target[rows[0]:rows[1], cols[0]:cols[1]])
        assert m.local_shape() == local_base.shape
        for item in m.project(local_base, local_target, entry):  # type: ignore[arg-type]
            at = item.start + item.positions
            row, column = divmod(item.start, SHAPE[1])  # an item: one row's columns here
            assert rows[0] <= row < rows[1]
            assert (column, item.stop - item.start) == (cols[0], cols[1] - cols[0])
            if entry == "xor":
                rebuilt[at] ^= item.values
            else:
                rebuilt[at] = item.values
        for _, (offset, sizes, strides), bits in m.pieces(local_base):
            index = offset + sum(np.indices(sizes)[d] * strides[d] for d in range(len(sizes)))
            assert np.array_equal(base.reshape(-1)[index.reshape(-1)], bits.reshape(-1))
            owned[index.reshape(-1)] += 1
    assert np.array_equal(rebuilt, target.reshape(-1))
    assert (owned == 1).all()


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"kind": "columns", "span": (3, 8)}, "rows [3, 8] are not a span"),
    ({"kind": "columns", "cols": (4, 11)}, "columns [4, 11] are not a span"),
    ({"kind": "rows", "span": (0, 4), "cols": (0, 5)}, "columns [0, 5] are not a span"),
    ({"kind": "columns", "span": (0, 4), "pad": 2}, "2 padding rows need a rows split"),
    ({"kind": "columns", "span": (0, 4)}, "does not split into 3 equal parts"),
])
def test_maps_that_name_no_block_of_the_tensor_are_refused(kwargs: dict[str, object],
                                                            says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        ShardMap(canonical=("w",), shape=SHAPE, dtype="BF16", rank=0, ranks=3,
                 **kwargs)  # type: ignore[arg-type]
