"""Regions: the canonical elements a rank holds of a tensor it holds in part.

A tensor- or expert-parallel rank holds a shard of a canonical tensor, so it cannot
recompute the tensor's xxh3-128 fingerprint without a gather. Its profile names what it
holds instead: each write its loader made at prewarm reads one strided view of the
canonical tensor (a *span*: offset, sizes and strides, in elements), and the region is
the list of them. The owner writes, per region, an additive fingerprint of the target's
bits there (``dcr.codec.sums``); after apply the rank recomputes it from what its storage
holds. ``docs/protocol.md``, "What is checked before and after apply".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Annotated

from pydantic import Field

from dcr.errors import ConfigError

MAX_SPANS = 64  # spans in one region: a rank whose loader makes more writes is unchecked
MAX_DIMS = 16  # dimensions of one span (the codec's kernel takes at most this many)
SUM_PATTERN = r"^sum64:[0-9a-f]{16}$"

Dims = Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(max_length=MAX_DIMS)]
Span = tuple[Annotated[int, Field(ge=0)], Dims, Dims]  # offset, sizes, strides
Spans = Annotated[tuple[Span, ...], Field(min_length=1, max_length=MAX_SPANS)]


def region_key(tensor: str, spans: Sequence[Span]) -> str:
    """The name a region's check goes by, next to whole tensors' names, in the
    fingerprints a receiver compares (tensor names hold no ``@``)."""
    parts = (f"{o}:{','.join(map(str, s))}:{','.join(map(str, t))}" for o, s, t in spans)
    return f"{tensor}@{';'.join(parts)}"


def extent(span: Span) -> tuple[int, int]:
    """The first and last canonical index a non-empty span reaches."""
    offset, sizes, strides = span
    return offset, offset + sum((n - 1) * t for n, t in zip(sizes, strides, strict=True))


def whole(shape: Sequence[int]) -> Spans:
    """The region of every element of a tensor of ``shape``: what owners that hold no whole
    tensor (shard and rank owners) write a sum of, for the ranks that hold it whole."""
    return ((0, (math.prod(shape),), (1,)),)


def check_spans(tensor: str, spans: Iterable[Span], shape: Sequence[int]) -> None:
    """Raise naming the span unless every span lies inside a tensor of ``shape``."""
    numel = math.prod(shape)
    for offset, sizes, strides in spans:
        if len(sizes) != len(strides):
            raise ConfigError(f"A region of {tensor!r} has a span of sizes {list(sizes)} with "
                              f"strides {list(strides)}: one stride per size.")
        last = extent((offset, sizes, strides))[1]
        if math.prod(sizes) and last >= numel:
            raise ConfigError(f"A region of {tensor!r} {list(shape)} has a span reaching "
                              f"element {last} (offset {offset}, sizes {list(sizes)}, strides "
                              f"{list(strides)}); the tensor has {numel}.")
        dims = sorted(((t, n) for n, t in zip(sizes, strides, strict=True) if n > 1),
                      reverse=True)
        for (big, _), (small, n) in itertools.pairwise(dims):
            if not small or big % small or (n - 1) * small >= big:
                raise ConfigError(f"A region of {tensor!r} has a span whose strides do not "
                                  f"nest (sizes {list(sizes)}, strides {list(strides)}): "
                                  "a loader's writes read views that slice, narrow or "
                                  "transpose, never ones that overlap.")


def sum_text(value: int) -> str:
    return f"sum64:{value & (1 << 64) - 1:016x}"


def sum_value(text: str) -> int:
    return int(text.removeprefix("sum64:"), 16)
