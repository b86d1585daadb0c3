"""A TCP forwarder that, when armed, answers HTTP requests with 503: the store's 5xx faults.

Toxiproxy's toxics act on bytes (delay, cut, reset); an S3 server that answers "503 Slow
Down" or "500 InternalError" is an HTTP answer, which no TCP toxic can produce. This is the
smallest layer that can: it forwards bytes both ways untouched, and while ``armed`` > 0 a
new connection's first request gets ``503 Service Unavailable`` with ``Connection:
close`` (each such answer spends one). Arming also closes the open connections, so a
client's kept-alive pool must reconnect and meet the answers. It runs on its own thread's
event loop in the process that arms it; the S3 server sits behind it, Toxiproxy in front.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

CHUNK = 256 << 10
BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
        b"<Message>fault campaign</Message></Error>")
ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
          b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY


class Http5xx:
    """Listens on ``127.0.0.1:port`` and forwards to ``upstream`` (HOST:PORT)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.armed = 0
        self.answered = 0  # 503s sent so far
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event  # made on the loop, in _serve
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http5xx", daemon=True)

    def start(self) -> Http5xx:
        self._thread.start()
        self._ready.wait(10)
        return self

    def arm(self, answers: int) -> None:
        """The next ``answers`` new connections get a 503; open ones are closed now."""
        def go() -> None:
            self.armed = answers
            for w in list(self._writers):
                w.close()
        self._loop.call_soon_threadsafe(go)

    def disarm(self) -> None:
        self._loop.call_soon_threadsafe(lambda: setattr(self, "armed", 0))

    def close(self) -> None:
        """Stop listening, end every connection's task, and end the thread."""
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(server.sockets[0].getsockname()[1])
        self._ready.set()
        await self._stop.wait()
        server.close()
        for w in list(self._writers):
            w.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.armed > 0:
            self.armed -= 1
            self.answered += 1
            with contextlib.suppress(OSError, asyncio.IncompleteReadError,
                                     asyncio.LimitOverrunError):
                await cr.readuntil(b"\r\n\r\n")  # the request head; the body is not read
                cw.write(ANSWER)
                await cw.drain()
            cw.close()
            return
        host, port = self.upstream.rsplit(":", 1)
        try:
            sr, sw = await asyncio.open_connection(host, int(port))
        except OSError:
            cw.close()
            return
        self._writers.update((cw, sw))
        try:  # cancelled when the layer stops: the connection just ends
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(_pump(cr, sw), _pump(sr, cw), return_exceptions=True)
        finally:
            for w in (cw, sw):
                self._writers.discard(w)
                w.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        writer.write_eof()


@contextlib.contextmanager
def http5xx(upstream: str) -> Iterator[Http5xx]:
    layer = Http5xx(upstream).start()
    try:
        yield layer
    finally:
        layer.close()
