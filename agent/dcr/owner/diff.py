"""The whole-tensor diff: compare two checkpoints and write one owner's payloads and manifest.

Items are grouped in name order into buckets of about ``bucket_bytes``, one payload each,
and diffed on a thread pool while earlier buckets are sealed and uploaded (at most
``UPLOAD_WINDOW`` at once), so memory stays near a few buckets plus the largest item however
large the checkpoint. The engine behind ``dcr diff``, ``dcr encode`` and ``Encoder``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dcr.checkpoint import TensorInfo, TensorSource
from dcr.codec.encode import EncodedItem, diff_range, encode_item, whole_range
from dcr.codec.sums import region_sum
from dcr.errors import CheckpointError
from dcr.format.layout import owner_of
from dcr.format.manifest import Manifest, PayloadEntry, RegionSum, TensorEntry
from dcr.format.names import new_attempt_id
from dcr.format.payload import DEFAULT_LIMITS, NAME_RE
from dcr.format.regions import Spans, check_spans, sum_text
from dcr.owner.settings import EncodeSettings
from dcr.owner.writer import AttemptWriter
from dcr.settings import MiB
from dcr.transport.store import Store

Progress = Callable[[int], None]  # called with dense bytes just processed


@dataclass(frozen=True, kw_only=True)
class _Range:
    info: TensorInfo
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.info.dtype.itemsize


def check_same_tensors(base: TensorSource, target: TensorSource) -> None:
    only_base = sorted(set(base.tensors) - set(target.tensors))
    only_target = sorted(set(target.tensors) - set(base.tensors))
    if only_base or only_target:
        raise CheckpointError(
            f"Checkpoints hold different tensors: only in base {only_base[:5]}, only in "
            f"target {only_target[:5]}."
        )
    for name, b in base.tensors.items():
        if not NAME_RE.fullmatch(name):
            raise CheckpointError(
                f"Tensor name {name!r} cannot travel in a payload: names are 1-1024 "
                "characters without control characters."
            )
        t = target.tensors[name]
        if (b.dtype, b.shape) != (t.dtype, t.shape):
            raise CheckpointError(
                f"Tensor {name!r} is {b.dtype.name}{list(b.shape)} in base and "
                f"{t.dtype.name}{list(t.shape)} in target."
            )


UPLOAD_WINDOW = 4  # payloads sealed and uploaded at once: each put costs a round trip
PIPELINE_FLOOR = 16 * MiB  # dense bytes below which a bucket is not split further


def bucket_limit(total: int, s: EncodeSettings) -> int:
    """Dense bytes per bucket: ``bucket_bytes``, or less, so that ``total`` bytes make at
    least ``min_payloads`` buckets of at least ``PIPELINE_FLOOR`` bytes. A receiver starts
    on the first payload while the owner encodes the next; with one payload nothing
    overlaps."""
    return min(s.bucket_bytes, max(PIPELINE_FLOOR, -(-total // s.min_payloads)))


def _buckets(infos: list[TensorInfo], s: EncodeSettings) -> Iterator[list[_Range]]:
    limit = bucket_limit(sum(i.nbytes for i in infos), s)
    bucket: list[_Range] = []
    size = 0
    for info in infos:
        for lo in range(0, info.numel, s.item_elements):
            r = _Range(info=info, start=lo, stop=min(info.numel, lo + s.item_elements))
            # A payload holds at most as many items as a reader accepts.
            if bucket and (size + r.nbytes > limit
                           or len(bucket) >= DEFAULT_LIMITS.max_items):
                yield bucket
                bucket, size = [], 0
            bucket.append(r)
            size += r.nbytes
    if bucket:
        yield bucket


def diff_checkpoints(
    base: TensorSource,
    target: TensorSource,
    store: Store,
    settings: EncodeSettings,
    progress: Progress | None = None,
) -> Manifest:
    """Write the payloads and then the manifest of ``settings.target_version``; return it.

    With several owners, this owner diffs only the tensors ``owner_of`` gives it; it, and
    any owner with ``attempt_manifest``, writes its part of the manifest under the
    attempt (``owner_manifest_key``).
    """
    check_same_tensors(base, target)
    s = settings
    mine = [i for i in base if owner_of(i.name, s.owners) == s.owner]
    writer = AttemptWriter(store=store, base_version=s.base_version,
                           target_version=s.target_version,
                           attempt=s.attempt or new_attempt_id(), mode=s.mode, owner=s.owner,
                           level=s.level, per_attempt=s.per_attempt_manifest)
    changed = 0

    # A dense tensor travels whole, every range of it, once any element changed.
    dense_changed = {
        n for n in (i.name for i in mine)
        if s.entry_for(n) == "dense" and base.fingerprint(n) != target.fingerprint(n)
    }

    def diff_one(r: _Range) -> tuple[_Range, EncodedItem | None]:
        name = r.info.name
        b = base.bits(name)[r.start : r.stop]
        t = target.bits(name)[r.start : r.stop]
        info, entry = r.info, s.entry_for(name)
        if entry == "dense":
            delta = (
                whole_range(name=name, dtype=info.dtype, shape=info.shape, start=r.start, target=t)
                if name in dense_changed
                else None
            )
        else:
            delta = diff_range(name=name, dtype=info.dtype, shape=info.shape, start=r.start,
                               base=b, target=t, entry=entry)
        return r, None if delta is None else encode_item(delta)

    fingerprints: dict[str, Future[tuple[str, str]]] = {}
    regions = s.profile.regions if s.profile is not None else {}
    sums: dict[str, Future[tuple[RegionSum, ...]]] = {}
    window = UPLOAD_WINDOW
    with ThreadPoolExecutor(s.thread_count) as pool, ThreadPoolExecutor(window) as uploader:
        for info in mine:
            fingerprints[info.name] = pool.submit(
                lambda n: (base.fingerprint(n), target.fingerprint(n)), info.name
            )
            if info.name in regions:
                sums[info.name] = pool.submit(target_sums, target, info, regions[info.name])
        pending: deque[Future[PayloadEntry]] = deque()
        seq = 0
        for bucket in _buckets(mine, s):
            builder = writer.builder(seq)
            for r, item in pool.map(diff_one, bucket):
                if item is not None:
                    builder.add(item, dense_bytes=r.nbytes)
                    changed += item.header.count
                if progress:
                    progress(r.nbytes)
            while len(pending) >= window:  # bounded: memory stays near window + 1 payloads
                pending.popleft().result()
            if builder.items:
                pending.append(uploader.submit(writer.seal, builder))
                seq += 1
        for f in pending:  # every payload is in the store before the manifest
            f.result()
        tensors = tuple(
            TensorEntry(
                name=info.name, dtype=info.dtype.name, shape=info.shape,
                base=fingerprints[info.name].result()[0],
                target=fingerprints[info.name].result()[1],
            )
            for info in mine
        )
        region_sums = tuple(r for f in sums.values() for r in f.result())
    return writer.finish(tensors=tensors, tensor_count=len(tensors), changed_elements=changed,
                         total_elements=sum(i.numel for i in mine),
                         dense_bytes=sum(i.nbytes for i in mine), sums=region_sums)


def target_sums(target: TensorSource, info: TensorInfo,
                regions: Iterable[Spans]) -> tuple[RegionSum, ...]:
    """The fingerprint of each region a receiver holds of a whole tensor this owner has."""
    out = []
    for spans in regions:
        check_spans(info.name, spans, info.shape)
        value = region_sum(target.bits(info.name), spans)
        out.append(RegionSum(tensor=info.name, spans=spans, sum=sum_text(value)))
    return tuple(out)


def encode_summary(m: Manifest, *, seconds: float, store: str) -> dict[str, Any]:
    """What ``dcr diff --json`` and ``dcr encode --json`` print, and the warm encoder
    (``dcr encoder``) answers a publish with: the manifest's stats and where it went."""
    return {
        **m.stats.model_dump(),
        "seconds": round(seconds, 4),
        "payloads": len(m.payloads),
        "attempt": m.attempt,
        "base_version": m.base_version,
        "version": m.target_version,
        "mode": m.mode,
        "store": store,
    }


__all__ = ["Progress", "check_same_tensors", "diff_checkpoints", "encode_summary"]
