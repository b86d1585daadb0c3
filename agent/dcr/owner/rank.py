"""Owners inside the trainer's ranks: a rank's own shards, published when the operator asks.

A training rank calls :meth:`RankOwner.offer` after each optimizer step. The owner keeps
one host copy of the committed baseline of this rank's shards and, per offered version,
an overlay: the local positions whose bits differ from the baseline, and their new bits.
The trainer steps on at once; a publish, and any overwrite retry of it, reads the overlay,
never the live tensors. The baseline advances only for a commit record naming an attempt
this rank published for that version: the operator's next publish request carries the
record (``committed_attempt``), so a missed notice costs nothing. :func:`serve` answers
the warm-encoder protocol from inside the training process (:mod:`dcr.owner.server`), so
a fleet's encoder profile names the ranks' endpoints and no Job or checkpoint is involved.
docs/trainer.md, "Owners in the ranks".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dcr.codec.changes import find_changes
from dcr.codec.planes import UInt
from dcr.errors import BaselineError, ConfigError
from dcr.files.ranksnap import Region, write_rank_part
from dcr.format.dtypes import dtype as dtype_of
from dcr.format.history import PIECE_BYTES, RankPart
from dcr.format.manifest import Manifest
from dcr.format.names import Mode
from dcr.format.profile import ReceiverProfile
from dcr.http.tokens import check_token
from dcr.owner.server import BackgroundServer, EncoderService, Work
from dcr.owner.settings import EncodeSettings
from dcr.owner.shards import RegionParts, ShardMap, write_shards
from dcr.owner.writer import AttemptWriter
from dcr.protocol.encoder_api import PublishRequest, SnapshotRequest
from dcr.protocol.records import Attempt, CommitRecord
from dcr.settings import MiB
from dcr.transport.store import Store

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

COPY_BYTES = 64 * MiB  # host bytes per copy step; the next step's copy overlaps this diff
KEEP_OFFERS = 2  # offered versions kept: the one a refit may still commit, and the newest


@dataclass(frozen=True)
class Overlay:
    """A version's local bits where they differ from the baseline: per tensor, the flat
    local positions (ascending) and their bits."""

    version: int
    changes: dict[str, tuple[np.ndarray, UInt]]
    published: set[str] = field(default_factory=set)  # attempt ids this rank published

    @property
    def elements(self) -> int:
        return sum(p.size for p, _ in self.changes.values())

    def bits(self, name: str, base: UInt) -> UInt:
        """This version's bits of ``name``, given the baseline's (a new array)."""
        out = base.copy()
        pos, new = self.changes[name]
        out.reshape(-1)[pos] = new
        return out


def host_bits(t: torch.Tensor, *, copy_bytes: int = COPY_BYTES) -> Iterator[tuple[int, UInt]]:
    """``t``'s bits on the host, flat, in steps of about ``copy_bytes``: (offset, bits).

    A host tensor's steps are views of it (the caller copies what it keeps). A device
    tensor's are copies, and the copy of step k+1 runs on a thread (a device copy releases
    the GIL) while the caller works on step k, so the copy overlaps the diff.
    """
    from dcr.apply.applier import BITS

    flat = t.detach().reshape(-1).view(BITS[t.element_size()])
    step = max(1, copy_bytes // t.element_size())
    unsigned = np.dtype(f"<u{t.element_size()}")
    offsets = range(0, flat.numel(), step)
    if flat.device.type == "cpu":
        host: UInt = flat.numpy().view(unsigned)
        for lo in offsets:
            yield lo, host[lo:lo + step]
        return

    def copy(lo: int) -> UInt:
        bits: UInt = flat[lo:lo + step].to("cpu").numpy().view(unsigned)
        return bits

    with ThreadPoolExecutor(1, thread_name_prefix="rank-copy") as pool:
        pending = pool.submit(copy, 0) if offsets else None
        for k, lo in enumerate(offsets):
            assert pending is not None
            bits = pending.result()
            if k + 1 < len(offsets):
                pending = pool.submit(copy, offsets[k + 1])
            yield lo, bits


class RankOwner:
    """Owner ``rank`` of ``ranks``: its shards' committed baseline and the versions offered.

    ``tensors`` map local names to this rank's tensors (a shard, or ``DTensor.to_local()``),
    ``maps`` the same names to where their elements lie in the canonical tensors. Calls
    take turns (the trainer offers while a server publishes): an offer made during a
    publish waits for it, since both read the baseline.
    """

    def __init__(self, *, store: Store, maps: Mapping[str, ShardMap],
                 tensors: Mapping[str, torch.Tensor], version: int, rank: int = 0,
                 ranks: int = 1, bucket_bytes: int = EncodeSettings.bucket_bytes,
                 level: int = EncodeSettings.level, copy_bytes: int = COPY_BYTES) -> None:
        if not 0 <= rank < ranks:
            raise ConfigError(f"Rank {rank} is outside 0..{ranks - 1}.")
        self.store, self.maps, self.rank, self.ranks = store, dict(maps), rank, ranks
        self.bucket_bytes, self.level, self.copy_bytes = bucket_bytes, level, copy_bytes
        self._check_names(tensors)
        self._lock = threading.RLock()
        self.version = version
        self.baseline: dict[str, UInt] = {n: self._snapshot(n, t) for n, t in tensors.items()}
        self.parts = RegionParts()  # region sums over the baseline, for the next publish
        self.offers: dict[int, Overlay] = {}
        self.profile: ReceiverProfile | None = None  # for in-process publishes
        self.manifests: list[Manifest] = []  # written by in-process publishes

    @property
    def who(self) -> str:
        return f"Rank {self.rank}"

    def _check_names(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if set(tensors) != set(self.maps):
            raise ConfigError(f"{self.who}: tensors and shard maps name different tensors: "
                              f"{sorted(set(tensors) ^ set(self.maps))[:5]}.")
        for name, t in tensors.items():
            m = self.maps[name]
            if t.element_size() != dtype_of(m.dtype).itemsize:
                raise ConfigError(f"{self.who}: {name} is {t.dtype}, {t.element_size()} bytes "
                                  f"an element; its map says {m.dtype}.")

    def _snapshot(self, name: str, t: torch.Tensor) -> UInt:
        out = np.empty(t.numel(), dtype=np.dtype(f"<u{t.element_size()}"))
        for lo, bits in host_bits(t, copy_bytes=self.copy_bytes):
            out[lo:lo + bits.size] = bits
        return out.reshape(tuple(t.shape))

    def offer(self, tensors: Mapping[str, torch.Tensor], version: int) -> Overlay:
        """Take this rank's tensors as version ``version`` (after the last offered): copy
        them to the host step by step and keep what differs from the baseline. The
        tensors may change as soon as this returns."""
        self._check_names(tensors)
        with self._lock:
            return self._offer(tensors, version)

    def _offer(self, tensors: Mapping[str, torch.Tensor], version: int) -> Overlay:
        newest = max([self.version, *self.offers])
        if version <= newest:
            raise ConfigError(f"{self.who}: version {version} is not after {newest}, the "
                              "newest this rank holds or was offered.")
        changes = {}
        for name, t in tensors.items():
            base = self.baseline[name]
            if tuple(t.shape) != base.shape:
                raise ConfigError(f"{self.who}: {name} is {list(t.shape)}; its baseline is "
                                  f"{list(base.shape)}.")
            flat = base.reshape(-1)
            pos, new = [], []
            for lo, bits in host_bits(t, copy_bytes=self.copy_bytes):
                ch = find_changes(flat[lo:lo + bits.size], bits)
                pos.append(ch.positions + lo)
                new.append(ch.new)
            changes[name] = (np.concatenate(pos) if pos else np.empty(0, np.int64),
                             np.concatenate(new) if new else flat[:0].copy())
        overlay = Overlay(version=version, changes=changes)
        self.offers[version] = overlay
        for old in sorted(self.offers)[:-KEEP_OFFERS]:
            del self.offers[old]
        log.info("%s: version %d offered, %d elements differ from the baseline %d",
                 self.who, version, overlay.elements, self.version)
        return overlay

    def check_index(self, owner: int, owners: int) -> None:
        """Raise unless a request for owner ``owner`` of ``owners`` is for this rank."""
        if (owner, owners) != (self.rank, self.ranks):
            raise ConfigError(f"This endpoint is rank {self.rank} of {self.ranks}; the "
                              f"request is for owner {owner} of {owners} (the encoder "
                              "profile's URLs must list the ranks in order).")

    def _check(self, base_version: int, target_version: int,
               committed_attempt: str | None) -> None:
        """Raise unless this rank can publish ``base_version -> target_version``; advance
        first if ``committed_attempt`` commits a version this rank published."""
        with self._lock:
            self._at(base_version, committed_attempt, "a publish from")
            if target_version not in self.offers:
                raise BaselineError(f"{self.who}: version {target_version} was not offered "
                                    f"(held: {sorted(self.offers) or 'none'}).")

    def _at(self, version: int, committed_attempt: str | None, what: str) -> None:
        """Raise unless the baseline is ``version`` (the lock held), advancing first if
        ``committed_attempt`` commits it and this rank published that attempt."""
        if version != self.version and committed_attempt:
            self._advance(version, committed_attempt)
        if version != self.version:
            raise BaselineError(f"{self.who}: {what} version {version}; this rank's "
                                f"committed baseline is {self.version}.")

    def publish(self, attempt: Attempt) -> None:
        """``OwnerHandle``: publish in process (a coordinator in the training job)."""
        t = attempt.transition
        self.manifests.append(self.write(attempt=attempt.id, mode=attempt.mode,
                                         base_version=t.base_version,
                                         target_version=t.target_version,
                                         profile=self.profile))

    def advance_baseline(self, record: CommitRecord) -> None:
        """``OwnerHandle``: advance for a commit record naming an attempt of ours."""
        self.advance(record.committed_version, record.attempt)

    def write(self, *, attempt: str, mode: Mode, base_version: int, target_version: int,
              profile: ReceiverProfile | None = None, committed_attempt: str | None = None,
              progress: Callable[[int], None] | None = None, store: Store | None = None,
              bucket_bytes: int | None = None) -> Manifest:
        """Write this rank's payloads and manifest part of ``attempt``."""
        with self._lock:
            self._check(base_version, target_version, committed_attempt)
            overlay = self.offers[target_version]
            overlay.published.add(attempt)
            writer = AttemptWriter(store=store or self.store, base_version=base_version,
                                   target_version=target_version, attempt=attempt, mode=mode,
                                   owner=self.rank, level=self.level, per_attempt=True)
            pairs = ((n, self.baseline[n], overlay.bits(n, self.baseline[n]))
                     for n in sorted(self.maps))
            return write_shards(writer, self.maps, pairs, profile=profile, progress=progress,
                                bucket_bytes=bucket_bytes or self.bucket_bytes,
                                parts=self.parts)

    def write_snapshot(self, version: int, committed_attempt: str | None = None, *,
                       store: Store | None = None, piece_bytes: int = PIECE_BYTES) -> RankPart:
        """Write this rank's part of version ``version``'s snapshot from its baseline (first
        advancing to it, for a commit record naming an attempt this rank published): every
        canonical element it holds, region by region as its manifest part addresses them.
        Offers wait meanwhile: the baseline must not move under the write."""
        with self._lock:
            self._at(version, committed_attempt, "a snapshot of")
            part = write_rank_part(store or self.store, version, self.rank, self._regions(),
                                   piece_bytes=piece_bytes)
        log.info("%s: wrote its part of version %d's snapshot (%d bytes in %d pieces)",
                 self.who, version, part.size, len(part.pieces))
        return part

    def _regions(self) -> Iterator[Region]:
        for name in sorted(self.maps):
            m = self.maps[name]
            for which, span, bits in m.pieces(self.baseline[name]):
                yield m.canonical[which], m.dtype, m.canonical_shape(which), span, bits

    def advance(self, version: int, attempt: str) -> None:
        """A commit record says ``attempt`` committed ``version``: make it the baseline."""
        with self._lock:
            if version != self.version:
                self._advance(version, attempt)

    def _advance(self, version: int, attempt: str) -> None:
        overlay = self.offers.get(version)
        if overlay is None or attempt not in overlay.published:
            raise BaselineError(
                f"{self.who}: the commit record names version {version} by attempt "
                f"{attempt!r}; this rank published "
                f"{sorted(overlay.published) if overlay else 'nothing'} for it. The "
                f"baseline stays at {self.version}.")
        later = {v: Overlay(version=v, changes={}) for v in self.offers if v > version}
        for name, base in self.baseline.items():  # a tensor at a time: one more copy at most
            targets = {v: self.offers[v].bits(name, base) for v in later}
            pos, new = overlay.changes[name]
            base.reshape(-1)[pos] = new
            for v, target in targets.items():
                ch = find_changes(base.reshape(-1), target.reshape(-1))
                later[v].changes[name] = (ch.positions, ch.new)
        self.offers = later
        self.version = version
        self.parts.advance(version)
        log.info("%s: baseline is now version %d (attempt %s)", self.who, version, attempt)


@dataclass(frozen=True)
class RankPublisher:
    """The warm-encoder protocol's publish, answered from a :class:`RankOwner`: the
    request's checkpoint paths name versions only and are not read."""

    owner: RankOwner

    def prepare(self, req: PublishRequest) -> Work:
        self.owner.check_index(req.owner, req.owners)

        def work(store: Store, progress: Callable[[int], None]) -> Manifest:
            log.info("%s publishing attempt %s (%s, %d -> %d)", self.owner.who, req.attempt,
                     req.mode, req.base_version, req.target_version)
            return self.owner.write(
                attempt=req.attempt, mode=req.mode, base_version=req.base_version,
                target_version=req.target_version, profile=req.profile,
                committed_attempt=req.committed_attempt, progress=progress, store=store,
                bucket_bytes=req.bucket_mib * MiB if req.bucket_mib else None)
        return work

    def snapshot(self, req: SnapshotRequest, store: Store) -> RankPart:
        """The warm-encoder protocol's snapshot: this rank's part, from its baseline."""
        self.owner.check_index(req.owner, req.owners)
        return self.owner.write_snapshot(req.version, req.committed_attempt, store=store)


def serve(owner: RankOwner, *, token: str, listen: str = "127.0.0.1:0",
          stop_wait_s: float = 120.0) -> BackgroundServer:
    """Answer the warm-encoder protocol for ``owner`` on ``listen`` from a thread of this
    process, writing into ``owner.store``; ``.url`` is where, ``.close()`` ends it."""
    check_token(token, f"rank {owner.rank}'s encoder token")
    publisher = RankPublisher(owner)
    service = EncoderService(owner.store, publisher, max_publishes=2, stop_wait_s=stop_wait_s,
                             snapshotter=publisher.snapshot)
    return BackgroundServer(service, token, listen=listen)


__all__ = ["COPY_BYTES", "Overlay", "RankOwner", "RankPublisher", "host_bits", "serve"]
