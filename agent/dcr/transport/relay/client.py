"""The client of one relay node, used by owners, receivers and the nodes themselves."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from dcr.errors import ConfigError, RelayError, RelayNotFound
from dcr.http.direct import unreachable_reason
from dcr.http.tls import aiohttp_options, check_peer_url
from dcr.transport.relay.settings import MiB
from dcr.transport.relay.wire import WIRE, Chunk, Key, Pieces

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class StagedPayload:
    """One payload a relay holds, as ``GET /v1/attempts/{attempt}/payloads`` lists it."""

    attempt: str
    owner: int
    seq: int
    size: int
    digest: str  # BLAKE2b-128 of the whole object, hex (the manifest's digest)


class RelayClient:
    """Talks to one relay node. Use ``async with RelayClient(url, token) as c: ...``.

    Every method raises :class:`RelayError` (with the HTTP status when there was an
    answer) and :class:`RelayNotFound` for 404. A shared ``session`` is not closed here.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        session: aiohttp.ClientSession | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = 60.0,  # per read; None for long quiet uploads
    ) -> None:
        self.base_url = check_peer_url(base_url.rstrip("/"), "Relay")
        self._auth = {"Authorization": f"Bearer {token}"}
        self._session = session
        self._owns_session = session is None
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )

    async def __aenter__(self) -> RelayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        *,
        data: bytes | AsyncIterable[Chunk] | None = None,
        size: int | None = None,
        json_body: Any = None,
        auth: bool = True,
        timeout_s: float | None = None,
    ) -> bytes:
        headers = dict(self._auth) if auth else {}
        if isinstance(data, bytes):
            size = len(data)
            data = Pieces(data, MiB)
        if data is not None:
            headers["Content-Type"] = "application/octet-stream"
            headers["Content-Length"] = str(size)
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        url = self.base_url + path
        try:
            async with self._http().request(
                method, url, data=data, json=json_body, headers=headers, timeout=timeout,
                **aiohttp_options(url),
            ) as r:
                body = await r.read()
                status = r.status
        except aiohttp.ClientSSLError as e:
            raise RelayError(f"{method} {url} failed: {unreachable_reason(e)}.") from e
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise RelayError(f"{method} {url} failed: {e or type(e).__name__}.") from e
        if status < 300:
            return body
        try:
            reason = str(json.loads(body)["error"])
        except (ValueError, KeyError, TypeError):
            reason = body[:200].decode(errors="replace")
        cls = RelayNotFound if status == 404 else RelayError
        raise cls(f"{method} {url} answered {status}: {reason}", status)

    async def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(await self._call(method, path, **kw))
        return out

    async def put_payload(
        self,
        attempt: str,
        owner: int,
        seq: int,
        data: bytes | AsyncIterable[Chunk],
        *,
        size: int | None = None,
    ) -> str:
        """Upload one payload; ``size`` is required when ``data`` is a stream.

        Returns ``"queued"`` (201) or ``"duplicate"`` (200, already held, not forwarded).
        """
        if not isinstance(data, bytes) and size is None:
            raise ConfigError("put_payload needs size= when data is a stream.")
        path = Key(attempt, "payload", owner, seq).path
        return str((await self._json("PUT", path, data=data, size=size))["status"])

    async def put_blob(self, key: Key, data: AsyncIterable[Chunk], size: int) -> str:
        """Upload a payload or manifest from a stream (what nodes use to forward)."""
        return str((await self._json("PUT", key.path, data=data, size=size))["status"])

    async def list_payloads(self, attempt: str) -> list[StagedPayload]:
        listing = await self.listing(attempt)
        return [StagedPayload(attempt=attempt, **p) for p in listing["payloads"]]

    async def listing(self, attempt: str, *, wait_s: float = 0.0, known: str | None = None
                      ) -> dict[str, Any]:
        """The attempt's listing (payloads, manifest, tag). With ``wait_s``, the node
        answers once the tag differs from ``known`` or after ``wait_s`` seconds."""
        path = f"/v1/attempts/{attempt}/payloads"
        if not wait_s:
            return await self._json("GET", path)
        query = f"?wait_s={wait_s:g}" + (f"&known={known}" if known else "")
        return await self._json("GET", path + query, timeout_s=wait_s + 30.0)

    async def get_payload(self, attempt: str, owner: int, seq: int) -> bytes:
        return await self._call("GET", Key(attempt, "payload", owner, seq).path)

    async def put_manifest(self, attempt: str, data: bytes, owner: int = 0) -> str:
        """Upload owner ``owner``'s part of the attempt's manifest."""
        key = Key(attempt, "manifest", owner)
        return str((await self._json("PUT", key.path, data=data))["status"])

    async def get_manifest(self, attempt: str, owner: int = 0) -> bytes:
        """Owner ``owner``'s part of the attempt's manifest."""
        return await self._call("GET", Key(attempt, "manifest", owner).path)

    async def delete_attempt(self, attempt: str) -> int:
        """Drop an attempt here and below; returns how many blobs this node dropped."""
        return int((await self._json("DELETE", f"/v1/attempts/{attempt}"))["dropped"])

    async def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /healthz`` (no token): state, parent, children and staged bytes."""
        return await self._json("GET", "/healthz", auth=False, timeout_s=timeout_s)

    async def status(self) -> dict[str, Any]:
        """``GET /v1/status``: health plus counters and the blobs still arriving."""
        return await self._json("GET", "/v1/status")

    async def subscribe(
        self, index: int, held: dict[str, list[tuple[int, int]]],
        manifests: dict[str, list[int]],
    ) -> dict[str, Any]:
        """Ask this node to forward to member ``index`` and replay what it lacks
        (``manifests``: attempt -> owners whose manifest part member ``index`` holds)."""
        body = {"wire": WIRE, "index": index, "held": held, "manifests": manifests}
        return await self._json("POST", "/v1/subscribe", json_body=body)


class BlockingRelay:
    """A :class:`RelayClient` for synchronous callers: it runs on its own loop thread."""

    def __init__(self, url: str, token: str, *, name: str = "relay-client") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=name)
        self._thread.start()
        self.client = RelayClient(url, token)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run one client call to completion on the loop thread; its result or error."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        self.run(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
