"""A pod that missed versions reaches the committed one, of a store fleet and of a relay
fleet, side by side.

The training side commits versions 1..N of a BF16 checkpoint (each a uniform ``--pct`` %
of elements moved by one ulp from the one before) for two fleets at once, each with its
own in-process encoder and store prefix on a real S3 server (``rclone serve s3``): a
store fleet, whose encoder publishes into the store, and a relay fleet, whose encoder
publishes through a real relay tree (``dcr relay`` processes: a root and a member)
written through to its store (``relay+http://root?through=s3://...``), with a receiver
reading each attempt from the member. Each fleet's history is in its store, with a
snapshot every ``--snapshot-every`` versions. A rollout pod that holds version N - m
(m = 1, 5, 20) then reaches N across an emulated link, all ways in one run:

* **replay**: the committed deltas after its version, patched into its copy in place;
* **snapshot**: the newest snapshot at or below N and the deltas after it;
* **mirror**: a copy of the rollout cluster's mirror (``dcr mirror``, kept at N on a local
  volume), checked against the history's fingerprints: only those cross the link;
* **peer**: the agent's own build (``FromStore.build`` given ``--donor``): a live peer's
  copy of N taken under a lease over loopback (inside the rollout cluster), checked against
  the history's fingerprints; the history and manifests cross the link;
* **full**: a download of version N's checkpoint;
* **rejoin**: the agent's own build without a donor (``FromStore.build``): its seed (the
  copy of N - m the engine started from, which it keeps) copied into its build, checked
  against the history's fingerprints and advanced by the deltas;
* **relay** and **relay-peer**: a relay fleet's pod, which does what its agent does (the
  relay nodes keep no history, so a rejoin reads its fleet's store): **rejoin** and
  **peer** from the relay fleet's store and with a donor of that fleet.

The mirror's own cost is measured too: its sync from N - 1 to N across the same link,
paid once per cluster and version, whatever the number of pods.

Each way gets a fresh link emulator, so the bytes that crossed it are its own; every
result is checked bit for bit against the training side's version N.

    .venv/bin/python bench/catchup.py                 # 1 GiB, 1%, 20 versions, 250 Mbit/s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import numpy as np

from dcr.checkpoint import ArrayCheckpoint, Checkpoint
from dcr.files.history import HistoryStore
from dcr.files.materialize import materialize
from dcr.files.mirror import CURRENT, sync
from dcr.files.snapshot import write_snapshot
from dcr.http.edge import start
from dcr.owner.encoder import Encoder
from dcr.protocol.records import Attempt, CommitRecord, Transition
from dcr.receiver.donor import Donor, Leases, peer_routes
from dcr.receiver.fromstore import FROM_STORE, FromStore
from dcr.receiver.peers import PeerClient
from dcr.transport.receive import receive
from dcr.transport.relay import RelaySource
from dcr.transport.relay.publish import RelayPublisher
from dcr.transport.s3 import S3Store
from transport import (
    BIN,
    KEY,
    PUBLISH_TOKEN,
    SECRET,
    TOKEN,
    Procs,
    free_port,
    link_bytes,
    start_link,
    start_relays,
    wait_http,
)

BUCKET = "catchup"
TENSORS = 64
CREDS = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
PEER_TOKEN = "bench-peer-read-token-0123456789"
FLEETS = {"store": "policy", "relay": "relay-policy"}  # each fleet's prefix in the bucket


def save(bits: dict[str, np.ndarray], path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({n: torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
               for n, b in bits.items()}, str(path / "model.safetensors"))


def step(bits: dict[str, np.ndarray], pct: float, rng: np.random.Generator
         ) -> dict[str, np.ndarray]:
    out = {}
    for n, b in bits.items():
        t = b.copy()
        t[np.flatnonzero(rng.random(b.size, dtype=np.float32) < pct / 100)] += 1
        out[n] = t
    return out


def source(bits: dict[str, np.ndarray]) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", (b.size,), b) for n, b in bits.items()})


def commit(owner: Encoder, history: HistoryStore, bits: dict[str, np.ndarray], v: int
           ) -> str:
    """Publish version ``v`` (from ``v - 1``) through ``owner`` and commit it in the
    store's history, as the coordinator would; the attempt id."""
    owner.set_candidate(source(bits), v)
    attempt = Attempt(transition=Transition(base_version=v - 1, target_version=v),
                      mode="mixed", receivers=("pod",), deadline=time.time() + 600)
    owner.publish(attempt)
    history.commit(v, attempt.id, 1)
    owner.advance_baseline(CommitRecord(committed_version=v, baseline_id=f"v{v}",
                                        attempt=attempt.id))
    return attempt.id


def lend(copy: Path) -> str:
    """Serve ``copy`` (a donor agent's build of a committed version) on the donor routes,
    from an event loop on a thread; its URL."""
    from aiohttp import web

    app = web.Application()
    app.add_routes(peer_routes(Donor("donor", copy, Leases(), lambda: None), PEER_TOKEN))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return asyncio.run_coroutine_threadsafe(start(app, "127.0.0.1:0", "the donor"),
                                            loop).result(30).url


def received(member: str, attempt: str) -> int:
    """Read ``attempt`` from a relay member as a relay fleet's agent does (every payload
    checked against the manifest's sizes and digests); the payload bytes."""
    got = 0

    def count(payload: Any) -> None:
        nonlocal got
        got += len(payload.data)

    src = RelaySource(member, TOKEN, attempt)
    try:
        receive(src, attempt, count)
    finally:
        src.close()
    return got


def bits_of(path: Path) -> dict[str, bytes]:
    with Checkpoint(path) as c:
        return {n: c.bits(n).tobytes() for n in c.names()}


WAYS = {"replay": "store", "snapshot": "store", "mirror": "store", "full": "store",
        "rejoin": "store", "peer": "store", "relay": "relay", "relay-peer": "relay"}
AGENT_WAYS = ("rejoin", "peer", "relay", "relay-peer")  # the agent's build, from its fleet


def s3(port: int, fleet: str) -> S3Store:
    """The fleet's store as a client reaching the S3 server (or a link to it) at ``port``."""
    return S3Store(f"s3://{BUCKET}/{FLEETS[fleet]}", endpoint=f"http://127.0.0.1:{port}",
                   region="us-east-1", credentials=CREDS)


def build(pod: S3Store, out: Path, seed: tuple[int, Path], last: int, donor: str | None
          ) -> dict[str, Any]:
    """What a pod's agent does to rejoin ``last`` holding ``seed``: ``FromStore.build``
    from its fleet's history, a donor asked first where given; how it went."""
    agent = FromStore(HistoryStore(pod), out, seed=seed,
                      peers=(PeerClient(donor, PEER_TOKEN),) if donor else ())
    _, done = agent.build(last)
    assert agent.peer_refusals == 0
    return {"route": "peer" if agent.peer_bytes else done.plan.route,
            "from": done.plan.start, "deltas": done.plan.steps,
            "fetched_bytes": done.fetched_bytes, "peer_bytes": agent.peer_bytes}


def catch_up(way: str, pod: S3Store, out: Path, held: int, last: int, work: Path,
             donors: dict[str, str]) -> dict[str, Any]:
    """Reach ``last`` in ``out`` from ``held`` by ``way``; how it went."""
    seed = (held, work / "train" / f"v{held}")
    if way == "full":
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(pod.get(f"full/v{last}/model.safetensors"))
        return {"route": "full"}
    if way in AGENT_WAYS:
        return build(pod, out, seed, last, donors.get(way))
    if way == "mirror":
        done = materialize(pod, out, seed=work / "mirror" / CURRENT)
        return {"route": "mirror", "from": done.plan.start, "deltas": 0,
                "fetched_bytes": done.fetched_bytes}
    done = materialize(pod, out, held=held if way == "replay" else None, route=way)
    return {"route": done.plan.route, "from": done.plan.start, "deltas": done.plan.steps,
            "planned_bytes": done.plan.fetch_bytes, "fetched_bytes": done.fetched_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--pct", type=float, default=1.0)
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--missed", default="1,5,20", help="versions the pod missed, each a run")
    ap.add_argument("--snapshot-every", type=int, default=8)
    ap.add_argument("--mbit", type=float, default=250.0)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/catchup.json"))
    args = ap.parse_args()
    last, missed = args.versions, [int(m) for m in args.missed.split(",")]
    keep = {last, last - 1} | {last - m for m in missed}  # the rollout side's files
    work = Path(tempfile.mkdtemp(prefix="dcr-catchup-"))
    procs = Procs()
    rows: list[dict[str, Any]] = []
    load_start = os.getloadavg()
    try:
        s3_port = free_port()
        (work / "s3" / BUCKET).mkdir(parents=True)
        procs.start([str(BIN / "rclone"), "serve", "s3", "--addr", f"127.0.0.1:{s3_port}",
                     "--auth-key", f"{KEY},{SECRET}", str(work / "s3")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(f"http://127.0.0.1:{s3_port}/")
        stores = {f: s3(s3_port, f) for f in FLEETS}
        direct = stores["store"]
        histories = {f: HistoryStore(st) for f, st in stores.items()}
        tree = [f"http://127.0.0.1:{p}" for p in start_relays(procs, work, 2)[0]]
        publisher = RelayPublisher(f"relay+{tree[0]}", token=PUBLISH_TOKEN,
                                   through=stores["relay"])
        through_tree = 0  # payload bytes the relay fleet's receiver read from the member

        rng = np.random.default_rng(0)
        per = int(args.gib * (1 << 30) / 2 / TENSORS)
        bits = {f"model.layers.{i}.weight": ((rng.standard_normal(per, dtype=np.float32)
                                              * 0.02).view(np.uint32) >> 16).astype(np.uint16)
                for i in range(TENSORS)}
        t0 = time.perf_counter()
        owners = {"store": Encoder(store=direct, baseline=source(bits), version=0),
                  "relay": Encoder(store=publisher, baseline=source(bits), version=0)}
        for v in range(last + 1):
            if v:
                bits = step(bits, args.pct, rng)
                attempts = {f: commit(o, histories[f], bits, v) for f, o in owners.items()}
                through_tree += received(tree[-1], attempts["relay"])  # its pods' refit
            if v in keep or v % args.snapshot_every == 0:
                save(bits, work / "train" / f"v{v}")
            if v % args.snapshot_every == 0:  # the bench is the coordinator: it records
                for f, st in stores.items():
                    histories[f].snapshot(write_snapshot(st, work / "train" / f"v{v}", v))
                if v not in keep:
                    shutil.rmtree(work / "train" / f"v{v}")  # the store has it now
            print(f"version {v} committed ({time.perf_counter() - t0:.0f} s)", flush=True)
        publisher.close()
        staged = [json.loads(urlopen(f"{u}/healthz", timeout=10).read())["staged_bytes"]
                  for u in tree]  # what the tree still holds of the committed attempts
        target = work / "train" / f"v{last}"
        dense = (target / "model.safetensors").stat().st_size
        direct.put(f"full/v{last}/model.safetensors", (target / "model.safetensors").read_bytes())
        want = bits_of(target)
        h = histories["store"].read()
        deltas = [c.payload_bytes for c in h.versions]
        relay_deltas = [c.payload_bytes for c in histories["relay"].read().versions]
        mirror = work / "mirror"  # on the rollout cluster's local volume, at N - 1 so far
        sync(direct, mirror, version=last - 1, seed=(last - 1, work / "train" / f"v{last - 1}"))
        link, port = start_link(procs, s3_port, args.mbit, args.rtt_ms)
        pod = s3(port, "store")
        t = time.perf_counter()
        synced = sync(pod, mirror)
        assert synced.built is not None
        mirror_sync = {"from": last - 1, "to": last, "seconds": round(time.perf_counter() - t, 3),
                       "boundary_bytes": link_bytes(link)[1],
                       "bit_exact": bits_of(mirror / CURRENT) == want}
        pod.close()
        print(json.dumps({"mirror_sync": mirror_sync}), flush=True)
        donors = {}  # per way: a peer of that fleet that rejoined N from its store
        for way, fleet in (("peer", "store"), ("relay-peer", "relay")):
            copy = work / f"donor-{fleet}" / FROM_STORE
            materialize(stores[fleet], copy, version=last, held=last - 1,
                        seed=work / "train" / f"v{last - 1}")
            donors[way] = lend(copy)

        for m in missed:
            for way, fleet in WAYS.items():
                link, port = start_link(procs, s3_port, args.mbit, args.rtt_ms)
                pod = s3(port, fleet)
                out = work / "pod" / f"{m}-{way}"
                if way == "replay":  # patched in place: the pod's own copy, not timed
                    shutil.copytree(work / "train" / f"v{last - m}", out)
                load = os.getloadavg()[0]
                t = time.perf_counter()
                plan = catch_up(way, pod, out, last - m, last, work, donors)
                seconds = time.perf_counter() - t
                pod.close()
                _, down = link_bytes(link)
                built = out / FROM_STORE if (out / FROM_STORE).is_dir() else out
                exact = bits_of(built) == want
                shutil.rmtree(out)
                row = {"missed": m, "held": last - m, "way": way, "fleet": fleet,
                       "seconds": round(seconds, 3), "boundary_bytes": down,
                       "bit_exact": exact, "load_1m": round(load, 2), **plan}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "benchmark": "catchup",
        "command": " ".join(["python", "bench/catchup.py", *sys.argv[1:]]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": {"checkpoint_bytes": dense, "tensors": TENSORS, "changed_pct": args.pct,
                  "versions": last, "snapshot_every": args.snapshot_every,
                  "snapshots": [s.version for s in h.snapshots],
                  "delta_bytes_mean": int(sum(deltas) / len(deltas)),
                  "relay_delta_bytes_mean": int(sum(relay_deltas) / len(relay_deltas)),
                  "relay_members": len(tree), "relay_payload_bytes_received": through_tree,
                  "relay_staged_bytes_after_commits": staged,
                  "link_mbit": args.mbit, "rtt_ms": args.rtt_ms,
                  "s3_server": "rclone serve s3", "cpus": os.cpu_count(),
                  "load_avg_start": [round(x, 2) for x in load_start],
                  "load_avg_end": [round(x, 2) for x in os.getloadavg()],
                  "python": platform.python_version()},
        "mirror_sync": mirror_sync,
        "results": rows,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
