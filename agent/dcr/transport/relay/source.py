"""A relay node as a receive source (:mod:`dcr.transport.receive`), for sync callers.

The receive loop is synchronous (threads fetch, the caller applies); the relay client
is asyncio. This facade runs the client on its own event loop thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dcr.errors import RelayError, RelayNotFound
from dcr.format.manifest import DEFAULT_MANIFEST_LIMITS, Manifest, ManifestLimits
from dcr.transport.relay.client import BlockingRelay
from dcr.transport.relay.wire import MAX_LIST_WAIT_S

log = logging.getLogger(__name__)
T = TypeVar("T")

# Waits between tries of a read that reached no node (refused, reset, timed out): a node
# behind a Service that died is out of its endpoints within seconds, and a retry then
# reaches another node, which holds the same payloads. A node that answered is believed.
READ_RETRY_S = (0.25, 0.5, 1.0, 2.0, 4.0)


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

    def _read(self, what: str, call: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``call()`` on the node, tried again (:data:`READ_RETRY_S`) while it reaches no
        node; an answer, an error status included, is final."""
        waits = iter(READ_RETRY_S)
        while True:
            try:
                return self._relay.run(call())
            except RelayError as e:
                wait = next(waits, None)
                if e.status is not None or wait is None:
                    raise
                log.info("attempt %s: %s reached no relay node (%s); again in %.2f s",
                         self.attempt, what, e, wait)
                time.sleep(wait)

    def _list(self, wait_s: float = 0.0) -> list[dict[str, int]]:
        client = self._relay.client
        try:
            listing = self._read("the listing", lambda: client.listing(
                self.attempt, wait_s=wait_s, known=self._tag))
        except RelayNotFound:
            return []
        self._tag = listing.get("tag")
        return list(listing["payloads"])

    def fetch(self, pid: tuple[int, int]) -> bytes:
        client = self._relay.client
        return bytes(self._read(f"payload {pid}",
                                lambda: client.get_payload(self.attempt, *pid)))

    def manifest(self) -> Manifest | None:
        client = self._relay.client
        try:
            data = self._read("the manifest", lambda: client.get_manifest(self.attempt))
        except RelayNotFound:
            return None
        return Manifest.parse(data, f"{self.url} attempt {self.attempt}", self.limits)

    def close(self) -> None:
        self._relay.close()
