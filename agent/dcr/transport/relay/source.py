"""A relay node as a receive source (:mod:`dcr.transport.receive`), for sync callers.

The receive loop is synchronous (threads fetch, the caller applies); the relay client
is asyncio. This facade runs the client on its own event loop thread. Each owner's manifest
part is served on its own (a :class:`~dcr.transport.receive.PartSource`), so one owner's
payloads are staged while the others' still stream, and the whole manifest is their merge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dcr.errors import RelayError, RelayNotFound
from dcr.format.manifest import DEFAULT_MANIFEST_LIMITS, Manifest, ManifestLimits
from dcr.transport.receive import whole_manifest
from dcr.transport.relay.client import BlockingRelay
from dcr.transport.relay.wire import MAX_LIST_WAIT_S
from dcr.versions import RELAY_WIRE

log = logging.getLogger(__name__)
T = TypeVar("T")

# Waits between tries of a read that reached no node (refused, reset, timed out): a node
# behind a Service that died is out of its endpoints within seconds, and a retry then
# reaches another node, which holds the same payloads. A node that answered is believed.
READ_RETRY_S = (0.25, 0.5, 1.0, 2.0, 4.0)


class RelaySource:
    """The payloads and manifest parts of one attempt of ``owners``, as one relay node
    holds them."""

    def __init__(self, url: str, token: str, attempt: str,
                 limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS, owners: int = 1) -> None:
        self.url, self.attempt, self.limits, self.owners = url, attempt, limits, owners
        self._relay = BlockingRelay(url, token, name="relay-source")
        self._tag: str | None = None  # of the last listing seen
        self._parts: set[int] | None = None  # owners whose part the last listing showed

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
        RELAY_WIRE.check(f"The listing of relay node {self.url}", listing.get("wire", 1),
                         RelayError)
        self._tag = listing.get("tag")
        self._parts = {int(m["owner"]) for m in listing["manifests"]}
        return list(listing["payloads"])

    def fetch(self, pid: tuple[int, int]) -> bytes:
        client = self._relay.client
        return bytes(self._read(f"payload {pid}",
                                lambda: client.get_payload(self.attempt, *pid)))

    def manifest(self) -> Manifest | None:
        """Every owner's part merged, or None while one is missing."""
        return whole_manifest(self, self.owners, f"{self.url} attempt {self.attempt}")

    def manifest_part(self, owner: int) -> Manifest | None:
        """Owner ``owner``'s part, or None while the last listing did not show it."""
        if self._parts is not None and owner not in self._parts:
            return None
        client = self._relay.client
        try:
            data = self._read(f"owner {owner}'s manifest part",
                              lambda: client.get_manifest(self.attempt, owner))
        except RelayNotFound:
            return None
        where = f"{self.url} attempt {self.attempt} owner {owner}"
        part = Manifest.parse(data, where, self.limits)
        return part if part.attempt == self.attempt else None

    def close(self) -> None:
        self._relay.close()
