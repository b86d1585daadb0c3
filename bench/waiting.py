"""Store requests of receivers waiting for their owners, and how late they see a payload.

N receivers (threads, each the agent's receive loop over a :class:`StoreSource`, sharing one
S3 client) wait on a real S3 server (``rclone serve s3``, tests/support/s3server.py) for an
attempt nothing has been published for yet. After ``--wait-s`` seconds one payload lands;
each receiver's delay from that PUT to staging the payload (``on_arrival``, so staging
waits for no manifest) is how late its loop noticed the arrival.
The rest of the attempt and its manifest follow and every receiver completes. Recorded per
N: LISTs, GETs and misses (404s) per receiver, split into the wait and the whole refit, and
the latency. The receive loop is whichever ``dcr`` is on the path, so the same script
measures another commit's loop (``PYTHONPATH=<its agent/> ...``); no wake is sent (the
agent's signal from the coordinator is not part of this loop's API everywhere).
Writes ``bench/results/waiting.json`` (``--label`` names the run inside it).

    .venv/bin/python bench/waiting.py [--receivers 10 100 1000] [--wait-s 30] [--label after]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from s3server import s3_server

from dcr.checkpoint import ArrayCheckpoint
from dcr.errors import ObjectNotFound
from dcr.format.layout import manifest_key
from dcr.format.payload import Payload
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.transport.receive import StoreSource, receive
from dcr.transport.store import MemoryStore, Store, open_store

RESULTS = Path(__file__).resolve().parent / "results" / "waiting.json"
ATTEMPT = "a-1"


class Counted:
    """A store that counts what one receiver asks of it: LIST, GET, and GETs that missed."""

    def __init__(self, store: Store) -> None:
        self.store, self.uri, self.n = store, store.uri, Counter[str]()

    def list(self, prefix: str) -> list[str]:
        self.n["list"] += 1
        return self.store.list(prefix)

    def get(self, key: str) -> bytes:
        self.n["get"] += 1
        try:
            return self.store.get(key)
        except ObjectNotFound:
            self.n["miss"] += 1
            raise

    def put(self, key: str, data: bytes) -> None:
        self.store.put(key, data)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)


def attempt_objects() -> dict[str, bytes]:
    """A small version 1 (a few payloads and the manifest), as an owner writes it."""
    rng = np.random.default_rng(0)
    base = {f"t{i}": rng.integers(0, 2**16, 600_000, dtype=np.uint16) for i in range(6)}
    target = {n: a ^ np.uint16(1) for n, a in base.items()}
    src = {k: ArrayCheckpoint({n: ("BF16", (a.size,), a) for n, a in d.items()})
           for k, d in (("b", base), ("t", target))}
    mem = MemoryStore()
    diff_checkpoints(src["b"], src["t"], mem, EncodeSettings(
        target_version=1, base_version=0, attempt=ATTEMPT, bucket_bytes=1 << 20))
    return dict(mem.objects)


def one_run(n: int, wait_s: float, prefix: str, objects: dict[str, bytes]) -> dict[str, Any]:
    shared = open_store(prefix)
    owner = open_store(prefix)
    stores = [Counted(shared) for _ in range(n)]
    first_staged: list[float | None] = [None] * n
    done, errors = [False] * n, [""] * n

    def run(i: int) -> None:
        def stage(p: Payload) -> None:
            if first_staged[i] is None:
                first_staged[i] = time.monotonic()
        try:
            receive(StoreSource(store=stores[i], version=1, attempt=ATTEMPT), ATTEMPT, stage,
                    release="on_arrival", timeout_s=wait_s + 600)
            done[i] = True
        except Exception as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(wait_s)
    waiting = [dict(s.n) for s in stores]
    payloads = sorted(k for k in objects if k.endswith(".dcrp"))
    owner.put(payloads[0], objects[payloads[0]])
    landed = time.monotonic()
    while any(f is None for f in first_staged) and time.monotonic() < landed + 120:
        time.sleep(0.01)
    for k in [*payloads[1:], manifest_key(1)]:
        owner.put(k, objects[k])
    for t in threads:
        t.join(timeout=600)
    lat = [f - landed for f in first_staged if f is not None]
    per = {kind: [w.get(kind, 0) for w in waiting] for kind in ("list", "get", "miss")}
    total = {kind: [s.n[kind] for s in stores] for kind in ("list", "get", "miss")}
    return {
        "receivers": n, "wait_s": wait_s, "completed": sum(done),
        "errors": sorted({e for e in errors if e})[:3],
        "waiting_per_receiver": {k: round(statistics.mean(v), 1) for k, v in per.items()},
        "waiting_per_receiver_per_s": {k: round(statistics.mean(v) / wait_s, 3)
                                       for k, v in per.items()},
        "refit_per_receiver": {k: round(statistics.mean(v), 1) for k, v in total.items()},
        "first_payload_staged_after_s": {
            "median": round(statistics.median(lat), 3) if lat else None,
            "max": round(max(lat), 3) if lat else None},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--receivers", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--wait-s", type=float, default=30.0)
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    objects = attempt_objects()
    runs = []
    with tempfile.TemporaryDirectory(prefix="dcr-waiting-") as tmp, \
            s3_server(Path(tmp)) as s3:
        os.environ.update({"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": s3.access_key,
                           "AWS_SECRET_ACCESS_KEY": s3.secret_key,
                           "AWS_DEFAULT_REGION": s3.region})
        for n in args.receivers:
            r = one_run(n, args.wait_s, f"s3://{s3.bucket}/n{n}", objects)
            runs.append(r)
            print(json.dumps(r), flush=True)
    old: dict[str, Any] = (json.loads(args.out.read_text()) if args.out.exists()
                           else {"bench": "waiting"})
    old.setdefault("runs", {})[args.label] = {
        "machine": {"cpus": len(os.sched_getaffinity(0))}, "runs": runs,
        "command": " ".join(["bench/waiting.py", *sys.argv[1:]])}
    args.out.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
