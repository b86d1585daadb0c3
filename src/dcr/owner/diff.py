"""``dcr diff``: compare two checkpoints and write one version's payloads and manifest.

Tensors are cut into items of at most ``item_elements`` elements and grouped, in name
order, into buckets of about ``bucket_bytes`` dense bytes; each bucket becomes one
payload. Items are diffed on a thread pool (numpy and zstd release the GIL) while the
previous bucket is sealed and uploaded on another thread, so memory stays near two
buckets plus the largest item however large the checkpoint is. The manifest goes last.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from dcr.checkpoint import TensorInfo, TensorSource
from dcr.codec.encode import EncodedItem, PayloadBuilder, diff_range, encode_item, whole_range
from dcr.errors import CheckpointError, ConfigError
from dcr.format.layout import manifest_key, owner_manifest_key, owner_of, payload_key
from dcr.format.manifest import Manifest, PayloadEntry, Stats, TensorEntry
from dcr.format.payload import NAME_RE, EntryKind, Mode
from dcr.format.profile import ReceiverProfile
from dcr.transport.store import Store

MiB = 1 << 20
Progress = Callable[[int], None]  # called with dense bytes just processed


@dataclass(frozen=True, kw_only=True)
class DiffSettings:
    """How to diff. Every field has a unit and a reason."""

    version: int  # target version written to the store
    base_version: int  # version the receivers must hold
    mode: Mode = "mixed"  # "overwrite" makes every entry an absolute overwrite (retries)
    bucket_bytes: int = 256 * MiB  # dense source bytes per payload (DESIGN: 64-512 MiB)
    item_elements: int = 1 << 24  # largest item; bounds encoder memory for huge tensors
    level: int = 1  # zstd level; 1 is fast and within a few % of the best here
    threads: int = 2  # diff workers; the machine's cores is a good choice
    overwrite: tuple[str, ...] = ()  # regexes (full match) of tensors whose path casts
    owner: int = 0  # this owner's index, 0 <= owner < owners
    owners: int = 1  # owners split tensors by a stable hash of the name (``owner_of``)
    # Write the manifest under the attempt (what protocol owners do, so a late owner of
    # an abandoned attempt cannot replace the current one) instead of at the version
    # (the file-level layout ``dcr patch`` reads). Several owners always do.
    attempt_manifest: bool = False
    attempt: str | None = None  # fresh random id when None
    profile: ReceiverProfile | None = None  # receivers' classes (merged); None: all XOR

    def __post_init__(self) -> None:
        if self.base_version == self.version:
            raise ConfigError(f"--base-version {self.base_version} equals --version.")
        if min(self.version, self.base_version) < 0:
            raise ConfigError(f"Versions must be >= 0, got {self.base_version} -> {self.version}.")
        if self.bucket_bytes < 1 * MiB:
            raise ConfigError(f"Bucket of {self.bucket_bytes} bytes is under 1 MiB.")
        if not 1 <= self.level <= 22:
            raise ConfigError(f"zstd level {self.level} is outside 1..22.")
        if not 0 <= self.owner < self.owners:
            raise ConfigError(f"Owner {self.owner} is outside 0..{self.owners - 1}.")
        if self.threads < 1 or self.item_elements < 1:
            raise ConfigError(f"threads ({self.threads}) and item_elements must be >= 1.")
        for pattern in self.overwrite:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"Overwrite pattern {pattern!r} is not a regex: {e}.") from e

    def entry_for(self, name: str) -> EntryKind | Literal["dense"]:
        """How a tensor travels: XOR, overwrite, or dense (every element, when any changed)."""
        cls = self.profile.tensors.get(name, "xor") if self.profile else "xor"
        if cls == "dense":
            return "dense"
        if (
            self.mode == "overwrite"
            or cls == "overwrite"
            or any(re.fullmatch(p, name) for p in self.overwrite)
        ):
            return "overwrite"
        return "xor"


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


def _buckets(infos: list[TensorInfo], s: DiffSettings) -> Iterator[list[_Range]]:
    bucket: list[_Range] = []
    size = 0
    for info in infos:
        for lo in range(0, info.numel, s.item_elements):
            r = _Range(info=info, start=lo, stop=min(info.numel, lo + s.item_elements))
            if bucket and size + r.nbytes > s.bucket_bytes:
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
    settings: DiffSettings,
    progress: Progress | None = None,
) -> Manifest:
    """Write the payloads and then the manifest of ``settings.version``; return it.

    With several owners, this owner diffs only the tensors ``owner_of`` gives it; it, and
    any owner with ``attempt_manifest``, writes its part of the manifest under the
    attempt (``owner_manifest_key``).
    """
    check_same_tensors(base, target)
    s = settings
    mine = [i for i in base if owner_of(i.name, s.owners) == s.owner]
    attempt = s.attempt or f"a-{secrets.token_hex(4)}"
    entries: list[PayloadEntry] = []
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

    def seal_and_put(builder: PayloadBuilder) -> PayloadEntry:
        data = builder.seal()
        key = payload_key(s.version, attempt, s.owner, builder.seq)
        store.put(key, data)
        return PayloadEntry(
            key=key, owner=s.owner, seq=builder.seq, size=len(data),
            digest=hashlib.blake2b(data, digest_size=16).hexdigest(),
            items=len(builder.items), records=builder.records,
        )

    fingerprints: dict[str, Future[tuple[str, str]]] = {}
    with ThreadPoolExecutor(s.threads) as pool, ThreadPoolExecutor(1) as uploader:
        for name in (i.name for i in mine):
            fingerprints[name] = pool.submit(
                lambda n: (base.fingerprint(n), target.fingerprint(n)), name
            )
        pending: Future[PayloadEntry] | None = None
        seq = 0
        for bucket in _buckets(mine, s):
            builder = PayloadBuilder(
                base_version=s.base_version, target_version=s.version, attempt=attempt,
                owner=s.owner, seq=seq, mode=s.mode, level=s.level,
            )
            for r, item in pool.map(diff_one, bucket):
                if item is not None:
                    builder.add(item, dense_bytes=r.nbytes)
                    changed += item.header.count
                if progress:
                    progress(r.nbytes)
            if pending is not None:
                entries.append(pending.result())
                pending = None
            if builder.items:
                pending = uploader.submit(seal_and_put, builder)
                seq += 1
        if pending is not None:
            entries.append(pending.result())
        tensors = tuple(
            TensorEntry(
                name=info.name, dtype=info.dtype.name, shape=info.shape,
                base=fingerprints[info.name].result()[0],
                target=fingerprints[info.name].result()[1],
            )
            for info in mine
        )
    manifest = Manifest(
        base_version=s.base_version, target_version=s.version, attempt=attempt, mode=s.mode,
        payloads=tuple(entries), tensors=tensors,
        stats=Stats(
            tensors=len(tensors), changed_elements=changed,
            total_elements=sum(i.numel for i in mine),
            dense_bytes=sum(i.nbytes for i in mine),
            payload_bytes=sum(e.size for e in entries),
        ),
    )
    key = (owner_manifest_key(s.version, attempt, s.owner)
           if s.owners > 1 or s.attempt_manifest else manifest_key(s.version))
    store.put(key, manifest.to_json())
    return manifest

