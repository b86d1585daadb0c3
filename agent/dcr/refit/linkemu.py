"""A WAN link on loopback: a TCP proxy with a bandwidth limit and a propagation delay.

Each direction (:class:`Direction`, shared by all connections) is a token bucket at ``mbit``,
then a delay line of ``rtt_ms / 2``. Run one process per link::

    python -m dcr.refit.linkemu --listen 127.0.0.1:9100 --to 127.0.0.1:9000 --mbit 250 --rtt-ms 20

It prints ``listening HOST:PORT``, and ``bytes up N down M`` on SIGUSR1 (the counts so far,
so the main job can split them by phase) and when stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time

CHUNK = 256 << 10


class Direction:
    """One direction of the link: a token bucket followed by a fixed delay."""

    def __init__(self, mbit: float, delay_s: float) -> None:
        self.rate = mbit * 1e6 / 8  # bytes per second
        self.delay = delay_s
        self.free_at = 0.0  # when the wire is next idle (monotonic seconds)
        self.bytes = 0

    def schedule(self, n: int) -> float:
        """Serialise ``n`` bytes; return when they arrive at the far end."""
        now = time.monotonic()
        self.free_at = max(now, self.free_at) + n / self.rate
        self.bytes += n
        return self.free_at + self.delay


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
               way: Direction) -> None:
    line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=64)

    async def deliver() -> None:
        while True:
            due, data = await line.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    out = asyncio.create_task(deliver())
    try:
        while data := await reader.read(CHUNK):
            due = way.schedule(len(data))
            # Hold the reader while the wire is busy: back-pressure, like a real queue.
            ahead = way.free_at - time.monotonic()
            if ahead > 0.005:
                await asyncio.sleep(ahead)
            await line.put((due, data))
    except (ConnectionError, OSError):
        pass
    finally:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # shutting down: drop what is in flight
            out.cancel()
        else:
            await line.put((0.0, b""))
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await out


async def serve(listen: str, target: str, mbit: float, rtt_ms: float) -> None:
    up = Direction(mbit, rtt_ms / 2000)
    down = Direction(mbit, rtt_ms / 2000)
    th, tp = target.rsplit(":", 1)

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(th, int(tp))
        except OSError:
            cw.close()
            return
        try:
            await asyncio.gather(pump(cr, sw, up), pump(sr, cw, down), return_exceptions=True)
        except asyncio.CancelledError:  # shutting down with the connection open
            pass
        finally:
            for w in (cw, sw):
                w.close()

    lh, lp = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, lh, int(lp))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: print(
        f"bytes up {up.bytes} down {down.bytes}", flush=True))
    port = server.sockets[0].getsockname()[1]
    print(f"listening {lh}:{port}", flush=True)
    async with server:
        await stop.wait()
    with contextlib.suppress(OSError):
        print(f"bytes up {up.bytes} down {down.bytes}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="host:port (port 0 picks one)")
    ap.add_argument("--to", required=True, help="host:port to forward to")
    ap.add_argument("--mbit", type=float, required=True, help="capacity per direction")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="round-trip propagation delay")
    args = ap.parse_args(argv)
    asyncio.run(serve(args.listen, args.to, args.mbit, args.rtt_ms))


if __name__ == "__main__":
    main()
