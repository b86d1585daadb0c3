"""Receiving an attempt while it is still being sent: fetch, verify, stage, in order.

A receiver knows the attempt it is in (the protocol's ``prepare`` tells it). It polls
its source (an object store prefix, or its relay node) for payloads of that attempt,
fetches a bounded window of them concurrently, verifies each (digest and header ids)
as it lands, and hands the verified payloads to ``stage`` one at a time, each owner's
payloads in ``seq`` order, while later payloads are still arriving. ``stage`` gets the
verified :class:`~dcr.format.payload.Payload` itself, so whoever applies it later
(the receiver's apply thread, through :meth:`dcr.apply.engine.ApplyEngine.apply_payloads`)
does not parse it again; a simple caller may apply it at once. The manifest, written
last, closes the attempt: once it is present and every payload it lists has been
staged (and none it does not list), the call returns it. Payload items are disjoint,
so the interleaving of owners does not change the result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from dcr.errors import DcrError, ManifestError, ObjectNotFound
from dcr.format.layout import (
    attempt_prefix,
    manifest_key,
    owner_manifest_key,
    parse_payload_key,
    payload_key,
)
from dcr.format.manifest import Manifest, merge_manifests
from dcr.format.names import object_digest
from dcr.format.payload import Payload, read_payload
from dcr.transport.store import Store

PayloadId = tuple[int, int]  # (owner, seq)


class ReceiveStopped(DcrError):
    """The receiver was told to stop (its attempt became obsolete)."""



class Source(Protocol):
    def available(self) -> list[PayloadId]:
        """Ids of the attempt's payloads that can be fetched now."""
        ...

    def fetch(self, pid: PayloadId) -> bytes: ...

    def manifest(self) -> Manifest | None:
        """The attempt's manifest, or None while it has not been written."""
        ...


@dataclass(frozen=True, kw_only=True)
class StoreSource:
    """An attempt's objects in a store, at the keys :mod:`dcr.format.layout` gives.

    Protocol owners write their manifest parts under the attempt; the manifest is
    present once every owner wrote its part. A single owner's manifest may also be the
    file-level one at the version (``dcr diff``), if it names this attempt.
    """

    store: Store
    version: int
    attempt: str
    owners: int = 1

    @property
    def _prefix(self) -> str:
        return attempt_prefix(self.version, self.attempt)

    def available(self) -> list[PayloadId]:
        out = []
        for key in self.store.list(self._prefix):
            k = parse_payload_key(key)
            if k is not None and (k.version, k.attempt) == (self.version, self.attempt):
                out.append((k.owner, k.seq))
        return out

    def fetch(self, pid: PayloadId) -> bytes:
        return self.store.get(payload_key(self.version, self.attempt, *pid))

    def manifest(self) -> Manifest | None:
        if self.owners == 1:  # the attempt's own part, else the file-level version manifest
            m = self._part(owner_manifest_key(self.version, self.attempt, 0))
            if m is None:
                m = self._part(manifest_key(self.version))
            return m if m is not None and m.attempt == self.attempt else None
        parts = []
        for owner in range(self.owners):
            part = self._part(owner_manifest_key(self.version, self.attempt, owner))
            if part is None:
                return None
            parts.append(part)
        return merge_manifests(parts, f"{self.store.uri}/{self._prefix}")

    def _part(self, key: str) -> Manifest | None:
        try:
            return Manifest.parse(self.store.get(key), f"{self.store.uri}/{key}")
        except ObjectNotFound:
            return None


def receive(
    source: Source,
    attempt: str,
    stage: Callable[[Payload], None],
    *,
    window: int = 4,
    poll_s: float = 0.01,
    timeout_s: float = 600.0,
    stop: threading.Event | None = None,
) -> Manifest:
    """Stage every payload of ``attempt`` as it arrives; return the closing manifest.

    ``stage`` is called with each verified payload, in order (see the module docstring).
    ``window`` bounds the payloads fetched but not yet staged (back-pressure toward the
    source; ``stage`` may block to push back further). Raises :class:`ManifestError` if
    the manifest disagrees with what arrived, or if ``timeout_s`` passes first, and
    :class:`ReceiveStopped` once ``stop`` is set (between payloads: a ``stage`` call in
    progress always finishes).
    """
    deadline = time.monotonic() + timeout_s
    pending: dict[PayloadId, Future[Payload]] = {}
    applied: set[PayloadId] = set()
    objects: dict[PayloadId, tuple[int, str]] = {}  # size and object digest of what was staged
    next_seq: dict[int, int] = {}
    with ThreadPoolExecutor(window) as pool:
        while True:
            if stop is not None and stop.is_set():
                for f in pending.values():
                    f.cancel()
                raise ReceiveStopped(f"Attempt {attempt}: stopped after {len(applied)} payloads.")
            seen = sorted(set(source.available()) - applied - set(pending))
            for pid in seen[: max(0, window - len(pending))]:
                pending[pid] = pool.submit(_fetch_verified, source, pid, attempt)
            progressed = False
            for pid in sorted(pending):
                owner, seq = pid
                if seq != next_seq.get(owner, 0) or not pending[pid].done():
                    continue
                payload = pending.pop(pid).result()
                stage(payload)
                applied.add(pid)
                objects[pid] = (payload.size, object_digest(payload.data))
                next_seq[owner] = seq + 1
                progressed = True
            manifest = source.manifest() if not pending else None
            if manifest is not None:
                listed = {(e.owner, e.seq) for e in manifest.payloads}
                if listed <= applied:
                    if applied != listed:
                        raise ManifestError(
                            f"Attempt {attempt}: applied payloads {sorted(applied - listed)} "
                            "that its manifest does not list."
                        )
                    _check_objects(attempt, manifest, objects)
                    return manifest
            if time.monotonic() > deadline:
                raise ManifestError(
                    f"Attempt {attempt}: not complete after {timeout_s} s "
                    f"({len(applied)} payloads applied, manifest "
                    f"{'present' if manifest else 'missing'})."
                )
            if not progressed:
                time.sleep(poll_s)


def _check_objects(attempt: str, manifest: Manifest,
                   objects: dict[PayloadId, tuple[int, str]]) -> None:
    """Every applied object is the one the manifest lists (size and digest), not merely one
    with the same id (an owner that published the same attempt twice, differently)."""
    for e in manifest.payloads:
        got = objects[(e.owner, e.seq)]
        if got != (e.size, e.digest):
            raise ManifestError(
                f"Attempt {attempt}: payload o{e.owner}/s{e.seq} applied as {got[0]} bytes, "
                f"digest {got[1]}; the manifest lists {e.size} bytes, digest {e.digest}."
            )


def _fetch_verified(source: Source, pid: PayloadId, attempt: str) -> Payload:
    payload = read_payload(source.fetch(pid))
    h = payload.header
    if (h.attempt, h.owner, h.seq) != (attempt, *pid):
        raise ManifestError(
            f"Payload {pid} of {attempt} says attempt {h.attempt}, owner {h.owner}, "
            f"seq {h.seq}."
        )
    return payload
