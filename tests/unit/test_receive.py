"""Receiving an attempt while it is being sent: order, completion, and refusals."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pytest

import dcr.transport.receive as rx
from dcr.checkpoint import ArrayCheckpoint
from dcr.errors import DigestMismatch, ManifestError
from dcr.format.layout import manifest_key, owner_manifest_key, parse_payload_key, payload_key
from dcr.format.manifest import DEFAULT_MANIFEST_LIMITS, Manifest
from dcr.format.payload import Payload
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.transport.receive import StoreSource, receive
from dcr.transport.store import MemoryStore

if TYPE_CHECKING:
    from dcr.transport.receive import PayloadId, Release


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
        target_version=1, base_version=0, attempt=attempt, bucket_bytes=1 << 20))
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


@pytest.mark.parametrize(("damage", "needle"), [
    ("truncated", r"truncated or padded: \d+ bytes, but its preamble declares \d+"),
    ("flipped", r"digest mismatch \(expected [0-9a-f]{32}, got [0-9a-f]{32}\)"),
    ("version-1-json", r"magic is b'\{.*' \(a version 1 manifest, plain JSON\)"),
    ("bomb", r"declares 268435457 bytes of JSON, over the limit of 268435456"),
])
def test_a_hostile_manifest_fails_the_receive_and_nothing_is_applied(damage: str,
                                                                     needle: str) -> None:
    """Every payload arrived intact; the manifest that would vouch for them is truncated,
    corrupted, of version 1's encoding, or declares a decompression bomb."""
    _, objects = published()
    good = objects[manifest_key(1)]
    bad = bytearray(good)
    if damage == "truncated":
        del bad[-1]
    elif damage == "flipped":
        bad[-1] ^= 1
    elif damage == "version-1-json":
        bad = bytearray(Manifest.parse(good, "t").model_dump_json(indent=1).encode())
    else:  # a preamble that declares more JSON than the limit, its digest made good
        bad[16:20] = (DEFAULT_MANIFEST_LIMITS.max_json_bytes + 1).to_bytes(4, "little")
        bad[24:40] = hashlib.blake2b(bytes(bad[:24] + bad[40:]), digest_size=16,
                                     person=b"dcr-manifest-v2").digest()
    objects[manifest_key(1)] = bytes(bad)
    live = MemoryStore()
    trickle(live, objects, delay=0.0).join()
    applied: list[Payload] = []
    with pytest.raises(ManifestError, match=needle):
        receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1", applied.append,
                release="when_listed")  # as an agent receives
    assert applied == []


# --- what an agent stages: only what its owner's manifest part lists -------------------


Seal = Callable[..., bytes]


def forged(sealed_xor: Seal, attempt: str, owner: int, seq: int) -> bytes:
    """A well-formed payload whose ids match its key, which no owner wrote: XOR masks for
    every thousandth element of ``t0``."""
    base = np.zeros(600_000, dtype=np.uint16)
    target = base.copy()
    target[::1000] = 1
    return sealed_xor(attempt, owner, seq, "t0", base, target)


@dataclass(frozen=True, kw_only=True)
class Counting(StoreSource):
    fetched: list[PayloadId] = field(default_factory=list)

    def fetch(self, pid: PayloadId) -> bytes:
        self.fetched.append(pid)
        return super().fetch(pid)


def test_a_payload_is_staged_only_once_its_owners_manifest_part_lists_it() -> None:
    """Fails on 5b0b0ae, which staged (and an agent applied) each payload on arrival,
    before any manifest vouched for it, and had no ``release``."""
    _, objects = published()
    live = MemoryStore()
    sender = trickle(live, objects, delay=0.02)
    listed_at_stage: list[bool] = []
    manifest = receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1",
                       lambda p: listed_at_stage.append(live.exists(manifest_key(1))),
                       release="when_listed")
    sender.join()
    assert len(listed_at_stage) == len(manifest.payloads) >= 3
    assert all(listed_at_stage)


def test_one_owners_payloads_are_staged_while_another_owner_still_streams() -> None:
    """Pipelining kept where it is safe: owner 0's part vouches for owner 0's payloads."""
    rng = np.random.default_rng(1)
    base = {f"t{i}": rng.integers(0, 2**16, 300_000, dtype=np.uint16) for i in range(8)}
    target = {n: b ^ 1 for n, b in base.items()}
    src = {k: ArrayCheckpoint({n: ("BF16", (a.size,), a) for n, a in d.items()})
           for k, d in (("b", base), ("t", target))}
    full = MemoryStore()
    for owner in range(2):
        diff_checkpoints(src["b"], src["t"], full, EncodeSettings(
            target_version=1, base_version=0, attempt="a-2", owner=owner, owners=2,
            bucket_bytes=1 << 20))
    ids = sorted(p for p in map(parse_payload_key, full.objects) if p is not None)

    live = MemoryStore()
    seen: list[tuple[int, int]] = []
    first = threading.Event()

    def stage(p: Payload) -> None:
        seen.append((p.header.owner, p.header.seq))
        first.set()

    receiver = threading.Thread(target=receive, args=(
        StoreSource(store=live, version=1, attempt="a-2", owners=2), "a-2", stage),
        kwargs={"owners": 2, "release": "when_listed", "timeout_s": 30})
    receiver.start()
    for owner in range(2):  # all of owner 0, then all of owner 1
        keys = [payload_key(*p) for p in ids if p.owner == owner]
        for k in [*keys, owner_manifest_key(1, "a-2", owner)]:
            live.put(k, full.objects[k])
        if owner == 0:
            assert first.wait(30)  # staged while owner 1 has written nothing
            assert seen[0] == (0, 0)
    receiver.join(30)
    assert seen == [(p.owner, p.seq) for p in ids]
    assert {owner for owner, _ in seen} == {0, 1}


def test_an_object_the_manifest_does_not_list_is_never_staged(sealed_xor: Seal) -> None:
    """A well-formed payload at the owner's next seq, written before the manifest: it is
    dropped when the manifest arrives. Fails on 5b0b0ae, which staged it (the attempt
    then failed, and an overwrite retry left the bits it had applied)."""
    _, objects = published()
    n = sum(k.endswith(".dcrp") for k in objects)
    live = MemoryStore()
    live.put(payload_key(1, "a-1", 0, n), forged(sealed_xor, "a-1", 0, n))
    trickle(live, objects, delay=0.0).join()
    got: list[tuple[int, int]] = []
    manifest = receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1",
                       lambda p: got.append((p.header.owner, p.header.seq)),
                       release="when_listed")
    assert got == [(e.owner, e.seq) for e in manifest.payloads]
    assert (0, n) not in got


def test_a_listed_payload_with_other_bytes_is_refused_before_it_is_staged(
        sealed_xor: Seal) -> None:
    """A well-formed payload with the right ids but not the bytes the manifest lists.
    Fails on 5b0b0ae, which staged it and compared only once everything had arrived."""
    _, objects = published()
    key = sorted(k for k in objects if k.endswith(".dcrp"))[1]
    objects[key] = forged(sealed_xor, "a-1", 0, 1)
    live = MemoryStore()
    trickle(live, objects, delay=0.0).join()
    got: list[int] = []
    with pytest.raises(rx.ForeignPayload, match=r"o0/s1 arrived as \d+ bytes, digest "
                                             r"[0-9a-f]{32}; the manifest lists"):
        receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1",
                lambda p: got.append(p.header.seq), release="when_listed")
    assert got == [0]


@pytest.mark.parametrize("release", ["on_arrival", "when_listed"])
def test_payloads_of_owners_outside_the_attempt_are_never_fetched(
        release: Release, sealed_xor: Seal) -> None:
    """Fails on 5b0b0ae, which fetched and staged owner 1's payload in a one-owner attempt."""
    _, objects = published()
    live = MemoryStore()
    live.put(payload_key(1, "a-1", 1, 0), forged(sealed_xor, "a-1", 1, 0))
    trickle(live, objects, delay=0.0).join()
    source = Counting(store=live, version=1, attempt="a-1")
    got: list[int] = []
    manifest = receive(source, "a-1", lambda p: got.append(p.header.owner), release=release)
    assert got == [0] * len(manifest.payloads)
    assert {owner for owner, _ in source.fetched} == {0}


# --- what a poll asks the store: LIST decides when to GET ---------------------------


class Logged(MemoryStore):
    """A memory store that logs every LIST (with what it showed) and every GET, as a
    remote store would count round trips; ``hides`` keeps keys out of LIST results (a
    LIST that lags behind the writes)."""

    def __init__(self, hides: Callable[[str], bool] = lambda key: False) -> None:
        super().__init__()
        self.hides = hides
        self.log: list[tuple[str, str | frozenset[str]]] = []
        self.missed: list[str] = []

    def list(self, prefix: str) -> list[str]:
        keys = [k for k in super().list(prefix) if not self.hides(k)]
        self.log.append(("LIST", frozenset(keys)))
        return keys

    def get(self, key: str) -> bytes:
        self.log.append(("GET", key))
        if key not in self.objects:
            self.missed.append(key)
        return super().get(key)

    def gets_unlisted(self) -> list[str]:
        """Keys fetched that the LIST before the fetch did not show."""
        shown: frozenset[str] = frozenset()
        out = []
        for op, arg in self.log:
            if op == "LIST":
                assert isinstance(arg, frozenset)
                shown = arg
            elif arg not in shown:
                assert isinstance(arg, str)
                out.append(arg)
        return out


def test_an_idle_poll_gets_no_manifest_that_no_list_showed() -> None:
    """Over a WAN each request is a round trip: before, every idle poll asked for the
    owner's part and the version manifest (two misses) besides its LIST. The manifest,
    written last, is still found, and every object is fetched once."""
    _, objects = published()
    live = Logged()
    sender = trickle(live, objects, delay=0.02)
    manifest = receive(StoreSource(store=live, version=1, attempt="a-1", probe_s=3600),
                       "a-1", lambda p: None, release="when_listed", timeout_s=30)
    sender.join()
    gets = [arg for op, arg in live.log if op == "GET"]
    assert live.missed == []
    assert live.gets_unlisted() == []
    assert sorted(gets) == sorted([e.key for e in manifest.payloads] + [manifest_key(1)])


def test_several_owners_parts_are_fetched_only_once_listed() -> None:
    rng = np.random.default_rng(2)
    base = {f"t{i}": rng.integers(0, 2**16, 200_000, dtype=np.uint16) for i in range(6)}
    target = {n: b ^ 1 for n, b in base.items()}
    src = {k: ArrayCheckpoint({n: ("BF16", (a.size,), a) for n, a in d.items()})
           for k, d in (("b", base), ("t", target))}
    full = MemoryStore()
    for owner in range(2):
        diff_checkpoints(src["b"], src["t"], full, EncodeSettings(
            target_version=1, base_version=0, attempt="a-2", owner=owner, owners=2,
            bucket_bytes=1 << 20))
    live = Logged()

    def send() -> None:
        for key in [*sorted(k for k in full.objects if k.endswith(".dcrp")),
                    owner_manifest_key(1, "a-2", 1), owner_manifest_key(1, "a-2", 0)]:
            time.sleep(0.01)
            live.put(key, full.objects[key])

    sender = threading.Thread(target=send)
    sender.start()
    manifest = receive(StoreSource(store=live, version=1, attempt="a-2", owners=2,
                                   probe_s=3600),
                       "a-2", lambda p: None, owners=2, release="when_listed", timeout_s=30)
    sender.join()
    assert {e.owner for e in manifest.payloads} == {0, 1}
    assert live.missed == []
    assert live.gets_unlisted() == []


@pytest.mark.parametrize("lag", ["never-listed", "listed-late"])
def test_a_manifest_that_list_does_not_show_is_still_found(lag: str) -> None:
    """A store whose LIST lags behind its writes (S3 itself lists strongly, but not every
    S3-compatible store need): the manifest is fetched unlisted, at most once per
    ``probe_s``, so the refit completes instead of waiting for the LIST."""
    _, objects = published()
    hidden_lists = 0

    def hides(key: str) -> bool:
        nonlocal hidden_lists
        if not key.endswith(".dcrm"):
            return False
        hidden_lists += 1
        return lag == "never-listed" or hidden_lists < 50

    live = Logged(hides)
    trickle(live, objects, delay=0.0).join()
    manifest = receive(StoreSource(store=live, version=1, attempt="a-1", probe_s=0.05),
                       "a-1", lambda p: None, release="when_listed", timeout_s=60)
    assert manifest == Manifest.parse(objects[manifest_key(1)], "t")
    assert all(k.endswith(".dcrm") for k in live.gets_unlisted())


@dataclass(frozen=True, kw_only=True)
class Waiting(StoreSource):
    """A source whose objects arrive only while the receiver waits for a change, as a
    relay node's long poll sees them: one more object per wait."""

    arrivals: list[tuple[str, bytes]] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)

    def wait_for_change(self, timeout_s: float) -> None:
        self.waits.append(timeout_s)
        if self.arrivals:
            self.store.put(*self.arrivals.pop(0))


def test_an_idle_receiver_waits_on_a_waiting_source_instead_of_polling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, objects = published()
    keys = [*sorted(k for k in objects if k.endswith(".dcrp")), manifest_key(1)]
    source = Waiting(store=MemoryStore(), version=1, attempt="a-1",
                     arrivals=[(k, objects[k]) for k in keys])

    def no_sleep(s: float) -> None:
        raise AssertionError(f"the receive loop slept {s} s instead of waiting for a change")

    monkeypatch.setattr(rx.time, "sleep", no_sleep)
    seen: list[tuple[int, int]] = []
    manifest = receive(source, "a-1", lambda p: seen.append((p.header.owner, p.header.seq)),
                       idle_wait_s=0.5)
    assert seen == [(e.owner, e.seq) for e in manifest.payloads]
    assert len(source.waits) >= len(keys)  # every arrival came during a wait
    assert all(0 < w <= 0.5 for w in source.waits)


def test_payloads_listed_once_are_fetched_without_listing_again() -> None:
    """A LIST showing many payloads is enough to fetch them all, a window at a time:
    before, the receiver listed again before every fetch, a round trip each, so at most
    about two fetches were ever in flight over a WAN."""
    _, objects = published()
    live = Logged()
    for key, data in objects.items():  # everything is there before the receiver looks
        live.put(key, data)
    payloads = [k for k in objects if k.endswith(".dcrp")]
    assert len(payloads) >= 6
    # One fetch at a time: a free slot then always finds a listed payload still to fetch,
    # so however long each fetch takes, nothing calls for another LIST.
    manifest = receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1",
                       lambda p: None, window=1, timeout_s=30)
    lists = [arg for op, arg in live.log if op == "LIST"]
    assert len(manifest.payloads) == len(payloads)
    assert len(lists) <= 2, f"{len(lists)} LISTs for {len(payloads)} payloads"


def test_a_receiver_waiting_for_its_owners_lists_the_store_ever_less_often() -> None:
    """Fails on 71d139e, whose first idle waits were 10 ms (about 27 LISTs in the first
    second, over 30 in the 1.5 s before anything is published here). Now the first wait is
    50 ms and each quiet one doubles: about 6 LISTs here (fewer on a busy machine), and
    still every payload and the manifest arrive."""
    _, objects = published()
    live = Logged()

    def late() -> None:
        time.sleep(1.5)
        trickle(live, objects, delay=0.0).join()

    sender = threading.Thread(target=late)
    sender.start()
    manifest = receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1",
                       lambda p: None, release="when_listed", timeout_s=60)
    sender.join()
    lists = [arg for op, arg in live.log if op == "LIST"]
    assert len(manifest.payloads) >= 6
    assert len(lists) <= 15, f"{len(lists)} LISTs while waiting 1.5 s"


class FakeTime:
    """Monotonic time that passes only when the receive loop sleeps, standing in for the
    ``time`` module receive.py reads; ``at`` holds actions to run once their second is
    reached (an owner publishing). No real second passes."""

    def __init__(self, at: list[tuple[float, Callable[[], None]]] | None = None) -> None:
        self.t = 0.0
        self.at = sorted(at or [], key=lambda a: a[0])
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float, wake: threading.Event | None = None) -> None:
        self.sleeps += 1
        end = self.t + max(seconds, 1e-3)  # a loop at its deadline still moves on
        while self.at and self.at[0][0] <= end:
            self.t = max(self.t, self.at[0][0])
            self.at.pop(0)[1]()
            if wake is not None and wake.is_set():
                return
        self.t = end

    now = monotonic  # as a receive Clock


def test_a_receiver_waiting_an_hour_for_its_owners_asks_the_store_about_1200_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on 71d139e: an hour of waiting with nothing published cost 1,800 LISTs (one
    every 2 s) and 3,600 GETs that missed (the owner's part and the version manifest,
    each asked for again every 2 s). Now idle waits double up to 4 s (jittered down by up
    to a quarter) and a miss is asked again twice as late each time, up to a minute: at
    most 3,600 / 3 LISTs and about 130 misses. Counted on simulated time."""
    clock = FakeTime()
    monkeypatch.setattr(rx, "time", clock)
    live = Logged()
    with pytest.raises(ManifestError, match="not complete after 3600"):
        receive(StoreSource(store=live, version=1, attempt="a-1"), "a-1", lambda p: None,
                release="when_listed", timeout_s=3600)
    lists = sum(op == "LIST" for op, _ in live.log)
    assert lists <= 3600 / 3 + 20, f"{lists} LISTs in a simulated hour"
    assert len(live.missed) <= 150, f"{len(live.missed)} GETs missed in a simulated hour"


def test_a_payload_that_lands_after_a_long_wait_is_staged_within_one_idle_wait() -> None:
    """After ten simulated minutes of waiting, the first payload is staged at most
    ``max_poll_s`` after it lands; the rest follow, and the manifest completes the receive
    as soon as the coordinator's call after publishing sets ``wake``, even from a store
    whose LIST never shows the manifest."""
    _, objects = published()
    payloads = sorted(k for k in objects if k.endswith(".dcrp"))
    live = Logged(hides=lambda key: key.endswith(".dcrm"))
    wake = threading.Event()
    land, sealed = 600.0, 700.0

    def publish() -> None:
        for k in payloads:
            live.put(k, objects[k])

    def seal() -> None:
        live.put(manifest_key(1), objects[manifest_key(1)])
        wake.set()

    clock = FakeTime([(land, publish), (sealed, seal)])
    staged_at: list[float] = []
    source = StoreSource(store=live, version=1, attempt="a-1", clock=clock)
    manifest = receive(source, "a-1", lambda p: staged_at.append(clock.t),
                       release="on_arrival", timeout_s=3600, wake=wake, clock=clock)
    assert len(staged_at) == len(manifest.payloads) == len(payloads)
    assert land < staged_at[0] <= land + 4.0
    assert clock.t == sealed  # the manifest was read at once, no idle wait later


def test_a_stopped_receiver_stops_within_one_idle_wait() -> None:
    """An idle receiver sleeps on its stop event, so a stop ends even a 1,000 s wait
    at once (a plain sleep would hold the obsolete attempt's thread that long)."""
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(rx.ReceiveStopped):
        receive(StoreSource(store=MemoryStore(), version=1, attempt="a-1"), "a-1",
                lambda p: None, poll_s=1000, max_poll_s=1000, timeout_s=7200, stop=stop)
    assert time.monotonic() - started < 100
