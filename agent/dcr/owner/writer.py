"""One owner's part of one attempt in a store: sealed payloads, then its manifest part.

:class:`AttemptWriter` seals the buckets :mod:`dcr.owner.diff` and :mod:`dcr.owner.shards`
fill and puts each under its payload key. The manifest goes last (under the attempt, or at
the version for ``dcr patch``), so a reader that finds it finds every payload it lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr.codec.encode import PayloadBuilder
from dcr.format.layout import manifest_key, owner_manifest_key, payload_key
from dcr.format.manifest import Manifest, PayloadEntry, RegionSum, Stats, TensorEntry
from dcr.format.names import Mode, object_digest
from dcr.transport.store import Store


@dataclass(kw_only=True)
class AttemptWriter:
    """Writes owner ``owner``'s payloads and manifest of attempt ``attempt``."""

    store: Store
    base_version: int
    target_version: int
    attempt: str
    mode: Mode
    owner: int
    level: int  # zstd level of every payload
    per_attempt: bool  # the manifest under the attempt, not at the version
    entries: list[PayloadEntry] = field(default_factory=list, init=False)

    def builder(self, seq: int) -> PayloadBuilder:
        """An empty bucket: this owner's payload number ``seq`` of the attempt."""
        return PayloadBuilder(base_version=self.base_version, target_version=self.target_version,
                              attempt=self.attempt, owner=self.owner, seq=seq, mode=self.mode,
                              level=self.level)

    def seal(self, builder: PayloadBuilder) -> PayloadEntry:
        """Seal ``builder``, put it in the store and list it. Several may run at once;
        the manifest lists them in ``seq`` order."""
        data = builder.seal()
        key = payload_key(self.target_version, self.attempt, self.owner, builder.seq)
        self.store.put(key, data)
        entry = PayloadEntry(key=key, owner=self.owner, seq=builder.seq, size=len(data),
                             digest=object_digest(data), items=len(builder.items),
                             records=builder.records)
        self.entries.append(entry)
        return entry

    def finish(self, *, tensors: tuple[TensorEntry, ...], tensor_count: int,
               changed_elements: int, total_elements: int, dense_bytes: int,
               sums: tuple[RegionSum, ...] = ()) -> Manifest:
        """Write the manifest of every payload sealed so far; return it.

        ``tensors`` lists fingerprints: of the bits where the owner holds tensors whole,
        else its parts of their sums (the shard path; the document is then version 3);
        ``tensor_count`` counts the tensors this owner compared either way; ``sums`` are
        this owner's parts of the regions receivers hold.
        """
        manifest = Manifest(
            base_version=self.base_version, target_version=self.target_version,
            attempt=self.attempt, mode=self.mode,
            format_version=3 if any(t.summed for t in tensors) else 2,
            payloads=tuple(sorted(self.entries, key=lambda e: e.seq)),
            tensors=tensors,
            sums=sums,
            stats=Stats(tensors=tensor_count, changed_elements=changed_elements,
                        total_elements=total_elements, dense_bytes=dense_bytes,
                        payload_bytes=sum(e.size for e in self.entries)),
        )
        key = (owner_manifest_key(self.target_version, self.attempt, self.owner)
               if self.per_attempt else manifest_key(self.target_version))
        self.store.put(key, manifest.pack())
        return manifest


__all__ = ["AttemptWriter"]
