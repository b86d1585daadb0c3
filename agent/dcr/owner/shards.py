"""Direct projection: a trainer rank's shards, encoded in canonical coordinates.

A :class:`ShardMap` says where each element of a local TP/EP shard lives in the canonical
tensors, so a rank diffs its own shards against its baseline shards and emits items in
canonical coordinates, with no gather. Ranks are owners whose items never overlap. The
shard kinds: docs/protocol.md, "Parties".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

from dcr.codec.changes import Changes, find_changes
from dcr.codec.encode import ItemDelta, encode_item
from dcr.codec.planes import UInt
from dcr.codec.sums import MASK64, delta_sum, piece_sum, span_at
from dcr.errors import ConfigError
from dcr.format.dtypes import dtype as dtype_of
from dcr.format.manifest import Manifest, RegionSum, TensorEntry
from dcr.format.names import EntryKind
from dcr.format.payload import DEFAULT_LIMITS
from dcr.format.profile import ReceiverProfile
from dcr.format.regions import Span, Spans, check_spans, sum_text, whole
from dcr.owner.settings import EncodeSettings
from dcr.owner.state import OwnerState
from dcr.owner.writer import AttemptWriter
from dcr.protocol.records import Attempt, CommitRecord
from dcr.transport.store import Store

ShardKind = Literal["replicated", "rows", "columns", "gate_up", "qkv", "expert"]
# (canonical tensor, canonical indices, old bits, new bits) of one piece's changes
OnChanges = Callable[[str, np.ndarray, UInt, UInt], None]


@dataclass(frozen=True, kw_only=True)
class ShardMap:
    """Where one local tensor's elements live in the canonical tensors."""

    kind: ShardKind
    canonical: tuple[str, ...]  # one name; ``gate_up``: (gate, up); ``qkv``: (q, k, v)
    shape: tuple[int, ...]  # canonical shape (of each, for ``gate_up``; of q for ``qkv``)
    dtype: str  # safetensors dtype name, the same locally and canonically
    rank: int = 0
    ranks: int = 1
    expert: int = 0  # ``expert``: index into the local stack
    # ``rows`` and ``columns``: this shard's rows [start, stop) of dimension 0, for splits
    # that are not ``ranks`` equal parts (FSDP2 chunks: the last ranks may hold fewer, or
    # none); a ``columns`` shard with a span is a block (FSDP2 over a tensor-parallel row
    # split: some rows of a column slice).
    span: tuple[int, int] | None = None
    # ``columns`` only: this shard's columns [start, stop), where they are not the
    # ``rank``-th of ``ranks`` equal parts.
    cols: tuple[int, int] | None = None
    # ``rows`` with ``span`` only: rows after the span that the local shard holds but the
    # canonical tensor does not (Megatron's vocabulary padding); never sent.
    pad: int = 0
    # ``qkv`` only: (attention heads, key/value heads). The local tensor is Megatron's
    # fused layout: this rank's query groups, each its query heads, then k, then v.
    heads: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        want = {"gate_up": 2, "qkv": 3}.get(self.kind, 1)
        if len(self.canonical) != want:
            raise ConfigError(f"A {self.kind} shard map names {want} canonical tensors, not "
                              f"{self.canonical}.")
        if not 0 <= self.rank < self.ranks:
            raise ConfigError(f"Shard rank {self.rank} is outside 0..{self.ranks - 1}.")
        if self.kind in ("rows", "gate_up", "columns") and not self.shape:
            raise ConfigError(f"A {self.kind} split of a scalar {self.canonical} is undefined.")
        if self.kind == "columns" and len(self.shape) != 2:
            raise ConfigError(f"A columns split needs a 2-D tensor; {self.canonical[0]} is "
                              f"{list(self.shape)}.")
        if self.span is not None and (self.kind not in ("rows", "columns")
                                      or not 0 <= self.span[0] <= self.span[1] <= self.shape[0]):
            raise ConfigError(f"{self.canonical[0]}: rows {list(self.span)} are not a span "
                              f"of a rows or columns split of {list(self.shape)}.")
        if self.cols is not None and (self.kind != "columns"
                                      or not 0 <= self.cols[0] <= self.cols[1] <= self.shape[1]):
            raise ConfigError(f"{self.canonical[0]}: columns {list(self.cols)} are not a span "
                              f"of a columns split of {list(self.shape)}.")
        if self.pad and (self.kind != "rows" or self.span is None or self.pad < 0):
            raise ConfigError(f"{self.canonical[0]}: {self.pad} padding rows need a rows split "
                              "with a span (and a count of at least 0).")
        axis = 1 if self.kind == "columns" else 0
        spanned = self.cols if self.kind == "columns" else self.span
        if self.kind in ("rows", "columns", "gate_up") and spanned is None \
                and self.shape[axis] % self.ranks:
            raise ConfigError(f"{self.canonical[0]}: dimension {axis} of {list(self.shape)} "
                              f"does not split into {self.ranks} equal parts.")
        dtype_of(self.dtype)  # names the dtype if unknown
        if self.kind == "qkv":
            self._check_heads()

    def _check_heads(self) -> None:
        h, kv = self.heads or (0, 0)
        if len(self.shape) != 2 or not (h > 0 and kv > 0) or h % kv or self.shape[0] % h \
                or kv % self.ranks:
            raise ConfigError(f"A qkv shard map of {self.canonical[0]} {list(self.shape)} "
                              f"with heads {self.heads} over {self.ranks} ranks: the query "
                              "rows must be whole heads, the heads whole groups per "
                              "key/value head, and the groups split evenly over the ranks.")

    def canonical_shape(self, which: int) -> tuple[int, ...]:
        """The shape of canonical tensor ``which`` (k and v of a qkv map are smaller)."""
        if self.kind == "qkv" and which:
            h, kv = self.heads or (1, 1)
            return (self.shape[0] // h * kv, self.shape[1])
        return self.shape

    def local_shape(self) -> tuple[int, ...]:
        """The shape this rank's shard must have."""
        s = self.shape
        if self.kind == "columns":
            return (self._rows()[1], self._columns_held()[1])
        if self.span is not None:
            return (self.span[1] - self.span[0] + self.pad, *s[1:])
        if self.kind == "rows":
            return (s[0] // self.ranks, *s[1:])
        if self.kind == "gate_up":
            return (2 * s[0] // self.ranks, *s[1:])
        if self.kind == "qkv":
            h, kv = self.heads or (1, 1)
            return ((s[0] + 2 * s[0] // h * kv) // self.ranks, s[1])
        return s  # replicated; expert: checked against the stack's trailing dims

    def project(self, base: UInt, target: UInt, entry: EntryKind,
                changes: OnChanges | None = None) -> Iterator[ItemDelta]:
        """Items of this shard's changes, addressed in canonical coordinates; each piece's
        changes also go to ``changes`` as (canonical tensor, indices, old, new)."""
        if base.shape != target.shape:
            raise ConfigError(f"Shard of {self.canonical}: base {list(base.shape)} and "
                              f"candidate {list(target.shape)} differ.")
        for (which, piece, b), (_, _, t) in zip(self.pieces(base), self.pieces(target),
                                                strict=True):
            ch = find_changes(b.reshape(-1), t.reshape(-1))
            if not ch.positions.size:
                continue
            if changes is not None:
                changes(self.canonical[which], span_at(piece, ch.positions), ch.old, ch.new)
            if len(piece[1]) == 1:
                yield self._delta(which, piece[0], piece[0] + b.size, ch.positions, ch.old,
                                  ch.new, entry)
            else:
                yield from self._columns(ch, entry)

    def pieces(self, local: UInt) -> Iterator[tuple[int, Span, UInt]]:
        """Where this rank's elements lie in the canonical tensors: ``(which canonical
        tensor, a view of it, the local elements in that view's order)``; a contiguous
        range each, but a columns split's block of every row's columns. A replicated
        tensor is rank 0's alone."""
        if self.kind == "expert":
            if local.ndim < 1 or local.shape[1:] != self.shape or not (
                    0 <= self.expert < local.shape[0]):
                raise ConfigError(f"Expert {self.expert} of a {list(local.shape)} stack is "
                                  f"not {self.canonical[0]} {list(self.shape)}.")
            yield 0, _range_span(0, local[self.expert].size), local[self.expert]
            return
        if local.shape != self.local_shape():
            raise ConfigError(f"Shard of {self.canonical} is {list(local.shape)}; rank "
                              f"{self.rank}/{self.ranks} of a {self.kind} split of "
                              f"{list(self.shape)} is {list(self.local_shape())}.")
        row = math.prod(self.shape[1:])
        if self.kind == "replicated":
            if self.rank == 0:
                yield 0, _range_span(0, local.size), local
        elif self.kind == "rows":
            first = self.span[0] if self.span is not None else self.rank * local.shape[0]
            real = local[: local.shape[0] - self.pad]  # padding rows are no canonical element
            yield 0, _range_span(first * row, real.size), real
        elif self.kind == "gate_up":
            half = local.shape[0] // 2
            for k in range(2):
                part = local[k * half : (k + 1) * half]
                yield k, _range_span(self.rank * half * row, part.size), part
        elif self.kind == "qkv":
            yield from self._qkv(local)
        else:
            first, rows = self._rows()
            start, width = self._columns_held()
            cols = self.shape[1]
            yield 0, (first * cols + start, (rows, width), (cols, 1)), local

    def _rows(self) -> tuple[int, int]:
        """A columns split's first row and row count (all rows unless a span names some)."""
        if self.span is None:
            return 0, self.shape[0]
        return self.span[0], self.span[1] - self.span[0]

    def _columns_held(self) -> tuple[int, int]:
        """A columns split's first column and width on this rank."""
        if self.cols is not None:
            return self.cols[0], self.cols[1] - self.cols[0]
        width = self.shape[1] // self.ranks
        return self.rank * width, width

    def _qkv(self, local: UInt) -> Iterator[tuple[int, Span, UInt]]:
        h, kv = self.heads or (1, 1)
        dim, per = self.shape[0] // h, h // kv  # head size; query heads per group
        groups = kv // self.ranks
        block = (per + 2) * dim  # one group's rows here
        cols = self.shape[1]
        for j in range(groups):
            g = self.rank * groups + j
            parts = ((0, 0, per * dim, g * per * dim), (1, per * dim, dim, g * dim),
                     (2, (per + 1) * dim, dim, g * dim))  # (which, local row, rows, row there)
            for which, lo, rows, there in parts:
                part = local[j * block + lo : j * block + lo + rows]
                yield which, _range_span(there * cols, part.size), part

    def sums(self, local: UInt, regions: Mapping[str, tuple[Spans, ...]]
             ) -> Iterator[tuple[str, Spans, int]]:
        """This rank's part of the sum of each region of its canonical tensors that its
        elements meet (``dcr.codec.sums``)."""
        for which, piece, bits in self.pieces(local):
            name = self.canonical[which]
            for spans in regions.get(name, ()):
                part = piece_sum(piece, bits, spans)
                if part is not None:
                    yield name, spans, part

    def _columns(self, ch: Changes, entry: EntryKind) -> Iterator[ItemDelta]:
        """A columns split's changes as one item per row: its columns there."""
        cols = self.shape[1]
        first, _ = self._rows()
        column, width = self._columns_held()
        row_of = ch.positions // width
        cuts = np.flatnonzero(np.diff(row_of)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, row_of.size], strict=True):
            r = int(row_of[lo])
            start = (first + r) * cols + column
            yield self._delta(0, start, start + width, ch.positions[lo:hi] - r * width,
                              ch.old[lo:hi], ch.new[lo:hi], entry)

    def _delta(self, which: int, start: int, stop: int, positions: np.ndarray, old: UInt,
               new: UInt, entry: EntryKind) -> ItemDelta:
        values = np.bitwise_xor(old, new) if entry == "xor" else np.array(new, copy=True)
        return ItemDelta(name=self.canonical[which], dtype=dtype_of(self.dtype),
                         shape=self.canonical_shape(which), start=start, stop=stop, entry=entry,
                         positions=np.ascontiguousarray(positions, dtype=np.int64),
                         values=values)


@dataclass
class RegionParts:
    """An owner's parts of region sums over its baseline, kept from step to step, so
    that a publish costs a pass over the changes instead of the shard: the part over the
    target is the part over the base plus what the changes move (``delta_sum``). A part
    is computed over the base once, when a region first appears; :meth:`advance` makes a
    committed target's parts the base's."""

    base: dict[tuple[str, str, Spans], int | None] = field(default_factory=dict)
    targets: dict[int, dict[tuple[str, str, Spans], int | None]] = field(default_factory=dict)

    def of(self, local: str, m: ShardMap, base: UInt, regions: dict[str, tuple[Spans, ...]],
           version: int, moved: Mapping[tuple[str, Spans], int]
           ) -> dict[tuple[str, Spans], tuple[int, int]]:
        """The parts over the base and over ``version``'s target of the regions ``local``
        meets."""
        keys = [(local, n, spans) for n, r in regions.items() for spans in r]
        if missing := [k for k in keys if k not in self.base]:
            want: dict[str, tuple[Spans, ...]] = {}
            for _, n, spans in missing:
                want[n] = (*want.get(n, ()), spans)
            self.base.update(dict.fromkeys(missing))
            for n, spans, value in m.sums(base, want):
                self.base[local, n, spans] = value
        target = self.targets.setdefault(version, {})
        out: dict[tuple[str, Spans], tuple[int, int]] = {}
        for k in keys:
            if (part := self.base[k]) is not None:
                out[k[1:]] = (part, (part + moved.get(k[1:], 0)) & MASK64)
            target[k] = out[k[1:]][1] if k[1:] in out else None  # None: does not meet it
        return out

    def advance(self, version: int) -> None:
        """The baseline is now ``version``'s target; parts of other versions are gone."""
        self.base = self.targets.pop(version, {})
        self.targets.clear()


@dataclass(kw_only=True)
class ShardEncoder(OwnerState[Mapping[str, UInt]]):
    """An ``OwnerHandle`` for one trainer rank: its shards, their maps, its baseline.

    ``baseline`` and candidates map local tensor names to raw bits (e.g.
    ``t.view(torch.int16).numpy().view(np.uint16)`` for BF16). The baseline advances
    only for a commit record naming the candidate and an attempt this rank published
    (:class:`~dcr.owner.state.OwnerState`).
    """

    role: ClassVar[str] = "rank"

    store: Store
    maps: Mapping[str, ShardMap]
    owners: int = 1
    profile: ReceiverProfile | None = None
    bucket_bytes: int = EncodeSettings.bucket_bytes  # local dense bytes per payload
    level: int = EncodeSettings.level
    manifests: list[Manifest] = field(default_factory=list)
    parts: RegionParts = field(default_factory=RegionParts)

    def __post_init__(self) -> None:
        if set(self.maps) != set(self.baseline):
            raise ConfigError(f"Shard maps and baseline name different tensors: "
                              f"{sorted(set(self.maps) ^ set(self.baseline))[:5]}.")

    def set_candidate(self, candidate: Mapping[str, UInt], version: int) -> None:
        if set(candidate) != set(self.maps):
            raise ConfigError(f"Candidate names different tensors than the shard maps: "
                              f"{sorted(set(candidate) ^ set(self.maps))[:5]}.")
        super().set_candidate(candidate, version)

    def publish(self, attempt: Attempt) -> None:
        candidate = self.check_publish(attempt)
        t = attempt.transition
        writer = AttemptWriter(store=self.store, base_version=t.base_version,
                               target_version=t.target_version, attempt=attempt.id,
                               mode=attempt.mode, owner=self.owner, level=self.level,
                               per_attempt=True)
        pairs = ((n, self.baseline[n], candidate[n]) for n in sorted(self.maps))
        self.manifests.append(write_shards(writer, self.maps, pairs, profile=self.profile,
                                           bucket_bytes=self.bucket_bytes, parts=self.parts))

    def advance_baseline(self, record: CommitRecord) -> None:
        was = self.version
        super().advance_baseline(record)
        if self.version != was:
            self.parts.advance(self.version)


def _range_span(start: int, count: int) -> Span:
    return start, (count,), (1,)


def shard_entry(m: ShardMap, mode: str, profile: ReceiverProfile | None) -> EntryKind:
    """How a shard's changes travel: overwrite in overwrite mode or where a receiver
    cannot take XOR; a dense-class tensor cannot travel by parts at all."""
    classes = {profile.tensors.get(n, "xor") if profile else "xor" for n in m.canonical}
    if "dense" in classes:
        raise ConfigError(f"{m.canonical} must travel whole to its receivers (dense "
                          "class); a shard cannot send it by parts.")
    return "overwrite" if mode == "overwrite" or "overwrite" in classes else "xor"


def sum_regions(m: ShardMap, profile: ReceiverProfile | None) -> dict[str, tuple[Spans, ...]]:
    """The regions of ``m``'s canonical tensors to write sums of: each one the receivers'
    profile names (checked to lie inside the tensor), and the whole tensor, which no
    owner of parts can fingerprint otherwise: its sums are the tensor's fingerprints
    (``TensorEntry``), what a reader of the history checks a whole copy by, and a region
    sum too where the receivers may hold it whole on an ``xor`` path."""
    out = {}
    for which, n in enumerate(m.canonical):
        shape = m.canonical_shape(which)
        named = profile.regions.get(n, ()) if profile is not None else ()
        for spans in named:
            check_spans(n, spans, shape)
        out[n] = (*named, whole(shape)) if whole(shape) not in named else named
    return out


def region_sums_for(sums: Mapping[tuple[str, Spans], int], profile: ReceiverProfile | None
                    ) -> tuple[RegionSum, ...]:
    """The region sums a part lists: every region but the whole of a tensor the receivers
    do not hold on an ``xor`` path (its sum is in the tensor's entry all the same)."""
    def listed(n: str, spans: Spans) -> bool:
        cls = profile.tensors.get(n, "xor") if profile is not None else "xor"
        named = profile.regions.get(n, ()) if profile is not None else ()
        return cls == "xor" or spans in named
    return tuple(RegionSum(tensor=n, spans=spans, sum=sum_text(v))
                 for (n, spans), v in sorted(sums.items()) if listed(n, spans))


def write_shards(writer: AttemptWriter, maps: Mapping[str, ShardMap],
                 pairs: Iterable[tuple[str, UInt, UInt]], *,
                 profile: ReceiverProfile | None, bucket_bytes: int,
                 progress: Callable[[int], None] | None = None,
                 parts: RegionParts | None = None) -> Manifest:
    """Seal payloads of the changes of ``pairs`` (local name, base bits, target bits),
    each about ``bucket_bytes`` of local tensors, then write this owner's manifest part
    with its parts of the region sums (from ``parts``' sums over the base and the
    changes). ``progress`` is called with the items so far between tensors (it may raise
    to stop)."""
    changed = total = dense = items = 0
    parts = parts if parts is not None else RegionParts()
    version = writer.target_version
    sums: dict[tuple[str, Spans], int] = {}
    wholes: dict[str, tuple[TensorEntry, int, int]] = {}  # its entry, base and target sums
    b = writer.builder(0)
    for name, base, cand in pairs:
        m = maps[name]
        entry = shard_entry(m, writer.mode, profile)
        regions = sum_regions(m, profile)
        moved: dict[tuple[str, Spans], int] = {}

        def changes(n: str, index: np.ndarray, old: UInt, new: UInt,
                    regions: dict[str, tuple[Spans, ...]] = regions,
                    moved: dict[tuple[str, Spans], int] = moved) -> None:
            for spans in regions.get(n, ()):
                moved[n, spans] = moved.get((n, spans), 0) + delta_sum(spans, index, old, new)

        total += base.size
        dense += base.nbytes
        for delta in m.project(base, cand, entry, changes):
            if len(b.items) >= DEFAULT_LIMITS.max_items:  # what a reader accepts
                writer.seal(b)
                b = writer.builder(b.seq + 1)
            changed += delta.positions.size
            b.add(encode_item(delta), dense_bytes=0)
            items += 1
        for (n, spans), (was, part) in parts.of(name, m, base, regions, version,
                                                moved).items():
            sums[n, spans] = sums.get((n, spans), 0) + part
            shape = m.canonical_shape(m.canonical.index(n))
            if spans == whole(shape):
                entry_of, b0, t0 = wholes.get(n, (_summed(n, m.dtype, shape), 0, 0))
                wholes[n] = (entry_of, b0 + was, t0 + part)
        b.dense_bytes += base.nbytes
        if b.dense_bytes >= bucket_bytes and b.items:
            writer.seal(b)
            b = writer.builder(b.seq + 1)
        if progress is not None:
            progress(items)
    if b.items:
        writer.seal(b)
    tensors = tuple(e.model_copy(update={"base": sum_text(b0), "target": sum_text(t0)})
                    for _, (e, b0, t0) in sorted(wholes.items()))
    return writer.finish(tensors=tensors, tensor_count=len(maps), changed_elements=changed,
                         total_elements=total, dense_bytes=dense,
                         sums=region_sums_for(sums, profile))


def _summed(name: str, dtype: str, shape: tuple[int, ...]) -> TensorEntry:
    """A tensor's entry in a rank's part, its sums still to fill in (``write_shards``)."""
    zero = sum_text(0)
    return TensorEntry(name=name, dtype=dtype, shape=shape, base=zero, target=zero)
