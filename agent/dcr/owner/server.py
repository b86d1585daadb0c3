"""``dcr encoder``: a warm owner, a long-running HTTP endpoint that publishes attempts.

``POST /v1/publish`` (:mod:`dcr.protocol.encoder_api`) runs in process what ``dcr encode``
runs for the same arguments (:func:`publish_settings`) and answers its summary. A request
cannot name the store and reads only checkpoints that resolve under a ``--checkpoint-root``;
a stop ends an attempt's publishes before their manifest part. Stops run on a pool of their
own, never queued behind the publishes they end. docs/publishing.md, "Warm encoder".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from pydantic import ValidationError

from dcr.checkpoint import Checkpoint
from dcr.errors import (
    Busy,
    CheckpointError,
    ConfigError,
    Invalid,
    StateConflict,
    first_validation_error,
)
from dcr.format.history import RankPart
from dcr.format.manifest import Manifest
from dcr.http.edge import Listening, Statuses, guard, start
from dcr.http.tokens import read_token
from dcr.owner.diff import diff_checkpoints, encode_summary
from dcr.owner.settings import EncodeSettings
from dcr.protocol.encoder_api import (
    MAX_BODY_BYTES,
    PublishRequest,
    SnapshotRequest,
    StopAnswer,
    StopRequest,
)
from dcr.settings import MiB, option
from dcr.transport.store import Store, open_store
from dcr.versions import ENCODER_API

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz"})
DISCONNECT_POLL_S = 0.2  # how often a publish looks whether its caller is still there
_STOPPED_KEPT = 4096  # attempts remembered as stopped (a late publish of one is refused)


@dataclass(frozen=True, kw_only=True)
class EncoderServerSettings:
    """``dcr encoder``'s options."""

    listen: str = option("127.0.0.1:8472", metavar="HOST:PORT", doc="address to listen on "
                         "(0.0.0.0:8472 in a pod; port 0 picks a free one)")
    token_file: Path = option(metavar="PATH", doc="file holding the bearer token callers "
                              "must present (16+ printable characters)")
    store: str = option(doc="where every publish writes (s3://bucket/prefix, file:///path "
                        "or relay+http://root); fixed here, never taken from a request")
    checkpoint_root: tuple[str, ...] = option(metavar="DIR", doc="directory the checkpoints "
                                              "of a request must lie under (symlinks "
                                              "resolved); repeatable")
    threads: int | None = option(EncodeSettings.threads, metavar="N", doc="diff threads per "
                                 "publish (numpy and zstd release the GIL); default: the "
                                 "cores this process may use")
    max_publishes: int = option(4, metavar="N", doc="publishes running at once (one per "
                                "owner of an attempt served here); one more is answered 503")
    stop_wait_s: float = option(120.0, metavar="S", doc="seconds a stop waits for the "
                                "attempt's publishes to end (each ends at its next item)")

    def __post_init__(self) -> None:
        if not self.checkpoint_root:
            raise ConfigError("dcr encoder needs at least one --checkpoint-root.")
        if (self.threads is not None and self.threads < 1) or self.max_publishes < 1 \
                or self.stop_wait_s <= 0:
            raise ConfigError(f"threads ({self.threads}), max_publishes "
                              f"({self.max_publishes}) and stop_wait_s ({self.stop_wait_s}) "
                              "must be positive.")


class BadPublish(Invalid):
    """A request names something the server refuses (400)."""


class PublishConflict(StateConflict):
    """That owner of that attempt is publishing already, or the attempt was stopped (409)."""


class Stopped(StateConflict):
    """A publish ended early: its attempt was stopped, or its caller went away."""


def publish_settings(req: PublishRequest, *, threads: int | None) -> EncodeSettings:
    """The settings ``dcr encode`` runs with for this request (the operator's Job builds
    the same from ``EncodeSettings.argv``): the manifest part goes under the attempt."""
    return EncodeSettings(
        target_version=req.target_version, base_version=req.base_version, mode=req.mode,
        attempt=req.attempt, owner=req.owner, owners=req.owners, threads=threads,
        bucket_bytes=(EncodeSettings.bucket_bytes if req.bucket_mib is None
                      else req.bucket_mib * MiB),
        attempt_manifest=True, profile=req.profile)


def resolve_roots(roots: tuple[str, ...]) -> tuple[Path, ...]:
    out = []
    for root in roots:
        real = Path(os.path.realpath(root))
        if not real.is_dir():
            raise ConfigError(f"Checkpoint root {root!r} is not a directory.")
        out.append(real)
    return tuple(out)


@dataclass
class _Publish:
    """One running publish: its stop switch and the moment it ended."""

    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    why: str = ""


class _StopGuard:
    """The store as one publish sees it: once the publish is stopped, no write starts
    (a payload already being written finishes; the manifest part, written last, never
    does). The diff's own threads upload several payloads at once, so a check between
    items alone would let the last ones and the manifest through."""

    def __init__(self, store: Store, entry: _Publish, what: str) -> None:
        self._store, self._entry, self._what = store, entry, what
        self.uri = store.uri

    def check(self) -> None:
        if self._entry.stop.is_set():
            raise Stopped(f"{self._what} stopped ({self._entry.why}) before its manifest "
                          "part was written.")

    def put(self, key: str, data: bytes) -> None:
        self.check()
        self._store.put(key, data)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def exists(self, key: str) -> bool:
        return self._store.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self._store.list(prefix)


Work = Callable[[Store, Callable[[int], None]], Manifest]
Snapshotter = Callable[[SnapshotRequest, Store], RankPart]  # a rank's part, from memory


class Publisher(Protocol):
    """What a publish runs: checkpoints diffed (``dcr encoder``) or a rank's shards."""

    def prepare(self, req: PublishRequest) -> Work:
        """Check ``req`` (fast: it runs on the event loop; raises BadPublish) and return
        the blocking work, which writes through the store it is given and calls the
        progress function between items (that call raises once the publish is stopped)."""
        ...


@dataclass(frozen=True)
class CheckpointPublisher:
    """``dcr encoder``: diffs two checkpoints that resolve under fixed roots."""

    roots: tuple[Path, ...]
    threads: int | None = None

    def resolve(self, what: str, path: str) -> Path:
        """``path`` with links resolved, if that lies under a checkpoint root."""
        real = Path(os.path.realpath(path))
        if not any(real == root or real.is_relative_to(root) for root in self.roots):
            raise BadPublish(f"The {what} checkpoint {path!r} is outside every checkpoint "
                             f"root of this encoder ({', '.join(map(str, self.roots))}), "
                             "symlinks and '..' resolved.")
        return real

    def prepare(self, req: PublishRequest) -> Work:
        base, target = self.resolve("base", req.base), self.resolve("target", req.target)
        settings = publish_settings(req, threads=self.threads)

        def work(store: Store, progress: Callable[[int], None]) -> Manifest:
            log.info("publishing owner %d/%d of attempt %s (%s, %d -> %d): %s -> %s",
                     req.owner, req.owners, req.attempt, req.mode, req.base_version,
                     req.target_version, base, target)
            try:
                with Checkpoint(base) as b, Checkpoint(target) as t:
                    return diff_checkpoints(b, t, store, settings, progress)
            except CheckpointError as e:  # its sentence may quote a file's bytes: log only
                log.warning("publish of attempt %s: %s", req.attempt, e)
                raise CheckpointError(f"The base {req.base!r} or the target {req.target!r} "
                                      "is not a readable safetensors checkpoint (the "
                                      "encoder's log says why).") from None
        return work


class EncoderService:
    """Runs publishes into one store, at most ``max_publishes`` at once; thread-safe."""

    def __init__(self, store: Store, publisher: Publisher, *, max_publishes: int = 4,
                 stop_wait_s: float = 120.0, snapshotter: Snapshotter | None = None) -> None:
        self.store, self.publisher, self.snapshotter = store, publisher, snapshotter
        self.max_publishes, self.stop_wait_s = max_publishes, stop_wait_s
        self._lock = threading.Lock()
        self._running: dict[tuple[str, int], _Publish] = {}
        self._stopped: OrderedDict[str, None] = OrderedDict()
        self.published = 0  # publishes that completed (for tests and logs)

    def begin(self, req: PublishRequest) -> tuple[_Publish, Work]:
        """Check and register a publish (fast: run it on the event loop)."""
        work = self.publisher.prepare(req)
        key = (req.attempt, req.owner)
        with self._lock:
            if req.attempt in self._stopped:
                raise PublishConflict(f"Attempt {req.attempt} was stopped; it publishes "
                                      "nothing more here.")
            if key in self._running:
                raise PublishConflict(f"Owner {req.owner} of attempt {req.attempt} is "
                                      "publishing already.")
            if len(self._running) >= self.max_publishes:
                raise Busy(f"{self.max_publishes} publishes are running; try again when "
                           "one has ended.")
            entry = self._running[key] = _Publish()
        return entry, work

    def run(self, req: PublishRequest, entry: _Publish, work: Work) -> dict[str, Any]:
        """Encode and write; the summary ``dcr encode --json`` prints. Blocking."""
        try:
            store = _StopGuard(self.store, entry, f"Owner {req.owner} of attempt "
                               f"{req.attempt}")

            def progress(_: int) -> None:  # between items: diff nothing more
                store.check()

            t0 = time.perf_counter()
            m = work(store, progress)
            summary = encode_summary(m, seconds=time.perf_counter() - t0, store=self.store.uri)
            log.info("published owner %d of attempt %s: %d payloads, %d bytes, %.2f s",
                     req.owner, req.attempt, summary["payloads"], summary["payload_bytes"],
                     summary["seconds"])
            with self._lock:
                self.published += 1
            return summary
        finally:
            with self._lock:
                self._running.pop((req.attempt, req.owner), None)
            entry.done.set()

    def snapshot(self, req: SnapshotRequest) -> RankPart:
        """Write this owner's part of a snapshot (a trainer rank's, from memory). Blocking."""
        if self.snapshotter is None:
            raise BadPublish("This encoder diffs checkpoints and writes no snapshot from "
                             "memory; dcr snapshot writes one of a checkpoint directory.")
        return self.snapshotter(req, self.store)

    def stop(self, attempt: str) -> StopAnswer:
        """Mark ``attempt`` obsolete; return once its publishes ended (or the wait ran out)."""
        with self._lock:
            self._stopped[attempt] = None
            self._stopped.move_to_end(attempt)
            while len(self._stopped) > _STOPPED_KEPT:
                self._stopped.popitem(last=False)
            mine = [e for (a, _), e in self._running.items() if a == attempt]
        for e in mine:
            e.why = "the attempt was stopped"
            e.stop.set()
        deadline = time.monotonic() + self.stop_wait_s
        for e in mine:
            e.done.wait(max(0.0, deadline - time.monotonic()))
        running = sum(not e.done.is_set() for e in mine)
        if mine:
            log.info("stopped attempt %s: %d publishes ended, %d still running",
                     attempt, len(mine) - running, running)
        return StopAnswer(attempt=attempt, stopped=len(mine) - running, running=running)


# Beside each Refused's own status (BadPublish 400; BaselineError, PublishConflict and
# Stopped 409; Busy 503): checkpoints a request names that cannot be read, and a request
# the settings of a publish refuse.
STATUS = Statuses(rows=((CheckpointError, 400), (ConfigError, 400)))


def make_app(service: EncoderService, token: str) -> web.Application:
    publishes = ThreadPoolExecutor(service.max_publishes, thread_name_prefix="encoder-publish")
    stops = ThreadPoolExecutor(2, thread_name_prefix="encoder-stop")

    async def body(request: web.Request, model: type[Any]) -> Any:
        raw = await request.read()  # aiohttp answers 413 beyond client_max_size
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as e:
            raise BadPublish(f"{model.__name__}: {first_validation_error(e, 'body')}") from e

    async def publish(request: web.Request) -> web.StreamResponse:
        req: PublishRequest = await body(request, PublishRequest)
        entry, work = service.begin(req)
        job = asyncio.get_running_loop().run_in_executor(publishes, service.run, req, entry,
                                                         work)
        try:
            while not (await asyncio.wait({job}, timeout=DISCONNECT_POLL_S))[0]:
                if request.transport is None or request.transport.is_closing():
                    entry.why = "its caller went away"
                    entry.stop.set()
        finally:
            if not job.done():  # this handler was cancelled: the caller is gone
                entry.why = "its caller went away"
                entry.stop.set()
        return web.json_response(await job)

    async def stop(request: web.Request) -> web.StreamResponse:
        req: StopRequest = await body(request, StopRequest)
        answer = await asyncio.get_running_loop().run_in_executor(stops, service.stop,
                                                                  req.attempt)
        return web.Response(body=answer.model_dump_json(), content_type="application/json")

    async def snapshot(request: web.Request) -> web.StreamResponse:
        req: SnapshotRequest = await body(request, SnapshotRequest)
        part = await asyncio.get_running_loop().run_in_executor(publishes, service.snapshot,
                                                                req)
        return web.Response(body=part.model_dump_json(), content_type="application/json")

    async def healthz(_: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")

    async def shutdown(_: web.Application) -> None:
        publishes.shutdown(wait=False, cancel_futures=True)
        stops.shutdown(wait=False, cancel_futures=True)

    app = web.Application(middlewares=[guard(token, STATUS, open_paths=OPEN_PATHS,
                                             wire=ENCODER_API)],
                          client_max_size=MAX_BODY_BYTES)
    app.on_cleanup.append(shutdown)
    app.add_routes([web.post("/v1/publish", publish), web.post("/v1/stop", stop),
                    web.post("/v1/snapshot", snapshot),
                    web.get("/healthz", healthz)])
    return app


class BackgroundServer:
    """A service's HTTP API on a thread of this process, with its own event loop: how a
    trainer rank serves the warm-encoder protocol beside its training loop."""

    def __init__(self, service: EncoderService, token: str, *,
                 listen: str = "127.0.0.1:0") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="encoder-http")
        self._thread.start()

        async def serve() -> Listening:
            return await start(make_app(service, token), listen, "The warm encoder")

        try:
            self._server = asyncio.run_coroutine_threadsafe(serve(), self._loop).result(30)
        except BaseException:
            self._stop_loop()
            raise
        self.url = self._server.url

    def close(self) -> None:
        """Stop listening and end the thread (publishes still running are abandoned)."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(30)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def build_service(s: EncoderServerSettings) -> EncoderService:
    publisher = CheckpointPublisher(resolve_roots(s.checkpoint_root), threads=s.threads)
    return EncoderService(open_store(s.store), publisher, max_publishes=s.max_publishes,
                          stop_wait_s=s.stop_wait_s)


def run(s: EncoderServerSettings) -> int:
    """Serve until interrupted. Prints one JSON line ``{"url", "store"}`` once listening."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = read_token("encoder token", s.token_file)
    service = build_service(s)
    with contextlib.suppress(KeyboardInterrupt), \
            BackgroundServer(service, token, listen=s.listen) as server:
        print(json.dumps({"url": server.url, "store": service.store.uri}), flush=True)
        threading.Event().wait()
    return 0


__all__ = ["BackgroundServer", "CheckpointPublisher", "EncoderServerSettings", "EncoderService",
           "Publisher", "make_app", "publish_settings", "run"]
