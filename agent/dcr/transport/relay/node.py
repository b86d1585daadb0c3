"""One member of the relay tree, an aiohttp server, and the ``dcr relay`` entry point.

The design and the endpoints: docs/relay.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import shutil
import signal
import tempfile
from collections import Counter
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr.errors import ConfigError, RelayError
from dcr.format.names import ATTEMPT_PATTERN, object_hasher
from dcr.format.payload import PREAMBLE_SIZE
from dcr.http.edge import Listening, Statuses, answer_errors, json_error, start, unauthorized
from dcr.http.tls import TlsSettings
from dcr.http.tokens import bearer_matches
from dcr.transport.relay.client import RelayClient
from dcr.transport.relay.settings import MiB, RelaySettings
from dcr.transport.relay.staging import Blob, Staging, staged_body, verify
from dcr.transport.relay.tree import ancestors_of, children_of, parent_of
from dcr.transport.relay.wire import (
    MAX_LIST_WAIT_S,
    WIRE,
    WIRE_HEADER,
    Chunk,
    Key,
    QueueChunks,
    RelayRefused,
    attempt_from,
    key_from,
)
from dcr.versions import RELAY_WIRE

log = logging.getLogger(__package__)  # "dcr.transport.relay": one logger for the tree

Outcome = Literal["ok", "retry", "refused"]
Role = Literal["read", "publish"]
WRITES = frozenset({"PUT", "DELETE", "POST"})  # push, drop, subscribe: the publish token
_Attempt = Annotated[str, Field(pattern=ATTEMPT_PATTERN)]
_TAG = re.compile(r"[0-9a-f]{1,64}")
EVICTED_REMEMBERED = 1024  # evicted attempt ids a node refuses again (about 16 bytes each)
# A RelayRefused answers its own status; any other error is aiohttp's 500.
STATUS = Statuses(otherwise=None)


class _Subscription(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    wire: int  # the subscriber's relay wire; refused unless it is this node's
    index: int
    held: dict[_Attempt, list[tuple[int, int]]] = {}
    manifests: dict[_Attempt, list[int]] = {}  # attempt -> owners whose part is held


class _LiveForward:
    """One child's copy of an arriving blob: a bounded queue feeding a streaming PUT."""

    def __init__(self, node: RelayNode, child: int, blob: Blob) -> None:
        self._queue: asyncio.Queue[Chunk | None] = asyncio.Queue(node.settings.queue_chunks)
        self._stall_s = node.settings.stall_timeout_s
        self._label = f"member {child}'s copy of {blob.key.label}"
        attempt = [blob.key.attempt]
        self.send = node._spawn(node._send(child, blob, QueueChunks(self._queue)), child, attempt)
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
        self._server: Listening | None = None
        self._spool: Path | None = None
        self._change = asyncio.Event()  # set (and replaced) whenever a blob is staged
        self._reading: Counter[str] = Counter()  # attempt -> responses sending its bytes
        # attempts evicted here, newest last (bounded), with the ids they held: a
        # subscription claims those as held, so the parent does not offer them again
        self._evicted: dict[str, list[Key]] = {}

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
        app.router.add_put(r"/v1/manifests/{attempt}/{owner:\d{1,10}}", self._put_manifest)
        app.router.add_get(r"/v1/manifests/{attempt}/{owner:\d{1,10}}", self._get_manifest)
        app.router.add_route("*", "/v1/manifests/{attempt}", _wire1_manifest)
        app.router.add_post("/v1/subscribe", self._subscribe)
        app.on_response_prepare.append(_say_wire)
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
        try:
            self._server = await start(self.app(), s.listen, f"Relay member {s.index}",
                                       handler_cancellation=False, shutdown_timeout=1.0,
                                       reuse_address=True)
        except ConfigError:
            await self.stop()
            raise
        if self.static_parent is not None:
            self._spawn(self._watch_parent())
        log.info("relay member %d of %d listening on %s (parent %s, children %s, budget %d "
                 "bytes, spool %s)", s.index, len(s.members), s.listen, self.static_parent,
                 sorted(self.children), s.budget_bytes, self._spool)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.close()
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
            self._clients[member] = RelayClient(  # members forward: a push, so publish
                f"{TlsSettings.from_env().scheme}://{self.settings.members[member]}",
                self.settings.publish_token,
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
            role = self._role(request.headers.get("Authorization"))
            if role is None:
                self.counters["unauthorized"] += 1
                return unauthorized()
            if request.method in WRITES and role != "publish":
                self.counters["forbidden"] += 1
                return json_error(403, "the read token cannot push, delete or subscribe; "
                                  "that takes the publish token", "Forbidden")
        return await answer_errors(request, handler, STATUS)

    def _role(self, header: str | None) -> Role | None:
        """What an ``Authorization`` header may do: publish (also read), read, or nothing."""
        if bearer_matches(header, self.settings.publish_token):
            return "publish"
        if bearer_matches(header, self.settings.token):
            return "read"
        return None

    def _health(self) -> dict[str, Any]:
        st = self.staging
        return {
            "status": "detached" if self.detached else "ok",
            "wire": WIRE,
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
        attempts: Counter[str] = Counter()
        for b in self.staging.staged():
            attempts[b.key.attempt] += b.size
        return web.json_response(
            {**self._health(), "counters": dict(self.counters), "arriving": arriving,
             "attempts": dict(sorted(attempts.items()))}
        )

    # --- uploads ---

    async def _put_payload(self, request: web.Request) -> web.Response:
        return await self._receive(request, key_from(request, "payload"))

    async def _put_manifest(self, request: web.Request) -> web.Response:
        return await self._receive(request, key_from(request, "manifest"))

    async def _receive(self, request: web.Request, key: Key) -> web.Response:
        size = request.content_length
        if size is None:
            raise RelayRefused(411, f"{key.label}: the PUT needs a Content-Length.")
        if size < (PREAMBLE_SIZE if key.kind == "payload" else 1):
            raise RelayRefused(400, f"{key.label}: {size} bytes is too short.")
        too_big = key.kind == "manifest" and size > self.settings.max_manifest_bytes
        if too_big or not self.staging.can_ever_hold(size):
            raise RelayRefused(413, f"{key.label}: {size} bytes can never be staged here "
                                f"(budget {self.staging.budget_bytes} bytes in memory, "
                                f"{self.staging.spool_budget_bytes} on disk).")
        if key.attempt in self._evicted:
            self.counters["refused_evicted"] += 1
            raise RelayRefused(410, f"{key.label}: its attempt was evicted here, a newer one "
                                    f"arrived past keep_attempts={self.settings.keep_attempts}.")
        self._evict_for(key.attempt)
        blob = await self._admit(key, size)
        if blob.state == "staged":
            return await self._duplicate(request, blob)
        live = key.kind == "payload"
        forwards = [_LiveForward(self, c, blob) for c in sorted(self.children)] if live else []
        self.counters["forwards_live"] += len(forwards)
        try:
            await self._stream_in(request, blob, forwards)
            digest = await asyncio.to_thread(verify, blob)
            if blob.dropped:
                raise RelayRefused(410, f"{key.label}: its attempt was deleted while it arrived.")
        except RelayRefused as e:
            for f in forwards:
                f.abort()
            self.staging.discard(blob)
            self.counters["rejected"] += 1
            log.info("rejected %s (%d): %r", key.label, e.status, str(e))
            raise
        except BaseException as e:  # the sender went away or the node is stopping
            for f in forwards:
                f.abort()
            self.staging.discard(blob)
            self.counters["broken"] += 1
            log.info("upload of %s broke off after %d of %d bytes: %r",
                     key.label, blob.received, size, str(e) or type(e).__name__)
            if isinstance(e, ConnectionError):
                return json_error(400, "body broke off", "BrokenBody")
            raise
        self.staging.commit(blob, digest)
        self._change.set()  # wake listings waiting for a change
        self._change = asyncio.Event()
        self.counters["staged"] += 1
        log.debug("staged %s (%d bytes, %s)", key.label, size, blob.where)
        if not live:
            for c in sorted(self.children):
                self._spawn(self._deliver_manifest(c, blob))
        return web.json_response(
            {"status": "queued", "size": size, "digest": digest, "where": blob.where},
            status=201,
        )

    async def _admit(self, key: Key, size: int) -> Blob:
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
                raise RelayRefused(
                    503, f"{key.label}: no staging space for {size} bytes within "
                         f"{self.settings.admit_timeout_s} s (budget {self.staging.budget_bytes} "
                         f"bytes in memory, {self.staging.spool_budget_bytes} on disk)."
                ) from None
            if self.staging.get(key) is None:
                return self.staging.begin(key, size, where)
            self.staging.release(where, size)  # the same id started meanwhile

    async def _stream_in(
        self, request: web.Request, blob: Blob, forwards: list[_LiveForward]
    ) -> None:
        """Copy the body into staging and onto every child's queue as it arrives.

        Two clocks: ``stall_timeout_s`` without a byte, and a deadline for the whole body
        (:meth:`_upload_s`), so a sender trickling bytes cannot hold its budget for long.
        """
        content, s = request.content, self.settings
        allowed_s = self._upload_s(blob.size, len(forwards))
        try:
            async with asyncio.timeout(allowed_s):
                while blob.received < blob.size:
                    try:
                        async with asyncio.timeout(s.stall_timeout_s):
                            chunk = await content.readany()
                    except TimeoutError:
                        raise RelayRefused(408, f"{blob.key.label}: no bytes for "
                                           f"{s.stall_timeout_s} s.") from None
                    if not chunk:
                        raise ConnectionResetError(f"body ended after {blob.received} bytes")
                    self.staging.write(blob, chunk)
                    for f in forwards:
                        await f.feed(chunk)
                    if blob.dropped:
                        raise RelayRefused(410, f"{blob.key.label}: its attempt was deleted while "
                                           "it arrived.")
        except TimeoutError:
            self.counters["too_slow"] += 1
            raise RelayRefused(408, f"{blob.key.label}: {blob.received} of {blob.size} bytes in "
                               f"{allowed_s:.1f} s, slower than the minimum of "
                               f"{s.min_upload_bytes_per_s} bytes/s.") from None
        self.staging.finish_writing(blob)
        for f in forwards:
            await f.feed(None)

    def _upload_s(self, size: int, children: int) -> float:
        """Seconds an upload of ``size`` bytes may take: at the minimum rate, plus one
        stall for the sender and one for each child a live copy may wait on."""
        s = self.settings
        return size / s.min_upload_bytes_per_s + s.stall_timeout_s * (1 + children)

    async def _duplicate(self, request: web.Request, blob: Blob) -> web.Response:
        """A PUT of an id already held: 200 if the bytes are the same, else 409."""
        same_size = request.content_length == blob.size
        if same_size:
            h = object_hasher()
            async for chunk in request.content.iter_any():
                h.update(chunk)
            same_size = h.hexdigest() == blob.digest
        if not same_size:
            self.counters["conflicts"] += 1
            log.warning("refused %s: already held with other bytes (%d bytes, digest %s); the "
                        "first upload stays, receivers check it against the manifest",
                        blob.key.label, blob.size, blob.digest)
            raise RelayRefused(409, f"{blob.key.label} is already held with other bytes "
                                f"({blob.size} bytes, digest {blob.digest}).")
        self.counters["duplicates"] += 1
        return web.json_response({"status": "duplicate", "size": blob.size,
                                  "digest": blob.digest})

    # --- reads ---

    async def _get_payload(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, key_from(request, "payload"))

    async def _get_manifest(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, key_from(request, "manifest"))

    async def _serve(self, request: web.Request, key: Key) -> web.StreamResponse:
        self._reading[key.attempt] += 1
        try:
            return await self._send_staged(request, key)
        finally:
            self._reading[key.attempt] -= 1
            if not self._reading[key.attempt]:
                del self._reading[key.attempt]

    async def _send_staged(self, request: web.Request, key: Key) -> web.StreamResponse:
        blob = self.staging.get(key)
        if blob is None or blob.state != "staged":
            raise RelayRefused(404, f"No {key.label} is staged at member {self.index}.")
        headers = {"Content-Type": "application/octet-stream", "X-Dcr-Digest": blob.digest}
        if blob.path is not None:
            return web.FileResponse(blob.path, headers=headers)
        body = staged_body(blob, self.settings.chunk_bytes)
        resp = web.StreamResponse(headers=headers)
        resp.content_length = blob.size
        await resp.prepare(request)
        async for piece in body:
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def _list(self, request: web.Request) -> web.Response:
        """An attempt's staged payloads and manifest; with ``wait_s``, a long poll that
        answers once the listing's tag differs from ``known`` (a receiver waiting for the
        next payload asks once instead of polling)."""
        attempt = attempt_from(request)
        wait_s, known = _long_poll(request)
        listing = self._listing(attempt)
        if wait_s > 0 and listing["tag"] == known:
            self.counters["list_waits"] += 1
            change = self._change
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(change.wait(), wait_s)
            listing = self._listing(attempt)
        return web.json_response(listing)

    def _listing(self, attempt: str) -> dict[str, Any]:
        blobs = self.staging.staged(attempt)
        payloads = [
            {"owner": b.key.owner, "seq": b.key.seq, "size": b.size, "digest": b.digest}
            for b in blobs if b.key.kind == "payload"
        ]
        manifests = [{"owner": b.key.owner, "size": b.size, "digest": b.digest}
                     for b in blobs if b.key.kind == "manifest"]
        tag = hashlib.blake2b(json.dumps([payloads, manifests], sort_keys=True).encode(),
                              digest_size=8).hexdigest()
        return {"wire": WIRE, "attempt": attempt, "payloads": payloads, "manifests": manifests,
                "tag": tag}

    async def _delete(self, request: web.Request) -> web.Response:
        attempt = attempt_from(request)
        dropped = self.staging.drop_attempt(attempt)
        for (_, a), tasks in list(self._inflight.items()):
            if a == attempt:
                for t in tasks:
                    t.cancel()
        for c in sorted(self.children):
            self._spawn(self._delete_at(c, attempt))
        log.info("dropped attempt %r (%d blobs)", attempt, dropped)
        return web.json_response({"dropped": dropped})

    def _evict_for(self, attempt: str) -> None:
        """Before the first blob of ``attempt``: evict the oldest attempts held until it
        makes ``keep_attempts``, skipping any still in use (:meth:`_in_use`). An evicted
        attempt is refused here from then on (410) and claimed as held when this node
        subscribes, so a parent's replay cannot bring it back and push out another."""
        held = self.staging.attempts()
        if attempt in held:
            return
        excess = len(held) + 1 - self.settings.keep_attempts
        for old in held:
            if excess <= 0:
                return
            if self._in_use(old):
                continue
            keys = [b.key for b in self.staging.blobs() if b.key.attempt == old]
            dropped = self.staging.drop_attempt(old)
            self._evicted[old] = keys
            while len(self._evicted) > EVICTED_REMEMBERED:
                del self._evicted[next(iter(self._evicted))]
            excess -= 1
            self.counters["evicted"] += 1
            log.info("evicted attempt %r (%d blobs): %r arrived past keep_attempts=%d",
                     old, dropped, attempt, self.settings.keep_attempts)

    def _in_use(self, attempt: str) -> bool:
        """Whether a receiver is reading ``attempt`` here, or a blob of it is arriving or
        on its way to a child."""
        return attempt in self._reading or any(a == attempt for _, a in self._inflight) \
            or any(b.state == "incoming" for b in self.staging.blobs()
                   if b.key.attempt == attempt)

    async def _delete_at(self, child: int, attempt: str) -> None:
        try:
            await self._client(child).delete_attempt(attempt)
        except RelayError as e:
            log.warning("could not drop attempt %r at member %d: %r", attempt, child, str(e))

    # --- forwarding ---

    async def _send(self, child: int, blob: Blob, body: AsyncIterable[Chunk]) -> Outcome:
        """One PUT of ``blob`` to ``child``; what to do next if it did not land."""
        self.counters["forwards"] += 1
        try:
            await self._client(child).put_blob(blob.key, body, blob.size)
        except RelayError as e:
            retry = e.status is None or e.status >= 500
            log.log(logging.INFO if retry else logging.WARNING,
                    "forward of %s to member %d failed: %r", blob.key.label, child, str(e))
            self.counters["forwards_failed"] += 1
            return "retry" if retry else "refused"
        except (OSError, ValueError) as e:  # e.g. the spool file vanished under a DELETE
            log.info("forward of %s to member %d failed: %r", blob.key.label, child, str(e))
            self.counters["forwards_failed"] += 1
            return "retry"
        self.counters["forwards_ok"] += 1
        return "ok"

    async def _settle(self, child: int, blob: Blob, send: asyncio.Task[Outcome]) -> None:
        """After a live forward ends: re-send from staging if it did not land."""
        await asyncio.wait({send})
        if send.cancelled() or send.result() == "retry":
            await self._retry(child, blob)

    async def _retry(self, child: int, blob: Blob) -> None:
        await blob.done.wait()
        delay = self.settings.retry_delay_s
        for _ in range(self.settings.retries):
            await asyncio.sleep(delay)
            delay *= 2
            if blob.state != "staged" or child not in self.children:
                return
            outcome = await self._send(child, blob, staged_body(blob, self.settings.chunk_bytes))
            if outcome != "retry":
                return
        log.warning("gave up forwarding %s to member %d after %d re-sends",
                    blob.key.label, child, self.settings.retries)

    async def _deliver_staged(self, child: int, blob: Blob) -> None:
        await blob.done.wait()
        if blob.state != "staged":
            return
        self.counters["replays"] += 1
        body = staged_body(blob, self.settings.chunk_bytes)
        if await self._send(child, blob, body) == "retry":
            await self._retry(child, blob)

    async def _deliver_manifest(self, child: int, blob: Blob) -> None:
        """Send a manifest once no payload of its attempt is on its way to ``child``."""
        await blob.done.wait()
        pending = self._inflight.get((child, blob.key.attempt))
        if pending:
            await asyncio.wait(set(pending))
        await self._deliver_staged(child, blob)

    async def _replay_payloads(self, child: int, blobs: list[Blob]) -> None:
        for blob in blobs:
            await self._deliver_staged(child, blob)

    # --- membership ---

    def _held(self, arriving: bool) -> tuple[dict[str, list[tuple[int, int]]],
                                             dict[str, list[int]]]:
        """Ids staged here (with ``arriving``: or still arriving), as subscriptions list them."""
        held: dict[str, list[tuple[int, int]]] = {}
        manifests: dict[str, list[int]] = {}
        keys = [b.key for b in self.staging.blobs()
                if b.state == "staged" or (b.state == "incoming" and arriving)]
        keys += [k for evicted in self._evicted.values() for k in evicted]
        for k in sorted(set(keys)):
            if k.kind == "manifest":
                manifests.setdefault(k.attempt, []).append(k.owner)
            else:
                held.setdefault(k.attempt, []).append((k.owner, k.seq))
        return held, manifests

    async def _subscribe(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            wire = json.loads(body).get("wire", 1)  # a subscription without it is wire 1
        except (ValueError, AttributeError):
            wire = None
        RELAY_WIRE.check("The subscriber", wire, lambda m: RelayRefused(400, m))
        try:
            sub = _Subscription.model_validate_json(body)
        except ValidationError as e:
            raise RelayRefused(400, f"Subscription body is invalid: {e.errors()[0]['msg']}.") from e
        i, n = sub.index, len(self.settings.members)
        if not 0 <= i < n or self.index not in ancestors_of(i, self.settings.fanout):
            raise RelayRefused(400, f"Member {i} is not below member {self.index} in the tree "
                                f"of {n} members with fan-out {self.settings.fanout}.")
        adopted = i not in self.children
        self.counters["subscriptions"] += 1
        if adopted:
            log.info("member %d adopted member %d", self.index, i)
            self.children.add(i)
        held = {Key(a, "payload", o, s) for a, ids in sub.held.items() for o, s in ids}
        held |= {Key(a, "manifest", o) for a, owners in sub.manifests.items() for o in owners}
        lacking = sorted((b for b in self.staging.blobs()
                          if b.key not in held and b.state != "gone"), key=lambda b: b.key)
        by_attempt: dict[str, list[Blob]] = {}
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
            log.info("member %d could not subscribe to member %d: %r", self.index, member,
                     str(e))
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


async def _wire1_manifest(request: web.Request) -> web.Response:
    """The wire-1 spelling of a manifest (one per attempt): refused naming both wires, so
    an older client or member never takes one owner's part for a whole manifest."""
    raise RelayRefused(410, f"This relay speaks wire {WIRE}: a manifest is one owner's part, "
                            f"at /v1/manifests/{{attempt}}/{{owner}}; the client speaks wire 1.")


async def _say_wire(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[WIRE_HEADER] = str(WIRE)


def _long_poll(request: web.Request) -> tuple[float, str | None]:
    """A listing request's ``wait_s`` (0 when absent) and ``known`` tag; 400 naming the
    value if either is malformed."""
    raw, known = request.query.get("wait_s"), request.query.get("known")
    wait_s = 0.0
    if raw is not None:
        try:
            wait_s = float(raw)
        except ValueError:
            wait_s = -1.0
        if not 0 <= wait_s <= MAX_LIST_WAIT_S:
            raise RelayRefused(400, f"wait_s {raw[:40]!r} is not a number of seconds from 0 to "
                               f"{MAX_LIST_WAIT_S:g}.")
    if known is not None and not _TAG.fullmatch(known):
        raise RelayRefused(400, f"known {known[:80]!r} is not a listing tag (1-64 hex digits).")
    return wait_s, known
