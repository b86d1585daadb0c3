"""Receiving an attempt while it is being sent: order, completion, and refusals."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dcr.checkpoint import ArrayCheckpoint
from dcr.errors import DigestMismatch, ManifestError
from dcr.format.layout import manifest_key
from dcr.format.payload import Payload
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.transport.receive import StoreSource, receive
from dcr.transport.store import MemoryStore


def published(attempt: str = "a-1", stride: int = 37) -> tuple[MemoryStore, dict[str, bytes]]:
    """A version with several payloads (small buckets), as a sender would write it."""
    rng = np.random.default_rng(0)
    base = {f"t{i}": rng.integers(0, 2**16, 600_000, dtype=np.uint16) for i in range(6)}
    target = {n: b.copy() for n, b in base.items()}
    for t in target.values():
        t[::stride] ^= 1
    src = {k: ArrayCheckpoint({n: ("BF16", (a.size,), a) for n, a in d.items()})
           for k, d in (("b", base), ("t", target))}
    full = MemoryStore()
    diff_checkpoints(src["b"], src["t"], full, EncodeSettings(
        version=1, base_version=0, attempt=attempt, bucket_bytes=1 << 20))
    return full, dict(full.objects)


def trickle(dst: MemoryStore, objects: dict[str, bytes], delay: float) -> threading.Thread:
    """Write payloads one by one, the manifest last, like a streaming sender."""
    keys = [*sorted(k for k in objects if k.endswith(".dcrp")), manifest_key(1)]

    def run() -> None:
        for k in keys:
            time.sleep(delay)
            dst.put(k, objects[k])

    t = threading.Thread(target=run)
    t.start()
    return t


def test_payloads_are_applied_in_order_while_later_ones_arrive() -> None:
    _, objects = published()
    live = MemoryStore()
    sender = trickle(live, objects, delay=0.02)
    seen: list[tuple[int, int]] = []
    arrived_at_apply: list[int] = []

    def apply(p: Payload) -> None:
        seen.append((p.header.owner, p.header.seq))
        arrived_at_apply.append(len(live.objects))

    manifest = receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1", apply)
    sender.join()
    assert seen == sorted(seen) == [(e.owner, e.seq) for e in manifest.payloads]
    assert len(seen) >= 3
    assert arrived_at_apply[0] < len(objects)  # the first apply ran before the last arrival


def test_payloads_of_another_attempt_are_ignored() -> None:
    _, objects = published("a-1")
    _, stale = published("a-0")
    live = MemoryStore()
    for k, v in stale.items():
        if k.endswith(".dcrp"):
            live.put(k, v)
    trickle(live, objects, delay=0.0).join()
    got: list[str] = []
    receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1",
            lambda p: got.append(p.header.attempt))
    assert set(got) == {"a-1"}


def test_a_corrupted_payload_fails_the_receive() -> None:
    _, objects = published()
    key = sorted(k for k in objects if k.endswith(".dcrp"))[1]
    bad = bytearray(objects[key])
    bad[-1] ^= 1
    objects[key] = bytes(bad)
    live = MemoryStore()
    trickle(live, objects, delay=0.0).join()
    with pytest.raises(DigestMismatch):
        receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1", lambda p: None)


def test_a_missing_payload_times_out_naming_the_attempt() -> None:
    _, objects = published()
    key = sorted(k for k in objects if k.endswith(".dcrp"))[0]
    del objects[key]
    live = MemoryStore()
    for k, v in objects.items():
        live.put(k, v)
    with pytest.raises(ManifestError, match=r"a-1: not complete after 0\.3 s"):
        receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1", lambda p: None,
                timeout_s=0.3)


def test_payloads_that_are_not_the_ones_the_manifest_lists_fail_the_receive() -> None:
    """An owner that published the same attempt twice, differently: the ids match, the
    objects do not; the manifest's sizes and digests tell them apart."""
    _, first = published()
    _, second = published(stride=41)
    mixed = {k: v for k, v in first.items() if k.endswith(".dcrp")}
    mixed[manifest_key(1)] = second[manifest_key(1)]
    assert sorted(k for k in first if k.endswith(".dcrp")) == sorted(
        k for k in second if k.endswith(".dcrp"))
    live = MemoryStore()
    trickle(live, mixed, delay=0.0).join()
    with pytest.raises(ManifestError, match=r"applied as \d+ bytes, digest [0-9a-f]{32}; "
                                            r"the manifest lists \d+ bytes, digest"):
        receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1", lambda p: None)
