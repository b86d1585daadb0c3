"""Shard maps read off a training framework's own layout, for :class:`~dcr.owner.rank.RankOwner`.

:func:`fsdp2_shards` reads FSDP2's ``DTensor`` parameters (``fully_shard``: dimension 0
split in ``torch.chunk`` order, so the last ranks may hold fewer rows or none) and plain
replicated ones; :func:`replicated_shards` splits a module every rank holds whole (DDP) the
same way, so data-parallel ranks share a publish. Megatron-style tensor and expert parallel
layouts are named directly with :class:`~dcr.owner.shards.ShardMap` kinds (``rows``,
``columns``, ``gate_up``, ``qkv``, ``expert``); :func:`megatron_vocab` names a vocabulary-
parallel tensor with its padding. docs/trainer.md, "Owners in the ranks".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from dcr.errors import ConfigError
from dcr.owner.shards import ShardMap

if TYPE_CHECKING:
    import torch

def dtype_name(t: torch.Tensor) -> str:
    """``t``'s dtype as safetensors names it."""
    from dcr.apply.applier import TORCH_DTYPES

    for name, dtype in TORCH_DTYPES.items():
        if dtype == t.dtype:
            return name
    raise ConfigError(f"A {t.dtype} tensor has no safetensors dtype.")


def _canonical_parameters(module: torch.nn.Module, canonical: Callable[[str], str | None],
                          ) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """``module``'s parameters that are part of the checkpoint, as (parameter name,
    canonical name, parameter); two parameters that map to one name are refused."""
    seen: set[str] = set()
    for pname, p in module.named_parameters():
        name = canonical(pname)
        if name is None:
            continue
        if name in seen:
            raise ConfigError(f"Parameters {pname} and another both map to {name}.")
        seen.add(name)
        yield pname, name, p


def _chunk_span(n: int, rank: int, ranks: int) -> tuple[int, int]:
    """The rows ``torch.chunk`` gives ``rank`` of ``n`` split over ``ranks`` (the last
    ranks may get fewer rows or none)."""
    chunk = -(-n // ranks)
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


def fsdp2_shards(module: torch.nn.Module, *, rank: int, ranks: int,
                 canonical: Callable[[str], str | None] = lambda name: name,
                 dtype: torch.dtype | None = None,
                 ) -> tuple[dict[str, ShardMap], dict[str, torch.Tensor]]:
    """This rank's parameters of an FSDP2 ``module`` with their shard maps, keyed by the
    canonical (Hugging Face) name ``canonical`` gives each parameter name (None: not part
    of the checkpoint). A replicated parameter is owned by rank 0. With ``dtype``, the
    tensors are the parameters cast to it, as an export casts them (FP32 master weights
    served as BF16): each a new local copy, of the shard's size."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    maps: dict[str, ShardMap] = {}
    tensors: dict[str, torch.Tensor] = {}
    for pname, name, p in _canonical_parameters(module, canonical):
        if isinstance(p, DTensor):
            local, placements = p.to_local(), tuple(p.placements)
            if placements == (Shard(0),):
                span = _chunk_span(p.shape[0], rank, ranks)
                if local.shape[0] != span[1] - span[0]:
                    raise ConfigError(f"{pname}: rank {rank} holds {local.shape[0]} rows of "
                                      f"{p.shape[0]}; a chunk split over {ranks} ranks gives "
                                      f"it {span[1] - span[0]}.")
                m = ShardMap(kind="rows", canonical=(name,), shape=tuple(p.shape),
                             dtype=dtype_name(local), rank=rank, ranks=ranks, span=span)
            elif all(isinstance(x, Replicate) for x in placements):
                m = ShardMap(kind="replicated", canonical=(name,), shape=tuple(p.shape),
                             dtype=dtype_name(local), rank=rank, ranks=ranks)
            else:
                raise ConfigError(f"{pname} is placed {placements}; FSDP2 shards name "
                                  "Shard(0) on one mesh dimension (for other layouts "
                                  "give ShardMaps yourself).")
        else:
            local = p
            m = ShardMap(kind="replicated", canonical=(name,), shape=tuple(p.shape),
                         dtype=dtype_name(p), rank=rank, ranks=ranks)
        local = local.detach()
        if dtype is not None and local.dtype != dtype:
            local = local.to(dtype)
            m = dataclasses.replace(m, dtype=dtype_name(local))
        maps[name], tensors[name] = m, local
    return maps, tensors


def replicated_shards(module: torch.nn.Module, *, rank: int, ranks: int,
                      canonical: Callable[[str], str | None] = lambda name: name,
                      dtype: torch.dtype | None = None,
                      ) -> tuple[dict[str, ShardMap], dict[str, torch.Tensor]]:
    """Owners for a module every rank holds whole (data parallel, DDP): rank ``rank``
    owns rows ``torch.chunk`` gives it of each parameter's dimension 0 (the last ranks
    may own fewer rows or none), so the ranks split a publish between them and every
    element has one owner. ``canonical`` and ``dtype`` as :func:`fsdp2_shards`; the
    tensors are views of the parameters' rows (copies when cast)."""
    maps: dict[str, ShardMap] = {}
    tensors: dict[str, torch.Tensor] = {}
    for _, name, p in _canonical_parameters(module, canonical):
        start, stop = _chunk_span(p.shape[0], rank, ranks)
        local = p.detach()[start:stop]
        if dtype is not None and local.dtype != dtype:
            local = local.to(dtype)
        maps[name] = ShardMap(kind="rows", canonical=(name,), shape=tuple(p.shape),
                              dtype=dtype_name(local), rank=rank, ranks=ranks,
                              span=(start, stop))
        tensors[name] = local
    return maps, tensors


def megatron_vocab(name: str, shape: tuple[int, ...], dtype: str, *, rank: int, ranks: int,
                   divisible_by: int = 128) -> ShardMap:
    """The shard map of a Megatron vocabulary-parallel tensor (the embedding, or the output
    layer) of canonical ``shape`` (vocabulary, hidden): Megatron pads the vocabulary to a
    multiple of ``divisible_by`` x ``ranks`` (``make_vocab_size_divisible_by``) and gives
    each rank an equal run of the padded rows, so the last ranks hold padding rows, or
    only padding, which are never sent."""
    vocab = shape[0]
    multiple = divisible_by * ranks
    per = -(-vocab // multiple) * multiple // ranks
    start, stop = min(rank * per, vocab), min((rank + 1) * per, vocab)
    return ShardMap(kind="rows", canonical=(name,), shape=shape, dtype=dtype, rank=rank,
                    ranks=ranks, span=(start, stop), pad=per - (stop - start))


__all__ = ["dtype_name", "fsdp2_shards", "megatron_vocab"]
