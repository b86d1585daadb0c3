"""A small model still travels as several payloads, so a receiver starts on the first one
while the owner encodes the next (with one payload, encode, transfer and apply run one
after another); a bucket is never cut below 16 MiB, and never above ``bucket_bytes``."""

from __future__ import annotations

import threading

import numpy as np

from dcr.checkpoint import ArrayCheckpoint
from dcr.format.layout import manifest_key
from dcr.owner.diff import PIPELINE_FLOOR, bucket_limit, diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.settings import MiB
from dcr.transport.store import MemoryStore


def settings(**kw: int) -> EncodeSettings:
    return EncodeSettings(target_version=1, base_version=0, **kw)


def test_bucket_limit_cuts_small_models_into_min_payloads_but_not_below_the_floor() -> None:
    s = settings()
    assert s.min_payloads == 16
    assert bucket_limit(16 * 1024 * MiB, s) == s.bucket_bytes == 256 * MiB  # large: as set
    assert bucket_limit(1024 * MiB, s) == 64 * MiB  # 1 GiB: 16 payloads
    assert bucket_limit(256 * MiB, s) == PIPELINE_FLOOR == 16 * MiB
    assert bucket_limit(8 * MiB, s) == PIPELINE_FLOOR  # one payload: below the floor
    assert bucket_limit(1024 * MiB, settings(bucket_bytes=MiB)) == MiB  # never above the set
    assert bucket_limit(1024 * MiB, settings(min_payloads=1)) == 256 * MiB


def test_a_48_mib_model_travels_as_three_payloads_and_decodes_to_the_target() -> None:
    rng = np.random.default_rng(0)
    base = {f"t{i}": rng.integers(0, 2**16, 4 * MiB, dtype=np.uint16) for i in range(6)}
    target = {n: b.copy() for n, b in base.items()}
    for t in target.values():
        t[::97] ^= 1
    src = {k: ArrayCheckpoint({n: ("BF16", (a.size,), a) for n, a in d.items()})
           for k, d in (("b", base), ("t", target))}
    manifest = diff_checkpoints(src["b"], src["t"], MemoryStore(), settings())
    assert len(manifest.payloads) == 3  # 6 tensors of 8 MiB in buckets of 16 MiB
    assert manifest.stats.changed_elements == sum(-(-b.size // 97) for b in base.values())


class Overlapping(MemoryStore):
    """A store whose payload puts each wait (up to 20 s) for another put to be in flight,
    as puts that cost a round trip each would overlap; it records the order of puts."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.inflight = 0
        self.most = 0
        self.order: list[str] = []
        self.company = threading.Event()

    def put(self, key: str, data: bytes) -> None:
        with self.lock:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            if self.inflight > 1:
                self.company.set()
        if key.endswith(".dcrp"):
            self.company.wait(20)
        super().put(key, data)
        with self.lock:
            self.inflight -= 1
            self.order.append(key)


def test_payload_uploads_overlap_and_the_manifest_goes_last() -> None:
    rng = np.random.default_rng(1)
    base = {f"t{i}": rng.integers(0, 2**16, 4 * MiB, dtype=np.uint16) for i in range(8)}
    target = {n: b ^ (rng.random(b.size) < 0.01).astype(np.uint16) for n, b in base.items()}
    src = {k: ArrayCheckpoint({n: ("BF16", (a.size,), a) for n, a in d.items()})
           for k, d in (("b", base), ("t", target))}
    store = Overlapping()
    manifest = diff_checkpoints(src["b"], src["t"], store, settings())
    assert store.most >= 2  # puts overlapped instead of one round trip after another
    assert store.order[-1] == manifest_key(1)
    assert [e.seq for e in manifest.payloads] == list(range(4))
    assert sorted(store.order[:-1]) == sorted(e.key for e in manifest.payloads)
