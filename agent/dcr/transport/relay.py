"""The relay tree: owners stream payloads to one root, which forwards them down a tree.

Each payload crosses the cluster boundary once (owner -> root); every further copy
travels over local links inside the rollout cluster (DESIGN.md section 7). This module
holds the tree math, the node (an HTTP server with a bounded staging area), the client
that owners, receivers and the nodes themselves use, and the process entry point
behind ``dcr relay``.

Choices, and why:

* **Wire protocol: HTTP/1.1 with aiohttp.** A request body is a byte stream, so a node
  can read a payload chunk by chunk while it forwards each chunk onwards; TCP flow
  control is the back-pressure (a node that does not read a body stops its sender);
  ``GET /healthz`` is an ordinary probe for parents and for Kubernetes; aiohttp is
  already a dependency.
* **Tree: members in order, fan-out K.** ``parent(i) = (i-1)//K``,
  ``children(i) = K*i+1 .. K*i+K`` within range; index 0 is the root. Depth is
  ``ceil(log_K(n(K-1)+1)) - 1``; every node derives the same tree from the same list.
* **Cut-through forwarding, not store-and-forward.** A ``PUT`` must carry
  ``Content-Length`` (the budget is reserved from it before one body byte is read). Each
  chunk read from the body is copied once into the staging buffer (or written to the
  spool file) and the same ``bytes`` object is handed to one bounded queue per child;
  a streaming ``PUT`` per child drains its queue. So a payload reaches a leaf while the
  owner is still sending it, and a slow child slows its parent down to the queue depth
  rather than growing memory. A child that takes nothing for ``stall_timeout_s`` loses
  the live copy and gets the staged bytes again later.
* **Verification at every hop.** When the body is complete the node runs
  :func:`dcr.format.payload.read_payload` (framing, digest, header) and checks the
  header's ``(attempt, owner, seq)`` against the URL; manifests are parsed with
  :class:`dcr.format.manifest.Manifest`. A failure answers 400, drops the bytes and
  aborts the forwards still running (children see a short body and drop theirs; they
  would also reject it on their own, since they run the same checks).
* **Hop ack means "queued".** 201 says this node holds verified bytes and has started
  forwarding; it does not wait for children. Completion comes from the receivers' flush.
* **Idempotence by payload id.** A second ``PUT`` of an id with the same BLAKE2b-128
  digest of the whole object answers 200 "duplicate" and is not forwarded again; other
  bytes under a held id answer 409. A ``PUT`` of an id still arriving waits for it.
* **Staging budget.** Uploads reserve their size in memory up to ``budget_bytes``, then
  on disk under ``spool_dir`` up to ``spool_budget_bytes``; when neither fits, the
  upload waits without reading its body and answers 503 after ``admit_timeout_s``. A
  payload that can never fit answers 413. Staged bytes stay until ``DELETE`` of their
  attempt. Beyond the budget a node holds only the per-child queues
  (children x ``queue_chunks`` chunks) and per-connection read buffers (measured: about
  0.6 MiB per waiting upload, whatever its size).
* **Manifests** travel the same endpoints and dedup rules but, being small and the
  attempt's last word, are stored before they are forwarded, and a node forwards a
  manifest to a child only after every payload forward of that attempt to that child
  has ended, so a manifest never overtakes the payloads its sender held before it.
* **Failures.** A non-root node probes its current parent every ``health_interval_s``;
  after ``parent_timeout_s`` without an answer it subscribes to the nearest live
  ancestor (``POST /v1/subscribe`` with its index and the ids it holds). The new parent
  adds it to its forward set and replays every staged payload and manifest it lacks
  (and those still arriving, once verified). With no ancestor reachable the node says
  ``detached`` in ``/healthz`` (a receiver may then fall back to the object store). A
  node also subscribes to its first parent at start, so a restarted node catches up,
  and again every ``resync_interval_s`` (anti-entropy: whatever it missed, through a
  refusal, a stall or exhausted re-sends, comes back). A forward that fails with a
  connection error or a 5xx is re-sent from staging ``retries`` times with doubling
  delays; an upload that brings no bytes for ``stall_timeout_s`` is dropped (a hung
  sender cannot pin staging space). Duplicates from re-sends are dropped by id.

Endpoints (``Authorization: Bearer <token>`` on all but ``/healthz``, else 401)::

    PUT    /v1/payloads/{attempt}/{owner}/{seq}   201 queued | 200 duplicate | 400 | 409
                                                  | 410 deleted | 411 | 413 | 503
    GET    /v1/payloads/{attempt}/{owner}/{seq}   the bytes (404 if not staged)
    GET    /v1/attempts/{attempt}/payloads        {payloads: [{owner, seq, size, digest}],
                                                   manifest: {size, digest} | null}
    DELETE /v1/attempts/{attempt}                 drop it here and below: {dropped}
    PUT    /v1/manifests/{attempt}                as payloads; JSON checked as a Manifest
    GET    /v1/manifests/{attempt}                the manifest bytes
    POST   /v1/subscribe                          {index, held: {attempt: [[owner, seq]]},
                                                   manifests: [attempt]} -> {replaying}
    GET    /v1/status                             health + counters + blobs still arriving
    GET    /healthz                               {status: ok | detached, parent, children,
                                                   staged_bytes, memory_bytes, waiting, ...}

Not here: TLS (run it behind the cluster's mesh or add an ``ssl_context``), persistence
of staged bytes across restarts (a restarted node starts empty and is refilled by its
parent), tombstones for deleted attempts, and moving back under a recovered parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import mmap
import os
import re
import shutil
import signal
import tempfile
from collections import Counter
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from dcr.errors import ConfigError, DcrError, ObjectNotFound, StoreError
from dcr.format.manifest import Manifest
from dcr.format.payload import PREAMBLE_SIZE, read_payload

log = logging.getLogger(__name__)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
ATTEMPT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # FORMAT.md's attempt id
MAX_ID = 2**31 - 1  # largest owner or seq (FORMAT.md)
Chunk = bytes | memoryview
Where = Literal["memory", "spool"]
Outcome = Literal["ok", "retry", "refused"]


# --- errors --------------------------------------------------------------------------


class RelayError(StoreError):
    """A relay request failed; ``status`` is the HTTP status, or None without a response."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RelayNotFound(RelayError, ObjectNotFound):
    """The relay holds no such payload or manifest."""


class _Refused(Exception):
    """Raised inside a handler; the middleware answers ``status`` with the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# --- tree math -----------------------------------------------------------------------


def parent_of(index: int, fanout: int) -> int | None:
    """The parent of member ``index`` in the balanced ``fanout``-ary tree; None for root."""
    return None if index == 0 else (index - 1) // fanout


def children_of(index: int, fanout: int, size: int) -> range:
    """Members ``fanout*index+1 .. fanout*index+fanout`` that exist among ``size``."""
    first = fanout * index + 1
    return range(min(first, size), min(first + fanout, size))


def ancestors_of(index: int, fanout: int) -> list[int]:
    """Parent, grandparent, ... up to the root, nearest first."""
    out: list[int] = []
    p = parent_of(index, fanout)
    while p is not None:
        out.append(p)
        p = parent_of(p, fanout)
    return out


def depth_of(index: int, fanout: int) -> int:
    """Hops from the root to member ``index``."""
    return len(ancestors_of(index, fanout))


def tree_depth(size: int, fanout: int) -> int:
    """Hops from the root to the deepest of ``size`` members."""
    return depth_of(size - 1, fanout) if size else 0


# --- settings ------------------------------------------------------------------------


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ConfigError names the value otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"Relay address {text!r} is not host:port.")
    return host, int(port)


@dataclass(frozen=True, kw_only=True)
class RelaySettings:
    """One relay node's settings. Units are in the names; why each default is what it is."""

    members: tuple[str, ...]  # every node's "host:port", tree order; member 0 is the root
    index: int  # this node's position in ``members``
    token: str = field(repr=False)  # bearer token on every endpoint but /healthz; never logged
    fanout: int = 2  # children per node: 2 keeps per-node upload fan-out at twice the input
    listen: str = "127.0.0.1:8470"  # host:port to bind; often 0.0.0.0 with a Service in front
    budget_bytes: int = GiB  # staged bytes held in memory: a few buckets of a large model
    spool_dir: Path | None = None  # staged bytes beyond the memory budget go here; None: never
    spool_budget_bytes: int = 64 * GiB  # staged bytes on disk: a whole attempt of a 70B model
    admit_timeout_s: float = 30.0  # an upload waits this long for staging space, then 503
    chunk_bytes: int = MiB  # piece size when sending staged bytes (live forwards keep theirs)
    queue_chunks: int = 16  # chunks queued per child: bounds a slow child's memory to a few MiB
    stall_timeout_s: float = 30.0  # a child taking (a sender giving) no bytes this long is cut
    connect_timeout_s: float = 2.0  # TCP connect to another member; loopback/LAN is fast
    health_interval_s: float = 0.25  # how often the parent is probed
    health_timeout_s: float = 0.5  # one probe's limit; a slower parent counts as down
    parent_timeout_s: float = 1.0  # parent down this long -> re-attach to an ancestor
    join_grace_s: float = 10.0  # at start, the time the parent may take to come up
    resync_interval_s: float = 10.0  # a child re-sends its held ids this often; gaps get filled
    retries: int = 4  # re-sends of a payload a child did not take (connection error or 5xx)
    retry_delay_s: float = 0.25  # first re-send delay; doubles each time (0.25 .. 2 s)
    max_manifest_bytes: int = 64 * MiB  # manifests are JSON; a bigger one is refused

    def __post_init__(self) -> None:
        n = len(self.members)
        if n == 0:
            raise ConfigError("Relay members list is empty.")
        for m in self.members:
            parse_address(m)
        if len(set(self.members)) != n:
            raise ConfigError(f"Relay members {list(self.members)} list an address twice.")
        if not 0 <= self.index < n:
            raise ConfigError(f"Relay index {self.index} is outside 0..{n - 1}.")
        if self.fanout < 1:
            raise ConfigError(f"Relay fan-out {self.fanout} must be at least 1.")
        if not self.token or any(c.isspace() for c in self.token):
            raise ConfigError("Relay token is empty or contains whitespace.")
        parse_address(self.listen)
        positive = {
            "budget_bytes": self.budget_bytes,
            "spool_budget_bytes": self.spool_budget_bytes,
            "admit_timeout_s": self.admit_timeout_s,
            "chunk_bytes": self.chunk_bytes,
            "queue_chunks": self.queue_chunks,
            "stall_timeout_s": self.stall_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "health_interval_s": self.health_interval_s,
            "health_timeout_s": self.health_timeout_s,
            "parent_timeout_s": self.parent_timeout_s,
            "join_grace_s": self.join_grace_s,
            "resync_interval_s": self.resync_interval_s,
            "max_manifest_bytes": self.max_manifest_bytes,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"Relay setting {name}={value} must be positive.")
        if self.retries < 0 or self.retry_delay_s < 0:
            raise ConfigError(
                f"Relay retries={self.retries} and retry_delay_s={self.retry_delay_s} "
                "must not be negative."
            )


# --- ids -----------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Key:
    """What a node stages: payload ``(attempt, owner, seq)`` or the manifest of ``attempt``."""

    attempt: str
    kind: Literal["payload", "manifest"]
    owner: int = 0
    seq: int = 0

    @property
    def path(self) -> str:
        if self.kind == "manifest":
            return f"/v1/manifests/{self.attempt}"
        return f"/v1/payloads/{self.attempt}/{self.owner}/{self.seq}"

    @property
    def label(self) -> str:
        if self.kind == "manifest":
            return f"manifest of attempt {self.attempt}"
        return f"payload {self.attempt}/o{self.owner}/s{self.seq}"


def _key_from(request: web.Request, kind: Literal["payload", "manifest"]) -> Key:
    info = request.match_info
    attempt = info["attempt"]
    if not ATTEMPT_RE.fullmatch(attempt):
        raise _Refused(400, f"Attempt id {attempt!r} does not match {ATTEMPT_RE.pattern}.")
    if kind == "manifest":
        return Key(attempt, "manifest")
    owner, seq = int(info["owner"]), int(info["seq"])
    if owner > MAX_ID or seq > MAX_ID:
        raise _Refused(400, f"Owner {owner} or seq {seq} is over {MAX_ID}.")
    return Key(attempt, "payload", owner, seq)


# --- staging -------------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class _Blob:
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
        self._blobs: dict[Key, _Blob] = {}
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def spool_budget_bytes(self) -> int:
        return self._spool_budget_bytes if self.spool_dir is not None else 0

    def get(self, key: Key) -> _Blob | None:
        return self._blobs.get(key)

    def blobs(self) -> list[_Blob]:
        return list(self._blobs.values())

    def staged(self, attempt: str | None = None) -> list[_Blob]:
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

    def begin(self, key: Key, size: int, where: Where) -> _Blob:
        """Register an arriving blob whose space is reserved."""
        assert key not in self._blobs, key
        blob = _Blob(key=key, size=size, where=where)
        if where == "memory":
            blob.buf = bytearray(size)
        else:
            assert self.spool_dir is not None
            fd, name = tempfile.mkstemp(dir=self.spool_dir, prefix=f"{key.attempt}.")
            blob.path = Path(name)
            blob.file = os.fdopen(fd, "wb")
        self._blobs[key] = blob
        return blob

    @staticmethod
    def write(blob: _Blob, chunk: Chunk) -> None:
        n = len(chunk)
        if blob.buf is not None:
            blob.buf[blob.received : blob.received + n] = chunk
        else:
            assert blob.file is not None
            blob.file.write(chunk)
        blob.received += n

    @staticmethod
    def finish_writing(blob: _Blob) -> None:
        if blob.file is not None:
            blob.file.close()
            blob.file = None

    def commit(self, blob: _Blob, digest: str) -> None:
        blob.digest, blob.state = digest, "staged"
        blob.done.set()

    def discard(self, blob: _Blob) -> None:
        """Forget a blob, free its space and wake uploads waiting for space."""
        if blob.state == "gone":
            return
        if self._blobs.get(blob.key) is blob:
            del self._blobs[blob.key]
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
def _view(blob: _Blob) -> Iterator[memoryview]:
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


def _verify(blob: _Blob) -> str:
    """Check a fully received blob and return its digest. Runs in a worker thread."""
    key = blob.key
    with _view(blob) as view:
        if key.kind == "payload":
            try:
                header = read_payload(view).header
            except DcrError as e:
                raise _Refused(400, f"{key.label}: {e}") from e
            got = (header.attempt, header.owner, header.seq)
            if got != (key.attempt, key.owner, key.seq):
                raise _Refused(
                    400,
                    f"{key.label}: the URL names it but its header says attempt "
                    f"{got[0]}, owner {got[1]}, seq {got[2]}.",
                )
        else:
            try:
                manifest = Manifest.parse(bytes(view), key.label)
            except DcrError as e:
                raise _Refused(400, str(e)) from e
            if manifest.attempt != key.attempt:
                raise _Refused(
                    400, f"{key.label}: the manifest is for attempt {manifest.attempt}."
                )
        return hashlib.blake2b(view, digest_size=16).hexdigest()


class _Pieces:
    """Bytes in memory as an async iterable of slices (no copies, no event-loop stall)."""

    def __init__(self, data: bytes | bytearray, chunk_bytes: int) -> None:
        self._view, self._chunk, self._offset = memoryview(data), chunk_bytes, 0

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> Chunk:
        if self._offset >= len(self._view):
            raise StopAsyncIteration
        piece = self._view[self._offset : self._offset + self._chunk]
        self._offset += len(piece)
        return piece


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


def _staged_body(blob: _Blob, chunk_bytes: int) -> AsyncIterable[Chunk]:
    """A staged blob's bytes; holds the buffer so a concurrent DELETE cannot pull it away."""
    if blob.buf is not None:
        return _Pieces(blob.buf, chunk_bytes)
    assert blob.path is not None
    return _SpoolPieces(blob.path, blob.size, chunk_bytes)


def _read_at(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        piece = f.read(n)
    if len(piece) != n:
        raise OSError(f"Spool file {path} ended before byte {offset + n}.")
    return piece


class _QueueChunks:
    """The body of one live forward: chunks taken from a bounded queue until ``None``."""

    def __init__(self, queue: asyncio.Queue[Chunk | None]) -> None:
        self._queue = queue

    def __aiter__(self) -> _QueueChunks:
        return self

    async def __anext__(self) -> Chunk:
        chunk = await self._queue.get()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


# --- client --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StagedPayload:
    """One payload a relay holds, as ``GET /v1/attempts/{attempt}/payloads`` lists it."""

    attempt: str
    owner: int
    seq: int
    size: int
    digest: str  # BLAKE2b-128 of the whole object, hex (the manifest's digest)


class RelayClient:
    """Talks to one relay node. Use ``async with RelayClient(url, token) as c: ...``.

    Every method raises :class:`RelayError` (with the HTTP status when there was an
    answer) and :class:`RelayNotFound` for 404. A shared ``session`` is not closed here.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        session: aiohttp.ClientSession | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = 60.0,  # per read; None for long quiet uploads
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {token}"}
        self._session = session
        self._owns_session = session is None
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )

    async def __aenter__(self) -> RelayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        *,
        data: bytes | AsyncIterable[Chunk] | None = None,
        size: int | None = None,
        json_body: Any = None,
        auth: bool = True,
        timeout_s: float | None = None,
    ) -> bytes:
        headers = dict(self._auth) if auth else {}
        if isinstance(data, bytes):
            size = len(data)
            data = _Pieces(data, MiB)
        if data is not None:
            headers["Content-Type"] = "application/octet-stream"
            headers["Content-Length"] = str(size)
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        url = self.base_url + path
        try:
            async with self._http().request(
                method, url, data=data, json=json_body, headers=headers, timeout=timeout
            ) as r:
                body = await r.read()
                status = r.status
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise RelayError(f"{method} {url} failed: {e or type(e).__name__}.") from e
        if status < 300:
            return body
        try:
            reason = str(json.loads(body)["error"])
        except (ValueError, KeyError, TypeError):
            reason = body[:200].decode(errors="replace")
        cls = RelayNotFound if status == 404 else RelayError
        raise cls(f"{method} {url} answered {status}: {reason}", status)

    async def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(await self._call(method, path, **kw))
        return out

    async def put_payload(
        self,
        attempt: str,
        owner: int,
        seq: int,
        data: bytes | AsyncIterable[Chunk],
        *,
        size: int | None = None,
    ) -> str:
        """Upload one payload; ``size`` is required when ``data`` is a stream.

        Returns ``"queued"`` (201) or ``"duplicate"`` (200, already held, not forwarded).
        """
        if not isinstance(data, bytes) and size is None:
            raise ConfigError("put_payload needs size= when data is a stream.")
        path = Key(attempt, "payload", owner, seq).path
        return str((await self._json("PUT", path, data=data, size=size))["status"])

    async def put_blob(self, key: Key, data: AsyncIterable[Chunk], size: int) -> str:
        """Upload a payload or manifest from a stream (what nodes use to forward)."""
        return str((await self._json("PUT", key.path, data=data, size=size))["status"])

    async def list_payloads(self, attempt: str) -> list[StagedPayload]:
        listing = await self._json("GET", f"/v1/attempts/{attempt}/payloads")
        return [StagedPayload(attempt=attempt, **p) for p in listing["payloads"]]

    async def get_payload(self, attempt: str, owner: int, seq: int) -> bytes:
        return await self._call("GET", Key(attempt, "payload", owner, seq).path)

    async def put_manifest(self, attempt: str, data: bytes) -> str:
        return str((await self._json("PUT", Key(attempt, "manifest").path, data=data))["status"])

    async def get_manifest(self, attempt: str) -> bytes:
        return await self._call("GET", Key(attempt, "manifest").path)

    async def delete_attempt(self, attempt: str) -> int:
        """Drop an attempt here and below; returns how many blobs this node dropped."""
        return int((await self._json("DELETE", f"/v1/attempts/{attempt}"))["dropped"])

    async def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /healthz`` (no token): state, parent, children and staged bytes."""
        return await self._json("GET", "/healthz", auth=False, timeout_s=timeout_s)

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: health plus counters and the blobs still arriving."""
        return await self._json("GET", "/v1/status")

    async def subscribe(
        self, index: int, held: dict[str, list[tuple[int, int]]], manifests: list[str]
    ) -> dict[str, Any]:
        """Ask this node to forward to member ``index`` and replay what it lacks."""
        body = {"index": index, "held": held, "manifests": manifests}
        return await self._json("POST", "/v1/subscribe", json_body=body)


# --- node ----------------------------------------------------------------------------


class _Subscription(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    held: dict[str, list[tuple[int, int]]] = {}
    manifests: list[str] = []


class _LiveForward:
    """One child's copy of an arriving blob: a bounded queue feeding a streaming PUT."""

    def __init__(self, node: RelayNode, child: int, blob: _Blob) -> None:
        self._queue: asyncio.Queue[Chunk | None] = asyncio.Queue(node.settings.queue_chunks)
        self._stall_s = node.settings.stall_timeout_s
        self._label = f"member {child}'s copy of {blob.key.label}"
        attempt = [blob.key.attempt]
        self.send = node._spawn(node._send(child, blob, _QueueChunks(self._queue)), child, attempt)
        self.settle = node._spawn(node._settle(child, blob, self.send), child, attempt)

    async def feed(self, chunk: Chunk | None) -> None:
        """Queue a chunk (``None`` ends the body); skip if the send has ended."""
        if self.send.done():
            return
        if not self._queue.full():
            self._queue.put_nowait(chunk)
            return
        put = asyncio.ensure_future(self._queue.put(chunk))
        try:
            done, _ = await asyncio.wait(
                {put, self.send}, timeout=self._stall_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            put.cancel()
        if not done:
            log.warning("%s took no bytes for %.0f s; it gets a re-send later",
                        self._label, self._stall_s)
            self.send.cancel()

    def abort(self) -> None:
        self.send.cancel()
        self.settle.cancel()


class RelayNode:
    """One member of the relay tree: an aiohttp server plus its forwarding tasks."""

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = s = settings
        self.index = s.index
        self.static_parent = parent_of(s.index, s.fanout)
        self.parent = self.static_parent  # the member we take bytes from now
        self.children: set[int] = set(children_of(s.index, s.fanout, len(s.members)))
        self.joined = self.static_parent is None  # subscribed to a parent at least once
        self.detached = False
        self.counters: Counter[str] = Counter()
        self.staging = Staging(
            budget_bytes=s.budget_bytes, spool_dir=None, spool_budget_bytes=s.spool_budget_bytes
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._inflight: dict[tuple[int, str], set[asyncio.Task[Any]]] = {}
        self._clients: dict[int, RelayClient] = {}
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._spool: Path | None = None

    # --- lifecycle ---

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * MiB)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/status", self._status)
        app.router.add_put(r"/v1/payloads/{attempt}/{owner:\d{1,10}}/{seq:\d{1,10}}",
                           self._put_payload)
        app.router.add_get(r"/v1/payloads/{attempt}/{owner:\d{1,10}}/{seq:\d{1,10}}",
                           self._get_payload)
        app.router.add_get("/v1/attempts/{attempt}/payloads", self._list)
        app.router.add_delete("/v1/attempts/{attempt}", self._delete)
        app.router.add_put("/v1/manifests/{attempt}", self._put_manifest)
        app.router.add_get("/v1/manifests/{attempt}", self._get_manifest)
        app.router.add_post("/v1/subscribe", self._subscribe)
        return app

    async def start(self) -> None:
        s = self.settings
        if s.spool_dir is not None:
            s.spool_dir.mkdir(parents=True, exist_ok=True)
            self._spool = Path(tempfile.mkdtemp(prefix=f"relay-{s.index}-", dir=s.spool_dir))
            self.staging.spool_dir = self._spool
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout_s)
        )
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        host, port = parse_address(s.listen)
        try:
            await web.TCPSite(self._runner, host, port, reuse_address=True).start()
        except OSError as e:
            await self.stop()
            raise ConfigError(f"Relay member {s.index} cannot listen on {s.listen}: {e}.") from e
        if self.static_parent is not None:
            self._spawn(self._watch_parent())
        log.info("relay member %d of %d listening on %s (parent %s, children %s, budget %d "
                 "bytes, spool %s)", s.index, len(s.members), s.listen, self.static_parent,
                 sorted(self.children), s.budget_bytes, self._spool)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
        log.info("relay member %d stopped", self.index)

    def _spawn(
        self, coro: Coroutine[Any, Any, Any], child: int | None = None,
        attempts: Iterable[str] = (),
    ) -> asyncio.Task[Any]:
        """Run a background task; with ``child``, count it as carrying those attempts there."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        keys = [(child, a) for a in attempts] if child is not None else []
        for k in keys:
            self._inflight.setdefault(k, set()).add(task)

        def _done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            for k in keys:
                group = self._inflight.get(k)
                if group is not None:
                    group.discard(t)
                    if not group:
                        del self._inflight[k]
            if not t.cancelled() and t.exception() is not None:
                log.error("relay task failed", exc_info=t.exception())

        task.add_done_callback(_done)
        return task

    def _client(self, member: int) -> RelayClient:
        if member not in self._clients:
            assert self._session is not None
            self._clients[member] = RelayClient(
                f"http://{self.settings.members[member]}", self.settings.token,
                session=self._session, connect_timeout_s=self.settings.connect_timeout_s,
                read_timeout_s=None,
            )
        return self._clients[member]

    # --- HTTP plumbing ---

    @web.middleware
    async def _middleware(
        self, request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        if request.path != "/healthz":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.settings.token}".encode()):
                self.counters["unauthorized"] += 1
                return web.json_response(
                    {"error": "missing or wrong bearer token"}, status=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        try:
            return await handler(request)
        except _Refused as e:
            return web.json_response({"error": str(e)}, status=e.status)

    def _health(self) -> dict[str, Any]:
        st = self.staging
        return {
            "status": "detached" if self.detached else "ok",
            "index": self.index,
            "parent": self.parent,
            "children": sorted(self.children),
            "joined": self.joined,
            "staged_bytes": st.memory_bytes + st.spool_bytes,
            "memory_bytes": st.memory_bytes,
            "spool_bytes": st.spool_bytes,
            "budget_bytes": st.budget_bytes,
            "spool_budget_bytes": st.spool_budget_bytes,
            "waiting": st.waiting,
            "incoming": sum(b.state == "incoming" for b in st.blobs()),
        }

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response(self._health())

    async def _status(self, request: web.Request) -> web.Response:
        arriving = [
            {"kind": b.key.kind, "attempt": b.key.attempt, "owner": b.key.owner,
             "seq": b.key.seq, "received": b.received, "size": b.size}
            for b in self.staging.blobs() if b.state == "incoming"
        ]
        return web.json_response(
            {**self._health(), "counters": dict(self.counters), "arriving": arriving}
        )

    # --- uploads ---

    async def _put_payload(self, request: web.Request) -> web.Response:
        return await self._receive(request, _key_from(request, "payload"))

    async def _put_manifest(self, request: web.Request) -> web.Response:
        return await self._receive(request, _key_from(request, "manifest"))

    async def _receive(self, request: web.Request, key: Key) -> web.Response:
        size = request.content_length
        if size is None:
            raise _Refused(411, f"{key.label}: the PUT needs a Content-Length.")
        if size < (PREAMBLE_SIZE if key.kind == "payload" else 1):
            raise _Refused(400, f"{key.label}: {size} bytes is too short.")
        too_big = key.kind == "manifest" and size > self.settings.max_manifest_bytes
        if too_big or not self.staging.can_ever_hold(size):
            raise _Refused(413, f"{key.label}: {size} bytes can never be staged here "
                                f"(budget {self.staging.budget_bytes} bytes in memory, "
                                f"{self.staging.spool_budget_bytes} on disk).")
        blob = await self._admit(key, size)
        if blob.state == "staged":
            return await self._duplicate(request, blob)
        live = key.kind == "payload"
        forwards = [_LiveForward(self, c, blob) for c in sorted(self.children)] if live else []
        self.counters["forwards_live"] += len(forwards)
        try:
            await self._stream_in(request, blob, forwards)
            digest = await asyncio.to_thread(_verify, blob)
            if blob.dropped:
                raise _Refused(410, f"{key.label}: its attempt was deleted while it arrived.")
        except _Refused as e:
            for f in forwards:
                f.abort()
            self.staging.discard(blob)
            self.counters["rejected"] += 1
            log.info("rejected %s (%d): %s", key.label, e.status, e)
            raise
        except BaseException as e:  # the sender went away or the node is stopping
            for f in forwards:
                f.abort()
            self.staging.discard(blob)
            self.counters["broken"] += 1
            log.info("upload of %s broke off after %d of %d bytes: %s",
                     key.label, blob.received, size, e or type(e).__name__)
            if isinstance(e, ConnectionError):
                return web.json_response({"error": "body broke off"}, status=400)
            raise
        self.staging.commit(blob, digest)
        self.counters["staged"] += 1
        log.debug("staged %s (%d bytes, %s)", key.label, size, blob.where)
        if not live:
            for c in sorted(self.children):
                self._spawn(self._deliver_manifest(c, blob))
        return web.json_response(
            {"status": "queued", "size": size, "digest": digest, "where": blob.where},
            status=201,
        )

    async def _admit(self, key: Key, size: int) -> _Blob:
        """The staged blob for ``key``, or a new arriving one with its space reserved."""
        deadline = asyncio.get_running_loop().time() + self.settings.admit_timeout_s
        while True:
            held = self.staging.get(key)
            if held is not None and held.state == "staged":
                return held
            try:
                async with asyncio.timeout_at(deadline):
                    if held is not None:
                        await held.done.wait()
                        continue
                    where = await self.staging.reserve(size, deadline)
            except TimeoutError:
                self.counters["busy"] += 1
                raise _Refused(
                    503, f"{key.label}: no staging space for {size} bytes within "
                         f"{self.settings.admit_timeout_s} s (budget {self.staging.budget_bytes} "
                         f"bytes in memory, {self.staging.spool_budget_bytes} on disk)."
                ) from None
            if self.staging.get(key) is None:
                return self.staging.begin(key, size, where)
            self.staging.release(where, size)  # the same id started meanwhile

    async def _stream_in(
        self, request: web.Request, blob: _Blob, forwards: list[_LiveForward]
    ) -> None:
        """Copy the body into staging and onto every child's queue as it arrives."""
        content = request.content
        while blob.received < blob.size:
            try:
                async with asyncio.timeout(self.settings.stall_timeout_s):
                    chunk = await content.readany()
            except TimeoutError:
                raise _Refused(408, f"{blob.key.label}: no bytes for "
                                    f"{self.settings.stall_timeout_s} s.") from None
            if not chunk:
                raise ConnectionResetError(f"body ended after {blob.received} bytes")
            self.staging.write(blob, chunk)
            for f in forwards:
                await f.feed(chunk)
            if blob.dropped:
                raise _Refused(410, f"{blob.key.label}: its attempt was deleted while it arrived.")
        self.staging.finish_writing(blob)
        for f in forwards:
            await f.feed(None)

    async def _duplicate(self, request: web.Request, blob: _Blob) -> web.Response:
        """A PUT of an id already held: 200 if the bytes are the same, else 409."""
        same_size = request.content_length == blob.size
        if same_size:
            h = hashlib.blake2b(digest_size=16)
            async for chunk in request.content.iter_any():
                h.update(chunk)
            same_size = h.hexdigest() == blob.digest
        if not same_size:
            self.counters["conflicts"] += 1
            raise _Refused(409, f"{blob.key.label} is already held with other bytes "
                                f"({blob.size} bytes, digest {blob.digest}).")
        self.counters["duplicates"] += 1
        return web.json_response({"status": "duplicate", "size": blob.size,
                                  "digest": blob.digest})

    # --- reads ---

    async def _get_payload(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, _key_from(request, "payload"))

    async def _get_manifest(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, _key_from(request, "manifest"))

    async def _serve(self, request: web.Request, key: Key) -> web.StreamResponse:
        blob = self.staging.get(key)
        if blob is None or blob.state != "staged":
            raise _Refused(404, f"No {key.label} is staged at member {self.index}.")
        ctype = "application/json" if key.kind == "manifest" else "application/octet-stream"
        headers = {"Content-Type": ctype, "X-Dcr-Digest": blob.digest}
        if blob.path is not None:
            return web.FileResponse(blob.path, headers=headers)
        body = _staged_body(blob, self.settings.chunk_bytes)
        resp = web.StreamResponse(headers=headers)
        resp.content_length = blob.size
        await resp.prepare(request)
        async for piece in body:
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def _list(self, request: web.Request) -> web.Response:
        attempt = request.match_info["attempt"]
        blobs = self.staging.staged(attempt)
        payloads = [
            {"owner": b.key.owner, "seq": b.key.seq, "size": b.size, "digest": b.digest}
            for b in blobs if b.key.kind == "payload"
        ]
        manifest = next(({"size": b.size, "digest": b.digest} for b in blobs
                         if b.key.kind == "manifest"), None)
        return web.json_response({"attempt": attempt, "payloads": payloads, "manifest": manifest})

    async def _delete(self, request: web.Request) -> web.Response:
        attempt = request.match_info["attempt"]
        dropped = self.staging.drop_attempt(attempt)
        for (_, a), tasks in list(self._inflight.items()):
            if a == attempt:
                for t in tasks:
                    t.cancel()
        for c in sorted(self.children):
            self._spawn(self._delete_at(c, attempt))
        log.info("dropped attempt %s (%d blobs)", attempt, dropped)
        return web.json_response({"dropped": dropped})

    async def _delete_at(self, child: int, attempt: str) -> None:
        try:
            await self._client(child).delete_attempt(attempt)
        except RelayError as e:
            log.warning("could not drop attempt %s at member %d: %s", attempt, child, e)

    # --- forwarding ---

    async def _send(self, child: int, blob: _Blob, body: AsyncIterable[Chunk]) -> Outcome:
        """One PUT of ``blob`` to ``child``; what to do next if it did not land."""
        self.counters["forwards"] += 1
        try:
            await self._client(child).put_blob(blob.key, body, blob.size)
        except RelayError as e:
            retry = e.status is None or e.status >= 500
            log.log(logging.INFO if retry else logging.WARNING,
                    "forward of %s to member %d failed: %s", blob.key.label, child, e)
            self.counters["forwards_failed"] += 1
            return "retry" if retry else "refused"
        except (OSError, ValueError) as e:  # e.g. the spool file vanished under a DELETE
            log.info("forward of %s to member %d failed: %s", blob.key.label, child, e)
            self.counters["forwards_failed"] += 1
            return "retry"
        self.counters["forwards_ok"] += 1
        return "ok"

    async def _settle(self, child: int, blob: _Blob, send: asyncio.Task[Outcome]) -> None:
        """After a live forward ends: re-send from staging if it did not land."""
        await asyncio.wait({send})
        if send.cancelled() or send.result() == "retry":
            await self._retry(child, blob)

    async def _retry(self, child: int, blob: _Blob) -> None:
        await blob.done.wait()
        delay = self.settings.retry_delay_s
        for _ in range(self.settings.retries):
            await asyncio.sleep(delay)
            delay *= 2
            if blob.state != "staged" or child not in self.children:
                return
            outcome = await self._send(child, blob, _staged_body(blob, self.settings.chunk_bytes))
            if outcome != "retry":
                return
        log.warning("gave up forwarding %s to member %d after %d re-sends",
                    blob.key.label, child, self.settings.retries)

    async def _deliver_staged(self, child: int, blob: _Blob) -> None:
        await blob.done.wait()
        if blob.state != "staged":
            return
        self.counters["replays"] += 1
        body = _staged_body(blob, self.settings.chunk_bytes)
        if await self._send(child, blob, body) == "retry":
            await self._retry(child, blob)

    async def _deliver_manifest(self, child: int, blob: _Blob) -> None:
        """Send a manifest once no payload of its attempt is on its way to ``child``."""
        await blob.done.wait()
        pending = self._inflight.get((child, blob.key.attempt))
        if pending:
            await asyncio.wait(set(pending))
        await self._deliver_staged(child, blob)

    async def _replay_payloads(self, child: int, blobs: list[_Blob]) -> None:
        for blob in blobs:
            await self._deliver_staged(child, blob)

    # --- membership ---

    def _held(self, arriving: bool) -> tuple[dict[str, list[tuple[int, int]]], list[str]]:
        """Ids staged here (with ``arriving``: or still arriving), as subscriptions list them."""
        held: dict[str, list[tuple[int, int]]] = {}
        manifests: list[str] = []
        for b in sorted(self.staging.blobs(), key=lambda b: b.key):
            if b.state == "gone" or (b.state == "incoming" and not arriving):
                continue
            if b.key.kind == "manifest":
                manifests.append(b.key.attempt)
            else:
                held.setdefault(b.key.attempt, []).append((b.key.owner, b.key.seq))
        return held, manifests

    async def _subscribe(self, request: web.Request) -> web.Response:
        try:
            sub = _Subscription.model_validate_json(await request.read())
        except ValidationError as e:
            raise _Refused(400, f"Subscription body is invalid: {e.errors()[0]['msg']}.") from e
        i, n = sub.index, len(self.settings.members)
        if not 0 <= i < n or self.index not in ancestors_of(i, self.settings.fanout):
            raise _Refused(400, f"Member {i} is not below member {self.index} in the tree "
                                f"of {n} members with fan-out {self.settings.fanout}.")
        adopted = i not in self.children
        if adopted:
            log.info("member %d adopted member %d", self.index, i)
            self.children.add(i)
        held = {Key(a, "payload", o, s) for a, ids in sub.held.items() for o, s in ids}
        held |= {Key(a, "manifest") for a in sub.manifests}
        lacking = sorted((b for b in self.staging.blobs()
                          if b.key not in held and b.state != "gone"), key=lambda b: b.key)
        by_attempt: dict[str, list[_Blob]] = {}
        for b in lacking:
            if b.key.kind == "payload":
                by_attempt.setdefault(b.key.attempt, []).append(b)
        for attempt, blobs in by_attempt.items():
            self._spawn(self._replay_payloads(i, blobs), i, [attempt])
        for m in lacking:
            if m.key.kind == "manifest":
                self._spawn(self._deliver_manifest(i, m))
        log.log(logging.INFO if lacking or adopted else logging.DEBUG,
                "member %d subscribed to member %d; replaying %d blobs", i, self.index,
                len(lacking))
        return web.json_response({"parent": self.index, "replaying": len(lacking)})

    async def _probe(self, member: int) -> bool:
        try:
            await self._client(member).health(timeout_s=self.settings.health_timeout_s)
        except RelayError:
            return False
        return True

    async def _join(self, member: int, *, arriving: bool = False) -> bool:
        """Subscribe to ``member``. ``arriving``: count blobs still arriving as held (a resync
        with a live parent); after a failure they are not, since they may never complete."""
        held, manifests = self._held(arriving)
        try:
            await self._client(member).subscribe(self.index, held, manifests)
        except RelayError as e:
            log.info("member %d could not subscribe to member %d: %s", self.index, member, e)
            return False
        return True

    async def _watch_parent(self) -> None:
        """Probe the parent; when it is gone too long, re-attach to the nearest live ancestor."""
        s = self.settings
        loop = asyncio.get_running_loop()
        started = loop.time()
        last_ok: float | None = None
        last_sync = started
        while True:
            await asyncio.sleep(s.health_interval_s)
            if self.parent is not None and await self._probe(self.parent):
                last_ok = loop.time()
                if not self.joined:
                    self.joined = await self._join(self.parent)
                    last_sync = loop.time()
                elif last_ok - last_sync >= s.resync_interval_s:
                    await self._join(self.parent, arriving=True)
                    last_sync = loop.time()
                continue
            if self.parent is not None:
                since, limit = (started, s.join_grace_s) if last_ok is None else (
                    last_ok, s.parent_timeout_s)
                if loop.time() - since <= limit:
                    continue
            if await self._reattach():
                last_ok = loop.time()

    async def _reattach(self) -> bool:
        gone = self.parent
        for candidate in ancestors_of(self.index, self.settings.fanout):
            if candidate != gone and await self._probe(candidate) and await self._join(candidate):
                log.info("member %d: parent %s unreachable; re-attached to member %d",
                         self.index, gone, candidate)
                self.parent, self.detached, self.joined = candidate, False, True
                return True
        if not self.detached:
            log.warning("member %d: no ancestor of %s reachable; detached",
                        self.index, ancestors_of(self.index, self.settings.fanout))
            self.parent, self.detached = None, True
        return False


# --- process -------------------------------------------------------------------------


async def serve(settings: RelaySettings, stop: asyncio.Event | None = None) -> None:
    """Run one node until ``stop`` is set (by default: until SIGTERM or SIGINT)."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    node = RelayNode(settings)
    await node.start()
    try:
        await stop.wait()
    finally:
        await node.stop()


def run_relay(settings: RelaySettings) -> None:
    """The ``dcr relay`` entry point: serve until SIGTERM."""
    asyncio.run(serve(settings))


__all__ = [
    "Key",
    "RelayClient",
    "RelayError",
    "RelayNode",
    "RelayNotFound",
    "RelaySettings",
    "StagedPayload",
    "Staging",
    "ancestors_of",
    "children_of",
    "depth_of",
    "parent_of",
    "parse_address",
    "run_relay",
    "serve",
    "tree_depth",
]
