"""A relay node as a receive source (:mod:`dcr.transport.receive`), for sync callers.

The receive loop is synchronous (threads fetch, the caller applies); the relay client
is asyncio. This facade runs the client on its own event loop thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from dcr.errors import RelayNotFound
from dcr.format.manifest import Manifest
from dcr.transport.relay.client import RelayClient

T = TypeVar("T")


class RelaySource:
    """The payloads and manifest of one attempt, as one relay node holds them."""

    def __init__(self, url: str, token: str, attempt: str) -> None:
        self.url, self.attempt = url, attempt
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client = RelayClient(url, token)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def available(self) -> list[tuple[int, int]]:
        try:
            return [(p.owner, p.seq) for p in self._run(self._client.list_payloads(self.attempt))]
        except RelayNotFound:
            return []

    def fetch(self, pid: tuple[int, int]) -> bytes:
        return bytes(self._run(self._client.get_payload(self.attempt, *pid)))

    def manifest(self) -> Manifest | None:
        try:
            data = self._run(self._client.get_manifest(self.attempt))
        except RelayNotFound:
            return None
        return Manifest.parse(data, f"{self.url} attempt {self.attempt}")

    def close(self) -> None:
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
