"""The donor side of a catch-up from a peer: an agent lends its copy of a committed version.

What is lent is the copy the agent built from the store for its own rejoin (``dcr-from-store``
under its checkpoint root, with the version ``materialize`` recorded there), tensor files
only: never configs, never the engine's memory. **Leases** keep it whole while read: a
build from the store waits until every lease is released or has lapsed, and no lease is
taken while a build writes. A donor lends nothing while an attempt is open or a dense
load runs (the refit of the live fleet keeps its disk and network), nor a copy newer than
the reader asked for. A lease lapses ``LEASE_S`` after its last fetch, so a reader that
died cannot hold a donor's builds back for longer.

Choices, and why: a lease is a counted read lock with a deadline, not a copy or a
snapshot of the directory, because the copy changes only when its own agent rebuilds it;
a reader still checks every tensor against the history's fingerprints, so a lease that
lapsed mid-read shows as refused bits, never as a wrong load. docs/catch-up.md, "From a
peer"; the wire is :mod:`dcr.protocol.peer_api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Protocol

from aiohttp import web

from dcr.errors import Busy, StateConflict
from dcr.files.materialize import recorded_version
from dcr.files.vouched import is_tensor_file, tensor_files
from dcr.http.edge import unauthorized
from dcr.http.tokens import bearer_matches
from dcr.protocol.agent_api import AgentStatus, parse_body
from dcr.protocol.peer_api import (
    FILE_NAME,
    FILE_PATH,
    LEASE_ID,
    LEASE_PATH,
    RELEASE_PATH,
    LeaseRef,
    LeaseRequest,
    LentFile,
    Offer,
)

log = logging.getLogger(__name__)
LEASE_S = 120.0  # a lease lapses this long after its last fetch (a file of GiBs: minutes)
_LEASE = re.compile(LEASE_ID.strip("^$"))
MAX_LEASES = 4  # readers at once: each reads the whole copy from this pod's disk


class Lender(Protocol):
    """What a donor asks of its agent (``AgentService``): whether it is mid-refit."""

    _cond: threading.Condition  # the state lock
    _loading: int | None  # the version a dense load is restoring

    def _busy(self) -> bool: ...
    def snapshot(self) -> AgentStatus: ...


def why_busy(agent: Lender) -> str | None:
    """Why ``agent`` lends nothing now (an attempt open, a dense load), or None."""
    with agent._cond:
        busy, loading = agent._busy(), agent._loading
    if not busy:
        return None
    if loading is not None:
        return f"a dense load of version {loading} is in progress"
    st = agent.snapshot()
    return f"attempt {st.attempt} is {st.state}"


class NotLent(StateConflict):
    """A donor lends nothing now: no copy held, a newer one, an attempt or a build."""


class Leases:
    """Read leases on one directory, with deadlines, and the one writer that waits for
    them (:meth:`writing`)."""

    def __init__(self, lease_s: float = LEASE_S, max_leases: int = MAX_LEASES) -> None:
        self.lease_s, self.max_leases = lease_s, max_leases
        self._cond = threading.Condition()
        self._held: dict[str, float] = {}  # lease -> time.monotonic() it lapses at
        self._writing = False

    def take(self, what: str) -> str:
        """A new lease; :class:`NotLent` while the directory is written, :class:`Busy`
        past ``max_leases``. ``what`` names the directory in refusals."""
        with self._cond:
            self._lapse()
            if self._writing:
                raise NotLent(f"{what} is being rebuilt; it is lent once whole.")
            if len(self._held) >= self.max_leases:
                raise Busy(f"{what} is lent to {len(self._held)} readers already; try "
                           "another peer or later.")
            lease = secrets.token_hex(16)
            self._held[lease] = time.monotonic() + self.lease_s
            return lease

    def renew(self, lease: str) -> bool:
        """Extend a lease that has not lapsed; False for one that has (or never was)."""
        with self._cond:
            self._lapse()
            if lease not in self._held:
                return False
            self._held[lease] = time.monotonic() + self.lease_s
            return True

    def release(self, lease: str) -> None:
        with self._cond:
            self._held.pop(lease, None)
            self._cond.notify_all()

    @property
    def held(self) -> int:
        with self._cond:
            self._lapse()
            return len(self._held)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the directory for writing: no new lease from now on, and wait until every
        lease is released or has lapsed."""
        with self._cond:
            self._writing = True
            try:
                while self._lapse():
                    log.info("a rebuild waits for %d peer leases", len(self._held))
                    self._cond.wait(timeout=max(0.01, min(self._held.values())
                                                - time.monotonic()))
            except BaseException:
                self._writing = False
                raise
        try:
            yield
        finally:
            with self._cond:
                self._writing = False

    def _lapse(self) -> int:
        """Drop lapsed leases; how many are left. Hold the lock."""
        now = time.monotonic()
        for lease in [k for k, until in self._held.items() if until <= now]:
            log.warning("peer lease %s... lapsed unreleased", lease[:8])
            del self._held[lease]
        return len(self._held)


class Donor:
    """Lends ``copy`` (a checkpoint directory whose version ``materialize`` recorded)
    under ``leases``; ``busy`` says why the agent lends nothing now (None: it may)."""

    def __init__(self, name: str, copy: Path, leases: Leases,
                 busy: Callable[[], str | None]) -> None:
        self.name, self.copy, self.leases, self.busy = name, copy, leases, busy
        self._lent: dict[str, tuple[int, dict[str, Path]]] = {}  # lease -> version, files
        self._lock = threading.Lock()

    def lease(self, asked: LeaseRequest) -> Offer:
        """A lease on the copy, for a reader that can use a version up to ``asked``."""
        why = self.busy()
        if why is not None:
            raise NotLent(f"{self.name} lends nothing now: {why}.")
        lease = self.leases.take(f"{self.name}'s copy")
        try:
            version, files = self._held(asked.version)
        except BaseException:
            self.leases.release(lease)
            raise
        with self._lock:
            self._lent[lease] = (version, files)
        log.info("%s: lent its copy of version %s (%d files)", self.name, version, len(files))
        return Offer(lease=lease, version=version, lease_s=self.leases.lease_s,
                     files=tuple(LentFile(name=n, size=p.stat().st_size)
                                 for n, p in sorted(files.items())))

    def _held(self, asked: int) -> tuple[int, dict[str, Path]]:
        version = recorded_version(self.copy)
        if version is None:
            raise NotLent(f"{self.name} holds no whole copy of a committed version.")
        if version > asked:
            raise NotLent(f"{self.name}'s copy holds version {version}, newer than the "
                          f"version {asked} asked for.")
        files = {p.name: p for p in tensor_files(self.copy)
                 if p.parent == self.copy and is_tensor_file(p.name)}
        if not files:
            raise NotLent(f"{self.name}'s copy of version {version} has no tensor files.")
        return version, files

    def file(self, lease: str, name: str) -> Path:
        """The file ``name`` of ``lease`` (renewed); 404 for what the lease does not hold."""
        with self._lock:
            lent = self._lent.get(lease)
        if lent is None or not self.leases.renew(lease):
            self.release(lease)
            raise NotLent(f"Lease {lease[:8]}... on {self.name}'s copy is not held (released "
                          "or lapsed); take a new one.")
        path = lent[1].get(name)
        if path is None:
            raise web.HTTPNotFound(text=f"{name[:80]!r} is not lent by this lease.")
        return path

    def release(self, lease: str) -> None:
        with self._lock:
            self._lent.pop(lease, None)
        self.leases.release(lease)


def peer_routes(donor: Donor, token: str) -> list[web.RouteDef]:
    """The donor routes, each asking for the peer read ``token`` (the agent token is
    refused here, as the peer token is on the agent's own routes). Disk reads run off
    the event loop."""

    def guarded(fn: Callable[[web.Request, bytes], web.StreamResponse]
                ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            if not bearer_matches(request.headers.get("Authorization"), token):
                return unauthorized()
            body = await request.read() if request.method == "POST" else b""
            return await asyncio.to_thread(fn, request, body)
        return handler

    def lease(request: web.Request, body: bytes) -> web.StreamResponse:
        offer = donor.lease(parse_body(LeaseRequest, body))
        return web.Response(body=offer.model_dump_json(), content_type="application/json")

    def file(request: web.Request, body: bytes) -> web.StreamResponse:
        lease, name = request.query.get("lease", ""), request.query.get("name", "")
        if FILE_NAME.fullmatch(name) is None or _LEASE.fullmatch(lease) is None:
            raise web.HTTPBadRequest(text="lease and name are a lease id and a file name.")
        return web.FileResponse(donor.file(lease, name))

    def release(request: web.Request, body: bytes) -> web.StreamResponse:
        donor.release(parse_body(LeaseRef, body).lease)
        return web.json_response({})

    return [web.post(LEASE_PATH, guarded(lease)), web.get(FILE_PATH, guarded(file)),
            web.post(RELEASE_PATH, guarded(release))]
