"""A snapshot read back whole from the store, its tensors fingerprinted as pieces land.

Before the history adopts a snapshot, its coordinator reads every piece of every tensor
file back (each checked by the digest its index names), parses each safetensors header
from the bytes themselves, and fingerprints every tensor from them; only a snapshot whose
tensors are exactly those the history vouches for at its version is adopted. An index
alone proves nothing: its fingerprints are public (every manifest lists them). Nothing
is written to disk, and at most one piece per file is held in memory.
docs/catch-up.md, "Adoption".
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import xxhash

from dcr.checkpoint import INDEX_NAME, MAX_HEADER_BYTES, TensorInfo, parse_header
from dcr.errors import CheckpointError, ManifestError
from dcr.files.vouched import is_tensor_file
from dcr.format.history import Piece, SnapshotFile, SnapshotIndex

MAX_WEIGHT_MAP_BYTES = 64 << 20
_PER_TENSOR = 4096  # header and shard-index bytes a tensor may take beyond its data
_PER_FILE = 8 + (64 << 10)  # a file's length prefix and its header's metadata


def declared_fits(index: SnapshotIndex, tensor_bytes: int, where: str) -> None:
    """Refuse, before any piece is fetched, an index whose tensor files declare more bytes
    than a checkpoint of its tensors can hold: ``tensor_bytes`` of data (shape times
    element size, as the manifests list them) and a bounded header per tensor and file.
    A self-consistent index cannot make a reader fetch more than that."""
    files = [f for f in index.files if is_tensor_file(f.name)]
    declared = sum(f.size for f in files)
    tensors = len(index.tensors)
    bound = tensor_bytes + tensors * _PER_TENSOR + len(files) * _PER_FILE
    if len(files) > tensors + 1 or declared > bound:
        raise ManifestError(f"Snapshot {where}: its {len(files)} tensor files declare "
                            f"{declared} bytes; {tensors} tensors of {tensor_bytes} bytes fit "
                            f"in {tensors + 1} files of at most {bound}.")


class TensorStream:
    """One safetensors file's tensor fingerprints, from its bytes fed in order."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size, self.pos = name, size, 0
        self._head = bytearray()
        self._spans: list[tuple[int, int, str]] = []  # (start, end, tensor), ascending
        self._hash: dict[str, xxhash.xxh3_128] = {}
        self._ready = False

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._ready:  # the length, then the header
            take = view[:self._header_end() - len(self._head)]
            self._head += take
            self.pos += len(take)
            view = view[len(take):]
            if len(self._head) >= 8 and len(self._head) == self._header_end():
                self._parse()
        for start, end, name in self._spans:
            lo, hi = max(start, self.pos), min(end, self.pos + len(view))
            if lo < hi:
                self._hash[name].update(view[lo - self.pos:hi - self.pos])
        self.pos += len(view)

    def _header_end(self) -> int:
        if len(self._head) < 8:
            return 8
        (hlen,) = struct.unpack("<Q", self._head[:8])
        if hlen > MAX_HEADER_BYTES or 8 + hlen > self.size:
            raise CheckpointError(f"{self.name}: header length {hlen} does not fit a file "
                                  f"of {self.size} bytes.")
        return int(8 + hlen)

    def _parse(self) -> None:
        infos: dict[str, TensorInfo] = parse_header(Path(self.name), bytes(self._head[8:]),
                                                    self.size)
        self._spans = sorted((t.offset, t.offset + t.nbytes, n) for n, t in infos.items())
        end = len(self._head) + sum(t.nbytes for t in infos.values())
        if end != self.size:  # no byte of a tensor file is left unchecked
            raise CheckpointError(f"{self.name} is {self.size} bytes; its header and tensors "
                                  f"are {end}.")
        self._hash = {n: xxhash.xxh3_128() for n in infos}
        self._ready = True

    def fingerprints(self) -> dict[str, str]:
        if not self._ready or self.pos != self.size:
            raise CheckpointError(f"{self.name}: {self.pos} of {self.size} bytes read.")
        return {n: "xxh3-128:" + h.hexdigest() for n, h in self._hash.items()}


def read_back(index: SnapshotIndex, get: Callable[[Piece], bytes], where: str
              ) -> dict[str, str]:
    """Every tensor's fingerprint in the tensor files of ``index``, from the bytes ``get``
    returns for each piece (checked by its digest there). Raises :class:`ManifestError`
    for a file that is no safetensors file, a tensor in two files, or a shard index that
    does not list exactly the tensors the shards hold."""
    found: dict[str, str] = {}
    where_of: dict[str, str] = {}
    weight_map: dict[str, str] | None = None
    for f in index.files:
        if not is_tensor_file(f.name):
            continue  # never fetched by a reader (dcr.files.vouched)
        if f.name == INDEX_NAME:
            weight_map = _weight_map(f, get, where)
            continue
        stream = TensorStream(f"{where}/{f.name}", f.size)
        try:
            for piece in f.pieces:
                stream.feed(get(piece))
            prints = stream.fingerprints()
        except CheckpointError as e:
            raise ManifestError(f"Snapshot {where}: {e}") from e
        for name, fp in prints.items():
            if name in found:
                raise ManifestError(f"Snapshot {where}: tensor {name!r} is in "
                                    f"{where_of[name]} and {f.name}.")
            found[name], where_of[name] = fp, f.name
    if weight_map is not None and weight_map != where_of:
        raise ManifestError(f"Snapshot {where}: {INDEX_NAME} does not map the tensors to "
                            "the shards that hold them.")
    return found


def _weight_map(f: SnapshotFile, get: Callable[[Piece], bytes], where: str
                ) -> dict[str, str]:
    if f.size > MAX_WEIGHT_MAP_BYTES:
        raise ManifestError(f"Snapshot {where}: {f.name} is {f.size} bytes, over the limit "
                            f"of {MAX_WEIGHT_MAP_BYTES}.")
    data = b"".join(get(p) for p in f.pieces)
    try:
        weight_map = json.loads(data)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"Snapshot {where}: {f.name} is no shard index: {e}.") from e
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ManifestError(f"Snapshot {where}: {f.name}'s weight_map must map tensor "
                            "names to shard file names.")
    return weight_map
