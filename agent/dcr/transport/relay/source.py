"""A relay node as a receive source (:mod:`dcr.transport.receive`), for sync callers.

The receive loop is synchronous (threads fetch, the caller applies); the relay client
is asyncio. This facade runs the client on its own event loop thread.
"""

from __future__ import annotations

from dcr.errors import RelayNotFound
from dcr.format.manifest import DEFAULT_MANIFEST_LIMITS, Manifest, ManifestLimits
from dcr.transport.relay.client import BlockingRelay
from dcr.transport.relay.wire import MAX_LIST_WAIT_S


class RelaySource:
    """The payloads and manifest of one attempt, as one relay node holds them."""

    def __init__(self, url: str, token: str, attempt: str,
                 limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS) -> None:
        self.url, self.attempt, self.limits = url, attempt, limits
        self._relay = BlockingRelay(url, token, name="relay-source")
        self._tag: str | None = None  # of the last listing seen

    def available(self) -> list[tuple[int, int]]:
        return [(p["owner"], p["seq"]) for p in self._list()]

    def wait_for_change(self, timeout_s: float) -> None:
        """Return once the node's listing of the attempt differs from the last one seen
        (a payload or the manifest arrived), or after ``timeout_s``: one long poll."""
        self._list(wait_s=min(timeout_s, MAX_LIST_WAIT_S))

    def _list(self, wait_s: float = 0.0) -> list[dict[str, int]]:
        relay = self._relay
        try:
            listing = relay.run(relay.client.listing(self.attempt, wait_s=wait_s,
                                                     known=self._tag))
        except RelayNotFound:
            return []
        self._tag = listing.get("tag")
        return list(listing["payloads"])

    def fetch(self, pid: tuple[int, int]) -> bytes:
        return bytes(self._relay.run(self._relay.client.get_payload(self.attempt, *pid)))

    def manifest(self) -> Manifest | None:
        try:
            data = self._relay.run(self._relay.client.get_manifest(self.attempt))
        except RelayNotFound:
            return None
        return Manifest.parse(data, f"{self.url} attempt {self.attempt}", self.limits)

    def close(self) -> None:
        self._relay.close()
