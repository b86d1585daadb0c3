"""Prewarm's half of the applier: the values a prewarm records (the canonical tensors, each
intercepted write as geometry, a tensor's plan) and the pure decisions made from them: a
tensor's class, whether its writes cover it, and whether two canonical tensors write the
same bytes. ``docs/apply.md`` ("Prewarm and the receiver profile") argues the classes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dcr.apply.geometry import UnsupportedView, View, check_invertible, is_rowmajor
from dcr.apply.intercept import LoaderPathError, storage_key
from dcr.format.dtypes import DTYPES
from dcr.format.profile import TensorClass
from dcr.format.regions import MAX_SPANS, Span

FLOATS = {"F64", "F32", "F16", "BF16"}  # dtypes whose NaN can mark "no value here"

@dataclass(frozen=True, kw_only=True)
class CanonicalTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, kw_only=True)
class CopySig:
    """One intercepted write, as geometry: where it lands and what it reads."""

    storage: str
    dst: View
    src: View | None  # the scratch view it copies, or None for a converted source
    dst_dtype: str
    src_dtype: str  # "fill" for a constant fill

    @property
    def is_fill(self) -> bool:
        return self.src_dtype == "fill"

    @property
    def mapped(self) -> bool:
        """A same-dtype copy of a scratch view: positions map one to one."""
        return self.src is not None and self.src_dtype == self.dst_dtype


@dataclass(frozen=True, kw_only=True)
class TensorPlan:
    cls: TensorClass
    writes: tuple[CopySig, ...]
    # every write a mapped copy or a fill, and the load reads no parameter storage:
    # its writes can wait until the whole set's loader call has been checked
    deferrable: bool = False



def classify(t: CanonicalTensor, sigs: list[CopySig], converting_ok: bool) -> TensorClass:
    """A tensor's path from the writes its load made at prewarm (``docs/apply.md``)."""
    copies = [s for s in sigs if not s.is_fill]
    fills = [s.dst for s in sigs if s.is_fill]
    if fills and _overlap([s.dst for s in copies], fills, by=sigs, within=False):
        return "dense"  # a constant fill under a copy: only a whole load reproduces it
    mapped = all(s.mapped for s in copies)
    if mapped and not _overlap([s.dst for s in copies], [], by=copies):
        return "xor"
    if mapped:
        return "overwrite"
    return "overwrite" if t.dtype in FLOATS and converting_ok else "dense"


def held_spans(plan: TensorPlan) -> tuple[Span, ...]:
    """The canonical spans an ``xor`` plan's copies read, sorted: the region a rank holds
    of a tensor it holds in part. None past ``MAX_SPANS`` (a loader writing row by row):
    such a tensor goes unchecked on this rank."""
    spans = sorted((w.src.offset, w.src.sizes, w.src.strides) for w in plan.writes
                   if w.src is not None)
    return tuple(spans) if len(spans) <= MAX_SPANS else ()


def signature(storage: str, dst: torch.Tensor, src: torch.Tensor | None,
              dtype: torch.dtype, scratch_key: tuple[str, int]) -> CopySig:
    """What a write does, as geometry; ``dtype`` is the canonical tensor's (a source
    sharing the scratch, ``scratch_key``, in that dtype is a view of it). Called once per
    write, so it reads metadata only and makes no tensor."""
    if src is None:
        return CopySig(storage=storage, dst=View.of(dst), src=None,
                       dst_dtype=str(dst.dtype), src_dtype="fill")
    shares = storage_key(src) == scratch_key
    if tuple(src.shape) != tuple(dst.shape):
        raise LoaderPathError(
            f"The loader copies a {list(src.shape)} source into a {list(dst.shape)} "
            f"view of {storage!r}; broadcasting copies are not supported."
        )
    src_view = View.of(src) if shares and src.dtype == dtype else None
    try:
        if src_view is not None:
            check_invertible(src_view)
            check_invertible(View.of(dst))
    except UnsupportedView:
        src_view = None
    return CopySig(storage=storage, dst=View.of(dst), src=src_view,
                   dst_dtype=str(dst.dtype), src_dtype=str(src.dtype))

def check_overlaps(tensors: dict[str, torch.Tensor],
                   touched: dict[str, list[tuple[str, View]]]) -> None:
    """Raise if two canonical tensors write the same bytes of one of ``tensors`` (the
    runtime's, by name): those cannot be refit by parts."""
    for storage, writes in touched.items():
        names = sorted({name for name, _ in writes})
        if len(names) < 2:
            continue
        if len(names) > torch.iinfo(torch.int16).max:
            raise LoaderPathError(f"{len(names)} canonical tensors write {storage!r}.")
        base = tensors[storage]
        size = base.untyped_storage().nbytes() // base.element_size()
        owner = torch.full((size,), -1, dtype=torch.int16, device=base.device)
        for name, v in writes:
            me = names.index(name)
            region = owner.as_strided(v.sizes, v.strides, v.offset)
            others = region[(region >= 0) & (region != me)]
            if others.numel():
                raise LoaderPathError(
                    f"Canonical tensors {name!r} and {names[int(others[0])]!r} both write "
                    f"{storage!r}; a refit by parts cannot reproduce a dense load."
                )
            region.fill_(me)



def covers(t: CanonicalTensor, writes: Sequence[CopySig]) -> bool:
    """Whether the writes' source views cover every element of the canonical tensor (a
    rank that holds only a shard of it cannot recompute the tensor's fingerprint)."""
    numel = t.nbytes // DTYPES[t.dtype].itemsize
    views = [w.src for w in writes if w.src is not None]
    if any(v.offset == 0 and v.numel == numel and is_rowmajor(v) for v in views):
        return True
    if sum(v.numel for v in views) < numel:
        return False
    seen = torch.zeros(numel, dtype=torch.bool)
    for v in views:
        seen.as_strided(v.sizes, v.strides, v.offset).fill_(True)
    return bool(seen.all())



def _overlap(views: list[View], others: list[View], *, by: Sequence[CopySig],
             within: bool = True) -> bool:
    """Whether one of ``views`` shares an element with ``others`` or (``within``) with
    another of ``views``. Views are compared per storage (``by`` gives their storages).
    """
    storage_of = {id(s.dst): s.storage for s in by}
    groups: dict[str, tuple[list[View], list[View]]] = defaultdict(lambda: ([], []))
    for v in views:
        groups[storage_of[id(v)]][0].append(v)
    for v in others:
        groups[storage_of[id(v)]][1].append(v)
    for mine, theirs in groups.values():
        if not mine or len(mine) + len(theirs) < 2:
            continue
        seen = torch.zeros(max(1, *(_extent(v) for v in mine + theirs)), dtype=torch.bool)
        for v in mine:
            region = seen.as_strided(v.sizes, v.strides, v.offset)
            if within and bool(region.any()):
                return True
            region.fill_(True)
        for v in theirs:
            if bool(seen.as_strided(v.sizes, v.strides, v.offset).any()):
                return True
    return False


def _extent(v: View) -> int:
    return v.offset + sum((n - 1) * st for n, st in zip(v.sizes, v.strides, strict=True)) + 1
