"""The history in a store: the coordinator records each commit and snapshot there, and
receivers read it back, with the committed manifests and every version's fingerprints.

Only the coordinator writes it, after the commit record moved (:meth:`HistoryStore.commit`
is idempotent, so a coordinator that finishes a refit again writes nothing twice). A
reader given the history's digest trusts nothing else: manifest parts are checked by size
and digest, and the fingerprints they list check the bits (``dcr.format.history``).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field

from dcr.errors import ManifestError, ObjectNotFound
from dcr.files.ranksnap import read_back_ranks
from dcr.files.readback import declared_fits, read_back
from dcr.files.vouched import is_tensor_file
from dcr.format.dtypes import DTYPES
from dcr.format.history import (
    HISTORY_KEY,
    MAX_HISTORY_BYTES,
    AnyIndex,
    Committed,
    History,
    ObjectRef,
    Piece,
    RankSnapshotIndex,
    Snapshot,
    history_bound,
    parse_index,
)
from dcr.format.layout import MAX_OWNERS, owner_manifest_key, version_prefix
from dcr.format.manifest import (
    DEFAULT_MANIFEST_LIMITS,
    Manifest,
    ManifestLimits,
    TensorEntry,
    merge_manifests,
)
from dcr.format.names import object_digest
from dcr.protocol.records import CommitRecord
from dcr.transport.store import Store, Tagged

log = logging.getLogger(__name__)
SNAPSHOTS = "snapshots/"
COPIES = "histories/"  # each history a coordinator commits with, under its digest
KEEP_COPIES = 4  # older copies kept for readers given an older digest (an agent mid-attempt)
_INDEX_KEY = re.compile(r"snapshots/v(\d{10})/index\.dcrs")


def get_checked(store: Store, ref: ObjectRef, what: str) -> bytes:
    """The object ``ref`` names, refused unless it has the size and digest it names."""
    data = store.get(ref.key)
    if len(data) != ref.size:
        raise ManifestError(f"{what} {ref.key} is {len(data)} bytes; the history says "
                            f"{ref.size}.")
    got = object_digest(data)
    if got != ref.digest:
        raise ManifestError(f"{what} {ref.key}: digest mismatch (expected {ref.digest}, got "
                            f"{got}).")
    return data


def _itemsize(dtype: str) -> int:
    """Bytes per element of a manifest's dtype (the widest for one this reader does not
    know: an upper bound is what a size check needs)."""
    known = DTYPES.get(dtype)
    return known.itemsize if known is not None else max(d.itemsize for d in DTYPES.values())


def copy_key(digest: str) -> str:
    """Where the coordinator stores the history it commits with, by its digest: a history
    put back in the history object's place is repaired from there."""
    return f"{COPIES}{digest}.dcrh"


class HistoryRefused(ManifestError):
    """The store's history is not the one vouched for, and no copy of that one is left."""


def retained(history: History, keep_snapshots: int | None) -> tuple[History, list[str]]:
    """``history`` keeping the newest ``keep_snapshots`` snapshots and the committed
    versions from the oldest of them on (its own entry too: its fingerprints check that
    snapshot), and the store prefixes it no longer names. Unchanged while fewer snapshots
    exist, or without ``keep_snapshots``."""
    if keep_snapshots is None or len(history.snapshots) <= keep_snapshots:
        return history, []
    kept = history.snapshots[-keep_snapshots:]
    oldest = kept[0].version
    dropped = [c for c in history.versions if c.version < oldest]
    gone = [s for s in history.snapshots if s not in kept]
    log.info("history: pruned %d versions and %d snapshots below version %s",
             len(dropped), len(gone), oldest)
    return history.model_copy(update={
        "versions": tuple(c for c in history.versions if c.version >= oldest),
        "snapshots": tuple(kept)}), (
        [f"{version_prefix(c.version)}/{c.attempt}/" for c in dropped]
        + [f"{SNAPSHOTS}v{s.version:010d}/" for s in gone])


@dataclass
class HistoryStore:
    """One store's history. ``digest``: what the history object must hash to (a reader
    told it by the coordinator); None trusts the store's writers."""

    store: Store
    digest: str | None = None
    limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS  # a receiver's own (limits_for)
    owners: int = MAX_OWNERS  # the most owners an attempt of this fleet has
    max_bytes: int = MAX_HISTORY_BYTES  # what this reader parses at most (expect())
    keep_snapshots: int | None = None  # retention the coordinator applies as it stages
    pruned: list[str] = field(default_factory=list)  # prefixes the last staged one dropped
    _manifests: dict[int, Manifest] = field(default_factory=dict, repr=False)
    _parsed: tuple[str, History] | None = field(default=None, repr=False)
    _latest: tuple[str, History] | None = field(default=None, repr=False)  # by store tag
    _refused: set[str] = field(default_factory=set, repr=False)  # snapshot index digests
    _copies: dict[str, int] = field(default_factory=dict, repr=False)  # digest -> version

    def expect(self, versions: int, owners: int | None = None) -> None:
        """From now on parse no history larger than one naming ``versions`` committed
        versions, each by ``owners`` manifest parts (default: as set before), can be: what
        the caller was told the fleet committed, by whoever told it the version."""
        self.owners = owners if owners is not None else self.owners
        self.max_bytes = history_bound(versions, self.owners)

    def read(self) -> History:
        """The history: the one ``digest`` names (from its copy if another was put in its
        place), else as the store holds it."""
        if self.digest is not None:
            if self._parsed is not None and self._parsed[0] == self.digest:
                return self._parsed[1]  # a digest names one history: never fetched again
            return self._parse(self._vouched(self.digest), self.digest)
        try:
            data = self.store.get(HISTORY_KEY)
        except ObjectNotFound:
            return History()
        return self._parse(data, None)

    def latest(self) -> History:
        """The history as the store holds it now, whoever wrote it (for ``/readyz``, which
        asks whether a newer version was committed): fetched again only once the store's
        tag for it changed (S3's ETag, a file's mtime and size)."""
        tag = self.store.tag(HISTORY_KEY) if isinstance(self.store, Tagged) else None
        if tag is not None and self._latest is not None and self._latest[0] == tag:
            return self._latest[1]
        history = self._unvouched().read()
        self._latest = (tag, history) if tag is not None else None
        return history

    def _parse(self, data: bytes, digest: str | None) -> History:
        """``data`` parsed, or the last history parsed when it had the same digest."""
        digest = digest or object_digest(data)
        if self._parsed is None or self._parsed[0] != digest:
            self._parsed = (digest, History.parse(data, f"{self.store.uri}/{HISTORY_KEY}",
                                                  self.max_bytes))
        return self._parsed[1]

    def _vouched(self, digest: str) -> bytes:
        """The bytes of the history whose digest is ``digest``: the history object if it is
        that one, else the copy the coordinator stored under the digest. Raises
        :class:`HistoryRefused` naming both when neither is."""
        try:
            data = self.store.get(HISTORY_KEY)
            if object_digest(data) == digest:
                return data
            found: str | None = object_digest(data)
        except ObjectNotFound:
            found = None
        log.warning("history %s/%s is %s, not the %s vouched for: reading its copy",
                    self.store.uri, HISTORY_KEY, found or "missing", digest)
        return self._copy(digest, found)

    def _copy(self, digest: str, found: str | None) -> bytes:
        """The coordinator's copy of the history ``digest`` names; :class:`HistoryRefused`
        naming both digests when it is gone or altered."""
        try:
            copy = self.store.get(copy_key(digest))
        except ObjectNotFound:
            copy = b""
        if object_digest(copy) == digest:
            return copy
        raise HistoryRefused(f"History {self.store.uri}/{HISTORY_KEY} "
                             f"{'has digest ' + found if found else 'does not exist'}: it is "
                             f"not the {digest} the caller vouches for, and the copy "
                             f"{copy_key(digest)} the coordinator wrote is gone or altered.")

    def _unvouched(self) -> HistoryStore:
        """A reader of the store's history as it is, with this one's limits."""
        return HistoryStore(self.store, limits=self.limits, owners=self.owners,
                            max_bytes=self.max_bytes)

    def _write(self, history: History) -> str:
        data = history.pack()
        self.store.put(HISTORY_KEY, data)
        self.digest = object_digest(data)
        return self.digest

    def vouched(self, record: CommitRecord) -> History:
        """The history ``record`` vouches for (as the store holds it for a record that
        carries no digest). Raises :class:`HistoryRefused`."""
        if not record.history_digest:
            return self._unvouched().read()
        return self._parse(self._vouched(record.history_digest), record.history_digest)

    def stage(self, base: CommitRecord, version: int, attempt: str, owners: int) -> str:
        """The digest of the history that records ``attempt`` committing ``version`` after
        the history ``base`` vouches for (snapshots adopted, ``keep_snapshots`` applied),
        stored under its digest; the history object is unchanged until :meth:`publish`.
        The prefixes it no longer names are left in ``pruned``."""
        self.expect(base.committed_version)  # no more versions than the record names
        history = self.vouched(base)
        entry = self._entry(history, version, attempt, owners)
        staged = self.adopt(history.model_copy(update={"versions": (*history.versions, entry)}))
        staged, self.pruned = retained(staged, self.keep_snapshots)
        data = staged.pack()
        digest = object_digest(data)
        self.store.put(copy_key(digest), data)
        self.pruned += self._old_copies({digest, base.history_digest})
        log.info("history: staged %s, naming version %s committed by %s", digest, version,
                 attempt)
        return digest

    def _old_copies(self, keep: set[str]) -> list[str]:
        """The coordinator's copies of histories beyond the ``KEEP_COPIES`` newest besides
        ``keep`` (the one staged and the one the record vouches for), oldest first by the
        version each names; one that is no history of this store's (its bytes are not the
        digest its key names, or do not parse) counts as oldest."""
        aged: list[tuple[int, str]] = []
        for key in self.store.list(COPIES):
            digest = key[len(COPIES):].removesuffix(".dcrh")
            if digest not in keep:
                aged.append((self._copy_version(key, digest), key))
        aged.sort()
        return [key for _, key in aged[:max(0, len(aged) - KEEP_COPIES)]]

    def _copy_version(self, key: str, digest: str) -> int:
        if digest not in self._copies:
            try:
                data = self.store.get(key)
                ok = object_digest(data) == digest
                version = History.parse(data, key, self.max_bytes).committed if ok else -1
            except (ManifestError, ObjectNotFound):
                version = -1
            self._copies[digest] = version
        return self._copies[digest]

    def publish(self, record: CommitRecord, owners: int) -> None:
        """Make the store's history the one ``record`` vouches for: put it back from its
        copy where another stands in its place (idempotent). A record that carries no
        digest is recorded as :meth:`commit` does."""
        if not record.history_digest:
            self.commit(record.committed_version, record.attempt, owners)
            return
        try:
            current: str | None = object_digest(self.store.get(HISTORY_KEY))
        except ObjectNotFound:
            current = None
        if current != record.history_digest:
            self.store.put(HISTORY_KEY, self._copy(record.history_digest, current))
            log.info("history: %s now names version %s (was %s)", record.history_digest,
                     record.committed_version, current)
        self.digest = record.history_digest

    # --- the coordinator's side ----------------------------------------------------------

    def commit(self, version: int, attempt: str, owners: int) -> str:
        """Record that ``attempt`` committed ``version``; the history's new digest. Reads
        the attempt's manifest parts, which must name that version and follow the history's
        last version."""
        history = self.read()
        if any(c.version == version for c in history.versions):
            done = history.entry(version)
            if done.attempt != attempt:
                raise ManifestError(f"The history says attempt {done.attempt} committed "
                                    f"version {version}, not {attempt}.")
            return object_digest(history.pack())
        entry = self._entry(history, version, attempt, owners)
        history = history.model_copy(update={"versions": (*history.versions, entry)})
        digest = self._write(self.adopt(history))
        log.info("history: version %s committed by %s (%d payload bytes)", version, attempt,
                 entry.payload_bytes)
        return digest

    def _entry(self, history: History, version: int, attempt: str, owners: int) -> Committed:
        """The entry that records ``attempt`` committing ``version``, from its manifest
        parts, which must name that version and follow the history's last version."""
        refs, parts = [], []
        for k in range(owners):
            key = owner_manifest_key(version, attempt, k)
            data = self.store.get(key)
            refs.append(ObjectRef(key=key, size=len(data), digest=object_digest(data)))
            parts.append(Manifest.parse(data, f"{self.store.uri}/{key}", self.limits))
        m = merge_manifests(parts, f"attempt {attempt}")
        if m.target_version != version or (history.versions
                                           and m.base_version != history.committed):
            raise ManifestError(f"Attempt {attempt} takes {m.base_version} -> "
                                f"{m.target_version}; the history holds {history.span()} "
                                f"and records version {version}.")
        return Committed(version=version, base_version=m.base_version, attempt=attempt,
                         parts=tuple(refs), payload_bytes=m.stats.payload_bytes)

    def adopt(self, history: History) -> History:
        """``history`` with the snapshots the store holds that it does not name yet, each
        only once it was read back whole: every piece of its tensor files fetched and
        checked by digest, and the fingerprints of the tensors computed from those bytes
        equal to those the history vouches for at its version (so whoever may write
        snapshot objects never writes the history, and a snapshot retention may prune
        older data for is one a reader can build from)."""
        named = {s.version for s in history.snapshots}
        found = []
        for key in self.store.list(SNAPSHOTS):
            m = _INDEX_KEY.fullmatch(key)
            if m is None or int(m[1]) in named:
                continue
            try:
                expect = self.fingerprints(history, int(m[1]))
                layout = self.layout(history, int(m[1]))
            except ManifestError as e:  # not vouched for (yet)
                log.info("history: snapshot %s not adopted: %s", key, e)
                continue
            try:
                found.append(self._read_back(int(m[1]), key, expect, layout))
            except (ManifestError, ObjectNotFound) as e:
                log.warning("history: snapshot %s not adopted: %s", key, e)
        if not found:
            return history
        snaps = tuple(sorted([*history.snapshots, *found], key=lambda s: s.version))
        return history.model_copy(update={"snapshots": snaps})

    def _read_back(self, version: int, key: str, expect: dict[str, str],
                   layout: dict[str, tuple[str, tuple[int, ...]]]) -> Snapshot:
        data = self.store.get(key)
        digest = object_digest(data)
        if digest in self._refused:
            raise ManifestError(f"its index {digest} was refused before")
        try:
            index = parse_index(data, f"{self.store.uri}/{key}")
            if index.version != version or index.tensors != expect:
                raise ManifestError(f"its index names version {index.version} or other "
                                    f"fingerprints than the history's of version {version}")
            have = self._tensors_read_back(index, layout, key)
            wrong = sorted(n for n in {*have, *expect} if have.get(n) != expect.get(n))
            if wrong:
                raise ManifestError(f"read back, {len(wrong)} tensors differ from the "
                                    f"fingerprints the history vouches for at version "
                                    f"{version}, first {wrong[:3]}")
        except (ManifestError, ObjectNotFound):
            self._refused.add(digest)  # read once: a refused index costs one read back
            raise
        read = (index.total_bytes if isinstance(index, RankSnapshotIndex)  # all tensors
                else sum(f.size for f in index.files if is_tensor_file(f.name)))
        log.info("history: snapshot of version %s read back whole (%d bytes); adopted",
                 version, read)
        return Snapshot(version=version, index=ObjectRef(key=key, size=len(data),
                                                         digest=digest), bytes=read)

    def _tensors_read_back(self, index: AnyIndex,
                           layout: dict[str, tuple[str, tuple[int, ...]]], key: str
                           ) -> dict[str, str]:
        """Every tensor's fingerprint, from the snapshot's pieces read back (each checked
        by its digest), after the index is checked against ``layout`` (the manifests'
        dtypes and shapes) before any piece is fetched."""
        def get(p: Piece) -> bytes:
            return get_checked(self.store, ObjectRef(key=p.key, size=p.size,
                                                     digest=p.digest), "Snapshot piece")

        if isinstance(index, RankSnapshotIndex):
            if index.shapes() != layout:
                raise ManifestError(f"its index lays out the tensors otherwise than the "
                                    f"manifests of version {index.version} (dtype, shape)")
            return read_back_ranks(index, get, key)
        declared_fits(index, sum(math.prod(s) * _itemsize(d) for d, s in layout.values()),
                      f"{self.store.uri}/{key}")
        return read_back(index, get, key)

    def snapshot(self, snap: Snapshot) -> str:
        """Record a snapshot the store now holds; the history's new digest. Only where no
        coordinator writes the history: one that does adopts snapshots at its commits."""
        history = self.read()
        kept = [s for s in history.snapshots if s.version != snap.version]
        snaps = tuple(sorted([*kept, snap], key=lambda s: s.version))
        return self._write(history.model_copy(update={"snapshots": snaps}))

    def prune(self, keep_snapshots: int) -> tuple[History, list[str]]:
        """Keep the newest ``keep_snapshots`` snapshots and the committed versions from the
        oldest of them on (its own entry too: its fingerprints check that snapshot); write
        the history without the rest. The history as it now is, and the store prefixes it
        no longer names, for the caller to remove. Nothing is pruned while fewer snapshots
        exist."""
        history, prefixes = retained(self.read(), keep_snapshots)
        if prefixes:
            self._write(history)
        return history, prefixes

    # --- the receivers' side -------------------------------------------------------------

    def manifest(self, entry: Committed) -> Manifest:
        """The committed attempt's manifest, its parts checked against the history."""
        if entry.version not in self._manifests:
            named = sum(ref.size for ref in entry.parts)
            if named > self.limits.max_bytes:  # refused before anything is fetched
                raise ManifestError(f"The manifest of version {entry.version} is "
                                    f"{named} bytes in {len(entry.parts)} parts, over this "
                                    f"reader's limit of {self.limits.max_bytes}.")
            parts = [Manifest.parse(get_checked(self.store, ref, "Manifest part"),
                                    f"{self.store.uri}/{ref.key}", self.limits)
                     for ref in entry.parts]
            m = merge_manifests(parts, f"version {entry.version}")
            if (m.base_version, m.target_version, m.attempt) != (
                    entry.base_version, entry.version, entry.attempt):
                raise ManifestError(f"The manifest of version {entry.version} names "
                                    f"{m.base_version} -> {m.target_version} ({m.attempt}); "
                                    f"the history says {entry.base_version} -> "
                                    f"{entry.version} ({entry.attempt}).")
            self._manifests[entry.version] = m
        return self._manifests[entry.version]

    def fingerprints(self, history: History, version: int) -> dict[str, str]:
        """Every tensor's fingerprint at ``version``, as the committed manifests list them:
        the targets of the attempt that committed it, or for the first base, the bases of
        the attempt that left it."""
        tensors, at_target = self._tensors(history, version)
        return {t.name: t.target if at_target else t.base for t in tensors}

    def layout(self, history: History, version: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor's dtype and shape at ``version``, as the committed manifests list
        them."""
        return {t.name: (t.dtype, t.shape) for t in self._tensors(history, version)[0]}

    def _tensors(self, history: History, version: int) -> tuple[tuple[TensorEntry, ...], bool]:
        """The manifest tensors that vouch for ``version``, and whether their targets do
        (else their bases: the first base)."""
        for c in history.versions:
            if c.version == version:
                return self.manifest(c).tensors, True
        for c in history.versions:
            if c.base_version == version:
                return self.manifest(c).tensors, False
        raise ManifestError(f"The history vouches for no fingerprints of version {version} "
                            f"(it holds {history.span()}).")
