"""A deadline for a whole HTTP call on urllib3: the answer's headers and body together.

urllib3's timeouts bound each socket operation, so a peer that sends its answer a byte
at a time, each just inside the read timeout, holds the call (and the caller's thread) for
as long as it likes. Within :func:`deadline`, connections made by :data:`POOL_CLASSES`'s
pools register their socket with one watchdog thread when they wait for an answer; at the
deadline the watchdog shuts the socket down, the blocked read returns, and the call fails.
The caller sees :attr:`Deadline.expired` and says so in its own words.
docs/security-kubernetes.md (its table names the tests).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.response import BaseHTTPResponse


class Deadline:
    """One call's deadline (``time.monotonic()`` seconds) and the sockets it watches."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.expired = False  # the watchdog shut a socket of this call down
        self._alarms: list[int] = []

    def left(self) -> float:
        """Seconds until the deadline, at least a millisecond (a timeout must be > 0)."""
        return max(0.001, self.at - time.monotonic())

    def watch(self, sock: socket.socket) -> None:
        self._alarms.append(_WATCHDOG.arm(self, sock))

    def done(self) -> None:
        for alarm in self._alarms:
            _WATCHDOG.disarm(alarm)
        self._alarms.clear()


class _Watchdog:
    """One daemon thread that shuts sockets down at their deadlines (a heap of alarms)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, tuple[Deadline, socket.socket]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, call: Deadline, sock: socket.socket) -> int:
        with self._cond:
            alarm = next(self._ids)
            self._armed[alarm] = (call, sock)
            heapq.heappush(self._heap, (call.at, alarm))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="http-deadlines",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
            return alarm

    def disarm(self, alarm: int) -> None:
        with self._cond:
            self._armed.pop(alarm, None)  # its heap entry is skipped when it comes up

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                at, alarm = self._heap[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                armed = self._armed.pop(alarm, None)
            if armed is not None:
                call, sock = armed
                call.expired = True
                with contextlib.suppress(OSError):  # closed meanwhile
                    sock.shutdown(socket.SHUT_RDWR)


_WATCHDOG = _Watchdog()
_CURRENT = threading.local()  # .call: the Deadline of this thread's call, if any


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[Deadline]:
    """Bound every answer this thread waits for, through :data:`POOL_CLASSES`'s pools,
    to ``seconds`` from now in all."""
    call = Deadline(seconds)
    _CURRENT.call = call
    try:
        yield call
    finally:
        _CURRENT.call = None
        call.done()


def _watched(conn: HTTPConnection) -> None:
    call: Deadline | None = getattr(_CURRENT, "call", None)
    if call is not None and conn.sock is not None:
        call.watch(conn.sock)


class _Connection(HTTPConnection):
    def getresponse(self) -> BaseHTTPResponse:  # type: ignore[override]
        _watched(self)
        return super().getresponse()


class _TLSConnection(HTTPSConnection):
    def getresponse(self) -> BaseHTTPResponse:  # type: ignore[override]
        _watched(self)
        return super().getresponse()


class _Pool(HTTPConnectionPool):
    ConnectionCls = _Connection


class _TLSPool(HTTPSConnectionPool):
    ConnectionCls = _TLSConnection


# For a PoolManager: ``manager.pool_classes_by_scheme = dict(POOL_CLASSES)``.
POOL_CLASSES: dict[str, Any] = {"http": _Pool, "https": _TLSPool}

__all__ = ["POOL_CLASSES", "Deadline", "deadline"]
