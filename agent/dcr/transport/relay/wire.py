"""What members say to each other: ids and their URLs, request refusals, body streams.

A handler refuses a request by raising :class:`RelayRefused` with the HTTP status. Ids come
from URLs a client spells: :func:`attempt_from` and :func:`key_from` check them before
anything uses or logs them. :data:`WIRE` is the wire's version: every answer carries it in
:data:`WIRE_HEADER`, subscriptions must name it, and what an older member or client asks
in a spelling it no longer has is refused naming both versions (docs/relay.md, "Endpoints").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from aiohttp import web

from dcr.errors import Refused
from dcr.format.layout import MAX_OWNERS
from dcr.format.names import ATTEMPT_RE
from dcr.versions import RELAY_WIRE

MAX_ID = 2**31 - 1  # largest owner or seq (FORMAT.md)
# The relay wire's version. 2: a manifest is one owner's part, at /v1/manifests/{attempt}/{owner}
# (1 carried one manifest per attempt at /v1/manifests/{attempt}, so one owner per attempt).
WIRE = RELAY_WIRE.writes  # 2, declared with every other wire in dcr.versions
WIRE_HEADER = RELAY_WIRE.header
Chunk = bytes | memoryview


class RelayRefused(Refused):
    """Raised inside a handler; the middleware answers ``status`` with the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, order=True)
class Key:
    """What a node stages: payload ``(attempt, owner, seq)`` or owner ``owner``'s part of
    the manifest of ``attempt``."""

    attempt: str
    kind: Literal["payload", "manifest"]
    owner: int = 0
    seq: int = 0

    @property
    def path(self) -> str:
        if self.kind == "manifest":
            return f"/v1/manifests/{self.attempt}/{self.owner}"
        return f"/v1/payloads/{self.attempt}/{self.owner}/{self.seq}"

    @property
    def label(self) -> str:
        if self.kind == "manifest":
            return f"manifest part o{self.owner} of attempt {self.attempt}"
        return f"payload {self.attempt}/o{self.owner}/s{self.seq}"


MAX_LIST_WAIT_S = 5.0  # the longest a listing request may wait for a change (a long poll)


def attempt_from(request: web.Request) -> str:
    """The URL's attempt id, checked; 400 (the id quoted with ``repr``) otherwise."""
    attempt = request.match_info["attempt"]
    if not ATTEMPT_RE.fullmatch(attempt):
        raise RelayRefused(400, f"Attempt id {attempt!r} does not match {ATTEMPT_RE.pattern}.")
    return attempt


def key_from(request: web.Request, kind: Literal["payload", "manifest"]) -> Key:
    info = request.match_info
    attempt = attempt_from(request)
    owner, seq = int(info["owner"]), int(info.get("seq", "0"))
    if owner > MAX_ID or seq > MAX_ID:
        raise RelayRefused(400, f"Owner {owner} or seq {seq} is over {MAX_ID}.")
    if kind == "manifest" and owner >= MAX_OWNERS:
        raise RelayRefused(400, f"Manifest part of owner {owner}: an attempt has at most "
                                f"{MAX_OWNERS} owners.")
    return Key(attempt, kind, owner, seq if kind == "payload" else 0)


class Pieces:
    """Bytes in memory as an async iterable of slices (no copies, no event-loop stall)."""

    def __init__(self, data: bytes | bytearray, chunk_bytes: int) -> None:
        self._view, self._chunk, self._offset = memoryview(data), chunk_bytes, 0

    def __aiter__(self) -> Pieces:
        return self

    async def __anext__(self) -> Chunk:
        if self._offset >= len(self._view):
            raise StopAsyncIteration
        piece = self._view[self._offset : self._offset + self._chunk]
        self._offset += len(piece)
        return piece


class QueueChunks:
    """The body of one live forward: chunks taken from a bounded queue until ``None``."""

    def __init__(self, queue: asyncio.Queue[Chunk | None]) -> None:
        self._queue = queue

    def __aiter__(self) -> QueueChunks:
        return self

    async def __anext__(self) -> Chunk:
        chunk = await self._queue.get()
        if chunk is None:
            raise StopAsyncIteration
        return chunk
