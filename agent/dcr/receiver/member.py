"""An agent in the ``member`` role: a worker pod's stager for its group's leader.

It holds no engine: the leader's engine reaches this pod's ranks. Told an attempt
(:mod:`dcr.receiver.member_api`), it fetches, verifies and stages every payload of it from
the store into this pod's staging directory, exactly as the leader's agent does (the same
:func:`~dcr.transport.receive.receive`, so the same file names), until the leader releases
each one after applying it or ends the attempt. A new attempt ends the one before. The
member stages the whole attempt without waiting for releases, so its order never has to
match the leader's; an attempt larger than ``staging_bytes`` fails here, naming the
option. For a dense load it builds the version from the store's history under this pod's
checkpoint root, as the leader's agent does under its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcr.errors import DcrError, StateConflict
from dcr.format.payload import Payload
from dcr.http.edge import Statuses, guard
from dcr.protocol.agent_api import AttemptSpec, BadRequest
from dcr.receiver.fromstore import FromStore
from dcr.receiver.member_api import MemberError, MemberStatus, parse
from dcr.receiver.staging import StagingDir
from dcr.transport.receive import ReceiveStopped, Source, receive
from dcr.versions import MEMBER_API

log = logging.getLogger(__name__)
# Beside each Refused's own status (BadRequest 400; MemberConflict, NotVouched 409): any
# other DCR error is what the member cannot do now (409).
STATUS = Statuses(rows=((DcrError, 409),))


class MemberConflict(StateConflict):
    """A call this member cannot answer as asked (an attempt it does not hold)."""


@dataclass(eq=False)
class _Staging:
    spec: AttemptSpec
    stop: threading.Event = field(default_factory=threading.Event)
    staged: dict[str, int] = field(default_factory=dict)  # name -> bytes, not yet released
    bytes: int = 0
    received: bool = False
    error: str | None = None
    thread: threading.Thread | None = None


class MemberService:
    """One worker pod's member agent."""

    def __init__(self, name: str, source_for: Callable[[AttemptSpec], Source], *,
                 staging_dir: Path, staging_bytes: int, store: FromStore | None = None
                 ) -> None:
        self.name = name
        self.source_for = source_for
        self.staging = StagingDir(staging_dir)
        self.staging_bytes = staging_bytes
        self.store = store
        self._lock = threading.Lock()
        self._current: _Staging | None = None
        self._dense = threading.Lock()
        removed = self.staging.clear()
        if removed:
            log.info("%s: removed %d payload files left from before a restart", name, removed)

    # --- calls ---------------------------------------------------------------------

    def stage(self, spec: AttemptSpec) -> MemberStatus:
        """Start staging ``spec``'s payloads (again: idempotent); any other attempt ends.
        The history it names is the only one this member reads from now on."""
        if self.store is not None:
            self.store.vouch(spec.history_digest, spec.target_version, spec.owners)
        with self._lock:
            cur = self._current
            if cur is not None and cur.spec.attempt == spec.attempt:
                return self._status(cur)
        if cur is not None:
            self._end(cur)
        run = _Staging(spec=spec)
        run.thread = threading.Thread(target=self._receive, args=(run,), daemon=True,
                                      name=f"member-{spec.attempt}")
        with self._lock:
            self._current = run
        run.thread.start()
        log.info("%s: staging attempt %s (v%s)", self.name, spec.attempt, spec.target_version)
        return self._status(run)

    def status(self, attempt: str) -> MemberStatus:
        with self._lock:
            return self._status(self._held(attempt))

    def release(self, attempt: str, names: list[str]) -> MemberStatus:
        """The leader applied ``names``: remove their files."""
        with self._lock:
            run = self._held(attempt)
            for n in names:
                size = run.staged.pop(n, None)
                if size is not None:
                    run.bytes -= size
        for n in names:
            self.staging.remove(n)
        with self._lock:
            return self._status(run)

    def end(self, attempt: str) -> MemberStatus:
        """The attempt is over (committed, failed or stopped): stop and clear it."""
        with self._lock:
            run = self._current
            if run is None or run.spec.attempt != attempt:
                return MemberStatus(name=self.name)  # idempotent: nothing of it is held
        self._end(run)
        return MemberStatus(name=self.name)

    def dense(self, version: int, history_digest: str | None = None) -> str:
        """Build ``version`` from the store's history (the one ``history_digest`` names,
        as the leader passes it on) under the checkpoint root; the directory relative to
        it (the same the leader's agent builds)."""
        if self.store is None:
            raise MemberConflict(f"{self.name}: a dense load needs the store's history; this "
                                 "member has no --store and --checkpoint-root.")
        self.store.vouch(history_digest, version)
        with self._dense:
            relative, _ = self.store.build(version)
        return relative

    # --- inside --------------------------------------------------------------------

    def _held(self, attempt: str) -> _Staging:
        run = self._current
        if run is None or run.spec.attempt != attempt:
            held = run.spec.attempt if run is not None else "none"
            raise MemberConflict(f"{self.name}: attempt {attempt} is not held here (held: "
                                 f"{held}); this member restarted or was told another.")
        return run

    def _status(self, run: _Staging) -> MemberStatus:
        return MemberStatus(name=self.name, attempt=run.spec.attempt, staged=sorted(run.staged),
                            received=run.received, error=run.error)

    def _end(self, run: _Staging) -> None:
        run.stop.set()
        if run.thread is not None:
            run.thread.join()
        with self._lock:
            if self._current is run:
                self._current = None
        self.staging.clear(run.spec.attempt)

    def _receive(self, run: _Staging) -> None:
        spec = run.spec
        source = self.source_for(spec)
        try:
            receive(source, spec.attempt, lambda p: self._stage(run, p), owners=spec.owners,
                    release="when_listed", hold_bytes=self.staging_bytes,
                    timeout_s=max(0.1, spec.deadline - time.time()), stop=run.stop)
            with self._lock:
                run.received = True
        except ReceiveStopped:
            pass
        except Exception as e:  # the leader sees it in the status and fails the attempt
            log.warning("%s: attempt %s: %s", self.name, spec.attempt, e)
            with self._lock:
                run.error = f"{type(e).__name__}: {e}"[:2048]
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _stage(self, run: _Staging, payload: Payload) -> None:
        with self._lock:
            if run.stop.is_set():
                raise ReceiveStopped(f"attempt {run.spec.attempt} ended")
            if run.bytes + payload.size > self.staging_bytes and run.staged:
                raise MemberConflict(
                    f"{self.name}: attempt {run.spec.attempt} needs more than the staging "
                    f"budget of {self.staging_bytes} bytes unreleased; a member stages the "
                    "whole attempt, so raise --staging-mib on the worker pods.")
            run.bytes += payload.size
        name = self.staging.write(payload)
        with self._lock:
            run.staged[name] = payload.size




def make_member_app(service: MemberService, token: str) -> Any:
    """The member API (:mod:`dcr.receiver.member_api`) on aiohttp, behind ``token``;
    blocking calls run on a small pool, never on the event loop."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from aiohttp import web

    from dcr.receiver.member_api import Dense, End, Release

    pool = ThreadPoolExecutor(4, thread_name_prefix="member")
    dense_pool = ThreadPoolExecutor(1, thread_name_prefix="member-dense")

    async def run(fn: Any, *args: Any, on: ThreadPoolExecutor = pool) -> Any:
        return await asyncio.get_running_loop().run_in_executor(on, fn, *args)

    def body(model: type[Any], raw: bytes | dict[str, Any]) -> Any:
        try:
            return parse(model, raw)
        except MemberError as e:  # a request the member refuses as written
            raise BadRequest(str(e)) from None

    def answer(status: MemberStatus) -> web.Response:
        return web.Response(body=status.model_dump_json(), content_type="application/json")

    async def stage(request: web.Request) -> web.StreamResponse:
        spec = body(AttemptSpec, await request.read())
        return answer(await run(service.stage, spec))

    async def status(request: web.Request) -> web.StreamResponse:
        ref = body(End, {"attempt": request.query.get("attempt", "")})
        return answer(await run(service.status, ref.attempt))

    async def release(request: web.Request) -> web.StreamResponse:
        names = body(Release, await request.read())
        try:
            names.checked()
        except DcrError as e:
            raise BadRequest(str(e)) from None
        return answer(await run(service.release, names.attempt, names.names))

    async def end(request: web.Request) -> web.StreamResponse:
        ref = body(End, await request.read())
        return answer(await run(service.end, ref.attempt))

    async def dense(request: web.Request) -> web.StreamResponse:
        req = body(Dense, await request.read())
        built = await run(service.dense, req.version, req.history_digest, on=dense_pool)
        return web.json_response({"checkpoint": built})

    async def healthz(_: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok", "name": service.name})

    async def shutdown(_: web.Application) -> None:
        pool.shutdown(wait=False, cancel_futures=True)
        dense_pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application(middlewares=[guard(token, STATUS, open_paths={"/healthz"},
                                             wire=MEMBER_API)], client_max_size=1 << 20)
    app.add_routes([web.post("/v1/member/stage", stage), web.get("/v1/member/status", status),
                    web.post("/v1/member/release", release), web.post("/v1/member/end", end),
                    web.post("/v1/member/dense", dense), web.get("/healthz", healthz)])
    app.on_shutdown.append(shutdown)
    return app


__all__ = ["MemberConflict", "MemberService", "make_member_app"]
