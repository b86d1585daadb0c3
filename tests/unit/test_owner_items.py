"""Owners never seal a payload with more items than a reader accepts.

A column-parallel shard costs one item per changed row, so a tall tensor can give one
bucket more than ``DEFAULT_LIMITS.max_items`` items; ``pack_payload`` refuses to seal
such a payload (every reader would refuse it), so the owners must start a new payload
first. Before they did, this publish failed with "over the item limit".
"""

from __future__ import annotations

import numpy as np

from dcr.format.payload import DEFAULT_LIMITS, read_payload
from dcr.owner.shards import ShardEncoder, ShardMap
from dcr.protocol.records import Attempt, Transition
from dcr.transport.store import MemoryStore


def test_a_shard_with_more_changed_rows_than_the_item_limit_spans_several_payloads() -> None:
    rows = DEFAULT_LIMITS.max_items + 100
    m = ShardMap(kind="columns", canonical=("w",), shape=(rows, 4), dtype="BF16",
                 rank=1, ranks=2)
    base = np.zeros((rows, 2), dtype=np.uint16)
    cand = base.copy()
    cand[:, 0] = 1  # every row changes: one item per row
    store = MemoryStore()
    enc = ShardEncoder(store=store, maps={"w": m}, baseline={"w": base}, version=0)
    enc.set_candidate({"w": cand}, 1)
    attempt = Attempt(transition=Transition(base_version=0, target_version=1), mode="mixed",
                      receivers=("r",), deadline=1e12)
    enc.publish(attempt)
    manifest = enc.manifests[-1]
    payloads = [read_payload(store.get(p.key)) for p in manifest.payloads]
    assert len(payloads) == 2
    assert all(len(p.header.items) <= DEFAULT_LIMITS.max_items for p in payloads)
    assert sum(len(p.header.items) for p in payloads) == rows
    assert manifest.stats.changed_elements == rows
