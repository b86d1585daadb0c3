"""A node's staging area: the payloads and manifests it holds, under a byte budget.

Memory up to ``budget_bytes``, then spool files up to ``spool_budget_bytes``; an upload that
fits neither waits. Also how a received blob is verified and read back out as a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import tempfile
from collections.abc import AsyncIterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from dcr.errors import DcrError
from dcr.format.manifest import manifest_attempt
from dcr.format.names import object_digest
from dcr.format.payload import read_payload
from dcr.transport.relay.wire import Chunk, Key, Pieces, RelayRefused

Where = Literal["memory", "spool"]


@dataclass(eq=False, kw_only=True)
class Blob:
    """One staged (or still arriving) payload or manifest."""

    key: Key
    size: int
    where: Where
    buf: bytearray | None = None  # where == "memory"
    path: Path | None = None  # where == "spool"
    file: IO[bytes] | None = None  # open while the body arrives
    received: int = 0
    digest: str = ""  # BLAKE2b-128 of the whole object, hex, once verified
    state: Literal["incoming", "staged", "gone"] = "incoming"
    dropped: bool = False  # its attempt was deleted while it arrived
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set when not incoming


class Staging:
    """Payloads and manifests a node holds, under a memory budget with a disk spool."""

    def __init__(self, *, budget_bytes: int, spool_dir: Path | None, spool_budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.spool_dir = spool_dir  # may be set later, once the node made its directory
        self._spool_budget_bytes = spool_budget_bytes
        self.memory_bytes = 0  # reserved in memory, arriving or staged
        self.spool_bytes = 0  # reserved on disk, arriving or staged
        self.waiting = 0  # uploads waiting for space
        self._blobs: dict[Key, Blob] = {}
        self._arrived: dict[str, int] = {}  # attempt -> blobs held, in order of first arrival
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def spool_budget_bytes(self) -> int:
        return self._spool_budget_bytes if self.spool_dir is not None else 0

    def get(self, key: Key) -> Blob | None:
        return self._blobs.get(key)

    def blobs(self) -> list[Blob]:
        return list(self._blobs.values())

    def attempts(self) -> list[str]:
        """The attempts held (staged or arriving), oldest first arrival first."""
        return list(self._arrived)

    def staged(self, attempt: str | None = None) -> list[Blob]:
        return sorted(
            (b for b in self._blobs.values()
             if b.state == "staged" and attempt in (None, b.key.attempt)),
            key=lambda b: b.key,
        )

    def can_ever_hold(self, size: int) -> bool:
        return size <= max(self.budget_bytes, self.spool_budget_bytes)

    def _place(self, size: int) -> Where | None:
        if self.memory_bytes + size <= self.budget_bytes:
            return "memory"
        if self.spool_bytes + size <= self.spool_budget_bytes:
            return "spool"
        return None

    async def reserve(self, size: int, deadline: float) -> Where:
        """Reserve ``size`` bytes, waiting until ``deadline`` (loop time); TimeoutError after."""
        loop = asyncio.get_running_loop()
        while (where := self._place(size)) is None:
            waiter = loop.create_future()
            self._waiters.append(waiter)
            self.waiting += 1
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            finally:
                self.waiting -= 1
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        if where == "memory":
            self.memory_bytes += size
        else:
            self.spool_bytes += size
        return where

    def release(self, where: Where, size: int) -> None:
        if where == "memory":
            self.memory_bytes -= size
        else:
            self.spool_bytes -= size
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def begin(self, key: Key, size: int, where: Where) -> Blob:
        """Register an arriving blob whose space is reserved."""
        assert key not in self._blobs, key
        blob = Blob(key=key, size=size, where=where)
        if where == "memory":
            blob.buf = bytearray(size)
        else:
            assert self.spool_dir is not None
            fd, name = tempfile.mkstemp(dir=self.spool_dir, prefix=f"{key.attempt}.")
            blob.path = Path(name)
            blob.file = os.fdopen(fd, "wb")
        self._blobs[key] = blob
        self._arrived[key.attempt] = self._arrived.get(key.attempt, 0) + 1
        return blob

    @staticmethod
    def write(blob: Blob, chunk: Chunk) -> None:
        n = len(chunk)
        if blob.buf is not None:
            blob.buf[blob.received : blob.received + n] = chunk
        else:
            assert blob.file is not None
            blob.file.write(chunk)
        blob.received += n

    @staticmethod
    def finish_writing(blob: Blob) -> None:
        if blob.file is not None:
            blob.file.close()
            blob.file = None

    def commit(self, blob: Blob, digest: str) -> None:
        blob.digest, blob.state = digest, "staged"
        blob.done.set()

    def discard(self, blob: Blob) -> None:
        """Forget a blob, free its space and wake uploads waiting for space."""
        if blob.state == "gone":
            return
        if self._blobs.get(blob.key) is blob:
            del self._blobs[blob.key]
            self._arrived[blob.key.attempt] -= 1  # in place: the order stays
            if not self._arrived[blob.key.attempt]:
                del self._arrived[blob.key.attempt]
        blob.state = "gone"
        blob.done.set()
        if blob.file is not None:
            blob.file.close()
            blob.file = None
        if blob.path is not None:
            blob.path.unlink(missing_ok=True)
        blob.buf = None  # a response still sending it keeps its own reference
        self.release(blob.where, blob.size)

    def drop_attempt(self, attempt: str) -> int:
        """Discard every staged blob of ``attempt``; mark arriving ones to be dropped."""
        n = 0
        for blob in list(self._blobs.values()):
            if blob.key.attempt != attempt:
                continue
            if blob.state == "incoming":
                blob.dropped = True
            else:
                self.discard(blob)
            n += 1
        return n


@contextlib.contextmanager
def _view(blob: Blob) -> Iterator[memoryview]:
    """The whole blob as one buffer: its bytearray, or its spool file mapped read-only."""
    if blob.buf is not None:
        yield memoryview(blob.buf)
        return
    assert blob.path is not None
    with open(blob.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        # A traceback may still hold a view derived from it; then the mapping goes when
        # that is collected.
        with contextlib.suppress(BufferError):
            mm.close()


def verify(blob: Blob) -> str:
    """Check a fully received blob and return its digest. Runs in a worker thread."""
    key = blob.key
    with _view(blob) as view:
        if key.kind == "payload":
            try:
                header = read_payload(view).header
            except DcrError as e:
                raise RelayRefused(400, f"{key.label}: {e}") from e
            got = (header.attempt, header.owner, header.seq)
            if got != (key.attempt, key.owner, key.seq):
                raise RelayRefused(
                    400,
                    f"{key.label}: the URL names it but its header says attempt "
                    f"{got[0]}, owner {got[1]}, seq {got[2]}.",
                )
        else:
            try:  # the container and the attempt only: receivers parse, with their limits
                attempt = manifest_attempt(view, key.label)
            except DcrError as e:
                raise RelayRefused(400, str(e)) from e
            if attempt != key.attempt:
                raise RelayRefused(400, f"{key.label}: the manifest is for attempt {attempt}.")
        return object_digest(view)


class _SpoolPieces:
    """A spooled blob's bytes as an async iterable of reads done in a worker thread."""

    def __init__(self, path: Path, size: int, chunk_bytes: int) -> None:
        self._path, self._size, self._chunk, self._offset = path, size, chunk_bytes, 0

    def __aiter__(self) -> _SpoolPieces:
        return self

    async def __anext__(self) -> Chunk:
        if self._offset >= self._size:
            raise StopAsyncIteration
        n = min(self._chunk, self._size - self._offset)
        piece = await asyncio.to_thread(_read_at, self._path, self._offset, n)
        self._offset += n
        return piece


def staged_body(blob: Blob, chunk_bytes: int) -> AsyncIterable[Chunk]:
    """A staged blob's bytes; holds the buffer so a concurrent DELETE cannot pull it away."""
    if blob.buf is not None:
        return Pieces(blob.buf, chunk_bytes)
    assert blob.path is not None
    return _SpoolPieces(blob.path, blob.size, chunk_bytes)


def _read_at(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        piece = f.read(n)
    if len(piece) != n:
        raise OSError(f"Spool file {path} ended before byte {offset + n}.")
    return piece
