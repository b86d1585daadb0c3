"""A relay node as a receive source (:mod:`dcr.transport.receive`), for sync callers.

The receive loop is synchronous (threads fetch, the caller applies); the relay client
is asyncio. This facade runs the client on its own event loop thread.
"""

from __future__ import annotations

from dcr.errors import RelayNotFound
from dcr.format.manifest import Manifest
from dcr.transport.relay.client import BlockingRelay


class RelaySource:
    """The payloads and manifest of one attempt, as one relay node holds them."""

    def __init__(self, url: str, token: str, attempt: str) -> None:
        self.url, self.attempt = url, attempt
        self._relay = BlockingRelay(url, token, name="relay-source")

    def available(self) -> list[tuple[int, int]]:
        relay = self._relay
        try:
            return [(p.owner, p.seq) for p in relay.run(relay.client.list_payloads(self.attempt))]
        except RelayNotFound:
            return []

    def fetch(self, pid: tuple[int, int]) -> bytes:
        return bytes(self._relay.run(self._relay.client.get_payload(self.attempt, *pid)))

    def manifest(self) -> Manifest | None:
        try:
            data = self._relay.run(self._relay.client.get_manifest(self.attempt))
        except RelayNotFound:
            return None
        return Manifest.parse(data, f"{self.url} attempt {self.attempt}")

    def close(self) -> None:
        self._relay.close()
