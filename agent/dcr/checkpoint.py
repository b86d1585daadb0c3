"""Hugging Face safetensors checkpoints, read memory-mapped, tensor by tensor.

Tensors are raw bits (unsigned integers of the element width) over a read-only memory map,
never read as floats; headers are validated like any untrusted input.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from dcr.errors import CheckpointError
from dcr.format.dtypes import DTYPES, DType

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20

UInt = npt.NDArray[np.unsignedinteger]


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and byte range in that file."""

    name: str
    file: Path
    dtype: DType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file.")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise CheckpointError(
                    f"{path}: header length {hlen} does not fit a file of {size} bytes."
                )
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"Cannot read {path}: {e}.") from e
    return parse_header(path, raw, size)


def parse_header(path: Path, raw: bytes, size: int) -> dict[str, TensorInfo]:
    """The tensors a safetensors header ``raw`` names, in a file of ``size`` bytes, checked
    (also for bytes read from elsewhere than a file, such as a store's pieces)."""
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not JSON: {e}.") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: header is not a JSON object.")
    data_start = 8 + len(raw)
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, spec in meta.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, spec, data_start, size)
        t = tensors[name]
        spans.append((t.offset, t.offset + t.nbytes, name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap.")
    return tensors


def _tensor_info(path: Path, name: str, spec: object, data_start: int, size: int) -> TensorInfo:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{path}: entry {name!r} is not a safetensors tensor entry.")
    dt = DTYPES.get(spec["dtype"])
    if dt is None:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {spec['dtype']!r}.")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid shape {shape!r}.")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    ):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}.")
    begin, end = offsets
    numel = math.prod(shape)  # exact: a wrapped int64 product would pass the size check
    if not 0 <= begin <= end or end - begin != numel * dt.itemsize or data_start + end > size:
        raise CheckpointError(
            f"{path}: tensor {name!r} ({dt.name}{shape}) has data_offsets {offsets} that do "
            f"not match its size or the file's {size} bytes."
        )
    return TensorInfo(
        name=name, file=path, dtype=dt, shape=tuple(shape), offset=data_start + begin,
        nbytes=end - begin,
    )


class Checkpoint:
    """The tensors of one checkpoint, keyed by canonical name, over read-only mmaps."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = _checkpoint_files(root)
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in read_header(f).items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"{root}: tensor {name!r} appears in {self.tensors[name].file.name} "
                        f"and {f.name}."
                    )
                self.tensors[name] = info
        self._check_index()
        self._maps: dict[Path, mmap.mmap] = {}

    def _check_index(self) -> None:
        index = self.root / INDEX_NAME
        if not index.exists():
            return
        weight_map = _read_weight_map(index)
        for name, info in self.tensors.items():
            if weight_map.get(name) != info.file.name:
                raise CheckpointError(
                    f"{index}: tensor {name!r} is in {info.file.name} but the index says "
                    f"{weight_map.get(name)!r}."
                )
        missing = sorted(set(weight_map) - set(self.tensors))
        if missing:
            raise CheckpointError(f"{index}: lists tensors no shard holds: {missing[:5]}.")

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def bits(self, name: str) -> UInt:
        """The tensor's raw bits as a flat, read-only integer array over the mmap."""
        info = self.tensors[name]
        if info.numel == 0:
            return np.empty(0, dtype=info.dtype.bits)
        mm = self._maps.get(info.file)
        if mm is None:
            with info.file.open("rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[info.file] = mm
        return np.frombuffer(mm, dtype=info.dtype.bits, count=info.numel, offset=info.offset)

    def fingerprint(self, name: str) -> str:
        return fingerprint(self.bits(name))

    def close(self) -> None:
        # Views handed out keep their mmaps alive; dropping ours is enough.
        self._maps.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[TensorInfo]:
        return (self.tensors[n] for n in self.names())


def fingerprint(bits: UInt) -> str:
    """A fast 128-bit fingerprint of a tensor's bits (xxh3-128), for version checks."""
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(np.ascontiguousarray(bits).data.cast("B"))


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a safetensors index: {e}.") from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index}: weight_map must map tensor names to shard file names, got "
            f"{str(weight_map)[:80]!r}."
        )
    return weight_map


def _checkpoint_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise CheckpointError(f"Checkpoint {root} does not exist.")
    index = root / INDEX_NAME
    if index.exists():
        weight_map = _read_weight_map(index)
        names = sorted(set(weight_map.values()))
        for n in names:
            if os.sep in n or n.startswith(".") or not (root / n).is_file():
                raise CheckpointError(f"{index} names shard {n!r}, which is not a file in {root}.")
        return [root / n for n in names]
    single = root / SINGLE_NAME
    if single.exists():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise CheckpointError(
        f"{root} has no {INDEX_NAME}, no {SINGLE_NAME}, and {len(found)} .safetensors files."
    )


class TensorSource(Protocol):
    """What a diff reads: tensors by canonical name, as raw bits."""

    tensors: dict[str, TensorInfo]

    def names(self) -> list[str]: ...

    def bits(self, name: str) -> UInt: ...

    def fingerprint(self, name: str) -> str: ...

    def __iter__(self) -> Iterator[TensorInfo]: ...


MEMORY = Path("<memory>")


class ArrayCheckpoint:
    """Canonical tensors held in memory (a trainer's export), with the Checkpoint API."""

    def __init__(self, arrays: Mapping[str, tuple[str, tuple[int, ...], UInt]]) -> None:
        """``arrays``: name -> (dtype name, shape, raw bits in that dtype's width)."""
        self._bits: dict[str, UInt] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, (dtype_name, shape, bits) in arrays.items():
            dt = DTYPES[dtype_name]
            flat = np.ascontiguousarray(bits).reshape(-1).view(dt.bits)
            if flat.size != math.prod(shape):
                raise CheckpointError(
                    f"Tensor {name!r}: {flat.size} elements do not fill shape {list(shape)}."
                )
            self._bits[name] = flat
            self.tensors[name] = TensorInfo(
                name=name, file=MEMORY, dtype=dt, shape=tuple(shape), offset=0,
                nbytes=flat.nbytes,
            )

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def bits(self, name: str) -> UInt:
        return self._bits[name]

    def fingerprint(self, name: str) -> str:
        return fingerprint(self._bits[name])

    def __iter__(self) -> Iterator[TensorInfo]:
        return (self.tensors[n] for n in self.names())
