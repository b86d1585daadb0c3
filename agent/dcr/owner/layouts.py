"""Shard maps read off a training framework's own layout, for :class:`~dcr.owner.rank.RankOwner`.

:func:`fsdp2_shards` reads FSDP2's ``DTensor`` parameters (``fully_shard``: dimension 0
split in ``torch.chunk`` order, so the last ranks may hold fewer rows or none; HSDP's
replicas; FSDP2 over tensor parallelism) and plain replicated ones;
:func:`replicated_shards` splits a module every rank holds whole (DDP) the same way, so
data-parallel ranks share a publish. Megatron-style tensor and expert parallel layouts are
named directly with :class:`~dcr.owner.shards.ShardMap` kinds (``rows``, ``columns``,
``gate_up``, ``qkv``, ``expert``); :func:`megatron_vocab` names a vocabulary-parallel
tensor with its padding. docs/trainer.md, "Owners in the ranks".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from dcr.errors import ConfigError
from dcr.owner.shards import ShardMap

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

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
                 dtype: torch.dtype | None = None, copies: Sequence[str] | None = None,
                 ) -> tuple[dict[str, ShardMap], dict[str, torch.Tensor]]:
    """This rank's parameters of an FSDP2 ``module`` with their shard maps, keyed by the
    canonical (Hugging Face) name ``canonical`` gives each parameter name (None: not part
    of the checkpoint). ``rank`` and ``ranks`` are the global rank and world size.

    A ``DTensor`` parameter may lie on a mesh of any dimensions, as long as each rank
    holds one box of it: FSDP2's ``Shard(0)`` chunks, HSDP's replicas of them
    (``Replicate``, ``Shard(0)``) and FSDP2 over tensor parallelism (FSDP's strided
    ``Shard(0)`` over a TP row or column split). Where a mesh dimension replicates the
    parameter, the ranks at its coordinate 0 own it and the others leave it out, so every
    element has one owner; a plain parameter is rank 0's. ``Partial`` sums, and strided
    shards that do not leave one box per rank, are refused.

    A parameter on a slice of the world mesh (the norms a TP plan leaves to FSDP on the
    data-parallel dimension) needs ``copies``: the world-mesh dimensions whose other
    coordinates hold copies of it (``("tp",)`` there), whose coordinate 0 then owns it.
    ``()`` says the other dimensions hold other parameters (pipeline stages); without
    ``copies`` such a parameter is refused rather than guessed at.

    With ``dtype``, the tensors are the parameters cast to it, as an export casts them
    (FP32 master weights served as BF16): each a new local copy, of the shard's size."""
    from torch.distributed.tensor import DTensor

    maps: dict[str, ShardMap] = {}
    tensors: dict[str, torch.Tensor] = {}
    for pname, name, p in _canonical_parameters(module, canonical):
        if isinstance(p, DTensor):
            local = p.to_local()
            m = _dtensor_map(pname, name, p, local, rank, ranks, copies)
            if m is None:
                continue  # a replica or a copy: another rank owns it
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


def _dtensor_map(pname: str, name: str, p: torch.distributed.tensor.DTensor,
                 local: torch.Tensor, rank: int, ranks: int, copies: Sequence[str] | None
                 ) -> ShardMap | None:
    """Where ``p``'s local shard lies in the canonical tensor ``name``; None where a
    replicated mesh dimension, or a copy on another slice of the world mesh, owns it."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(p.placements)
    if any(isinstance(x, Partial) for x in placements):
        raise ConfigError(f"{pname} is placed {placements}: a Partial placement holds "
                          "summands, not elements; reduce it before offering.")
    _check_strided(pname, placements, p.device_mesh)
    coordinate = p.device_mesh.get_coordinate()
    if coordinate is None:
        raise ConfigError(f"{pname}: rank {rank} is not in its device mesh.")
    if any(isinstance(x, Replicate) and c for x, c in zip(placements, coordinate, strict=True)):
        return None
    if _a_copy_elsewhere_owns(pname, p.device_mesh, ranks, copies):
        return None
    shape = tuple(p.shape)
    dt = dtype_name(local)
    if all(isinstance(x, Replicate) for x in placements):
        return ShardMap(kind="replicated", canonical=(name,), shape=shape, dtype=dt)
    # The box's first element: with the checks above, the rank's rows (and columns) run on
    # from there contiguously, so the size and this offset say where all of it lies.
    sizes, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    if tuple(local.shape) != tuple(sizes):
        raise ConfigError(f"{pname} is placed {placements}: rank {rank} holds "
                          f"{list(local.shape)}, not the {list(sizes)} its placements give "
                          "it; only layouts of one box per rank can be offered.")
    rows = (offset[0], offset[0] + sizes[0])
    if tuple(sizes[1:]) == shape[1:]:
        return ShardMap(kind="rows", canonical=(name,), shape=shape, dtype=dt, rank=rank,
                        ranks=ranks, span=rows)
    if len(shape) == 2:
        return ShardMap(kind="columns", canonical=(name,), shape=shape, dtype=dt,
                        rank=rank, ranks=ranks, span=rows,
                        cols=(offset[1], offset[1] + sizes[1]))
    raise ConfigError(f"{pname} {list(shape)} is placed {placements}: rank {rank} holds a "
                      f"{list(sizes)} box at {list(offset)}, split past the first two "
                      "dimensions; give its ShardMap yourself.")


def _check_strided(pname: str, placements: tuple[Placement, ...], mesh: DeviceMesh) -> None:
    """Refuse strided shards that leave a rank rows that do not run on contiguously.

    Plain ``Shard`` placements split left to right, each a ``torch.chunk`` of the last:
    one box per rank. A ``_StridedShard(d, split_factor=k)`` stands for a split made
    before the plain ``Shard(d)`` after it (FSDP2 over TP: TP's rows first, FSDP's chunks
    of them): a box exactly when those later splits make ``k`` parts and no split of
    ``d`` comes before it. Any other use interleaves rows (``Shard(0)`` then
    ``_StridedShard(0, split_factor=2)`` gives a rank rows 0 and 2).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for i, x in enumerate(placements):
        if not isinstance(x, _StridedShard):
            continue
        before = [y for y in placements[:i] if isinstance(y, Shard | _StridedShard)
                  and y.dim == x.dim]
        later = math.prod(mesh.size(j) for j, y in enumerate(placements)
                          if j > i and type(y) is Shard and y.dim == x.dim)
        if before or later != x.split_factor:
            raise ConfigError(f"{pname} is placed {placements}: its strided shard of "
                              f"dimension {x.dim} leaves a rank rows that do not run on "
                              "contiguously (FSDP2 over TP places _StridedShard(d, "
                              "split_factor=k) before the TP Shard(d) of k parts); give "
                              "its ShardMap yourself.")


def _a_copy_elsewhere_owns(pname: str, mesh: DeviceMesh, ranks: int,
                           copies: Sequence[str] | None) -> bool:
    """Whether a copy of a parameter on another slice of the world mesh owns it: ``mesh``
    is a slice, ``copies`` names world-mesh dimensions that hold copies, and this rank's
    coordinate on one of them is not 0."""
    root = mesh._get_root_mesh()
    if mesh.ndim >= root.ndim:  # the world mesh itself, not a slice of it
        if mesh.size() != ranks:
            raise ConfigError(f"{pname} lies on a mesh of {mesh.size()} of {ranks} ranks "
                              "that is no slice of a world mesh, so which copy owns it "
                              "cannot be told; slice its mesh from one (init_device_mesh).")
        return False
    names, world = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
    if copies is None:
        raise ConfigError(f"{pname} lies on the slice {list(names)} of the world mesh "
                          f"{list(world)}: say which other dimensions hold copies of it "
                          "(copies=('tp',) for the norms of FSDP2 over TP; copies=() where "
                          "they hold other parameters, as pipeline stages do).")
    unknown = [c for c in copies if c not in world or c in names]
    if unknown:
        raise ConfigError(f"copies names {unknown}: not dimensions of the world mesh "
                          f"{list(world)} that {pname}'s slice {list(names)} lacks.")
    where = root.get_coordinate()
    assert where is not None  # this rank is in the slice, so in the world mesh
    return any(c for n, c in zip(world, where, strict=True) if n in copies)


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
