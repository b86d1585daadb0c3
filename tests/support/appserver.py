"""An aiohttp application served on 127.0.0.1 from an event loop on its own thread, for
tests that call it over real HTTP from synchronous code."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web


class Server:
    """``make_app`` served on 127.0.0.1 from an event loop on its own thread."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app, access_log=None)
        self._call(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self._call(site.start())
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
