"""A pod that missed versions reaches the committed one from the store, side by side.

The training side commits versions 1..N of a BF16 checkpoint (each a uniform ``--pct`` %
of elements moved by one ulp from the one before) through the in-process encoder into a
real S3 server (``rclone serve s3``), records each in the store's history, and writes a
snapshot every ``--snapshot-every`` versions. A rollout pod that holds version N - m
(m = 1, 5, 20) then reaches N across an emulated link, four ways in one run:

* **replay**: the committed deltas after its version, patched into its copy in place;
* **snapshot**: the newest snapshot at or below N and the deltas after it;
* **mirror**: a copy of the rollout cluster's mirror (``dcr mirror``, kept at N on a local
  volume), checked against the history's fingerprints: only those cross the link;
* **peer**: the agent's own build (``FromStore.build`` given ``--donor``): a live peer's
  copy of N taken under a lease over loopback (inside the rollout cluster), checked against
  the history's fingerprints; the history and manifests cross the link;
* **full**: a download of version N's checkpoint.

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
from dcr.transport.s3 import S3Store
from transport import BIN, KEY, SECRET, Procs, free_port, link_bytes, start_link, wait_http

BUCKET = "catchup"
TENSORS = 64
CREDS = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
PEER_TOKEN = "bench-peer-read-token-0123456789"


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


def bits_of(path: Path) -> dict[str, bytes]:
    with Checkpoint(path) as c:
        return {n: c.bits(n).tobytes() for n in c.names()}


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
    try:
        s3_port = free_port()
        (work / "s3" / BUCKET).mkdir(parents=True)
        procs.start([str(BIN / "rclone"), "serve", "s3", "--addr", f"127.0.0.1:{s3_port}",
                     "--auth-key", f"{KEY},{SECRET}", str(work / "s3")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(f"http://127.0.0.1:{s3_port}/")
        direct = S3Store(f"s3://{BUCKET}/policy", endpoint=f"http://127.0.0.1:{s3_port}",
                         region="us-east-1", credentials=CREDS)
        history = HistoryStore(direct)

        rng = np.random.default_rng(0)
        per = int(args.gib * (1 << 30) / 2 / TENSORS)
        bits = {f"model.layers.{i}.weight": ((rng.standard_normal(per, dtype=np.float32)
                                              * 0.02).view(np.uint32) >> 16).astype(np.uint16)
                for i in range(TENSORS)}
        t0 = time.perf_counter()
        owner = Encoder(store=direct, baseline=source(bits), version=0)
        for v in range(last + 1):
            if v:
                bits = step(bits, args.pct, rng)
                commit(owner, history, bits, v)
            if v in keep or v % args.snapshot_every == 0:
                save(bits, work / "train" / f"v{v}")
            if v % args.snapshot_every == 0:  # the bench is the coordinator: it records
                history.snapshot(write_snapshot(direct, work / "train" / f"v{v}", v))
                if v not in keep:
                    shutil.rmtree(work / "train" / f"v{v}")  # the store has it now
            print(f"version {v} committed ({time.perf_counter() - t0:.0f} s)", flush=True)
        target = work / "train" / f"v{last}"
        dense = (target / "model.safetensors").stat().st_size
        direct.put(f"full/v{last}/model.safetensors", (target / "model.safetensors").read_bytes())
        want = bits_of(target)
        h = history.read()
        deltas = [c.payload_bytes for c in h.versions]
        mirror = work / "mirror"  # on the rollout cluster's local volume, at N - 1 so far
        sync(direct, mirror, version=last - 1, seed=(last - 1, work / "train" / f"v{last - 1}"))
        link, port = start_link(procs, s3_port, args.mbit, args.rtt_ms)
        pod = S3Store(f"s3://{BUCKET}/policy", endpoint=f"http://127.0.0.1:{port}",
                      region="us-east-1", credentials=CREDS)
        t = time.perf_counter()
        synced = sync(pod, mirror)
        assert synced.built is not None
        mirror_sync = {"from": last - 1, "to": last, "seconds": round(time.perf_counter() - t, 3),
                       "boundary_bytes": link_bytes(link)[1],
                       "bit_exact": bits_of(mirror / CURRENT) == want}
        pod.close()
        print(json.dumps({"mirror_sync": mirror_sync}), flush=True)
        donor = work / "donor" / FROM_STORE  # a peer that rejoined N from the store
        materialize(direct, donor, version=last, held=last - 1,
                    seed=work / "train" / f"v{last - 1}")
        donor_url = lend(donor)

        for m in missed:
            held = last - m
            for way in ("replay", "snapshot", "mirror", "full", "peer"):
                link, port = start_link(procs, s3_port, args.mbit, args.rtt_ms)
                pod = S3Store(f"s3://{BUCKET}/policy", endpoint=f"http://127.0.0.1:{port}",
                              region="us-east-1", credentials=CREDS)
                out = work / "pod" / f"{m}-{way}"
                if way == "replay":
                    shutil.copytree(work / "train" / f"v{held}", out)
                t = time.perf_counter()
                if way == "full":
                    out.mkdir(parents=True)
                    (out / "model.safetensors").write_bytes(
                        pod.get(f"full/v{last}/model.safetensors"))
                    plan = {"route": "full"}
                elif way == "peer":
                    agent = FromStore(HistoryStore(pod), out,
                                      seed=(held, work / "train" / f"v{held}"),
                                      peers=(PeerClient(donor_url, PEER_TOKEN),))
                    _, done = agent.build(last)
                    plan = {"route": "peer", "from": done.plan.start, "deltas": done.plan.steps,
                            "fetched_bytes": done.fetched_bytes,
                            "peer_bytes": agent.peer_bytes}
                    assert agent.peer_refusals == 0
                elif way == "mirror":
                    done = materialize(pod, out, seed=mirror / CURRENT)
                    plan = {"route": "mirror", "from": done.plan.start, "deltas": 0,
                            "fetched_bytes": done.fetched_bytes}
                else:
                    done = materialize(pod, out, held=held if way == "replay" else None,
                                       route=way)
                    plan = {"route": done.plan.route, "from": done.plan.start,
                            "deltas": done.plan.steps, "planned_bytes": done.plan.fetch_bytes,
                            "fetched_bytes": done.fetched_bytes}
                seconds = time.perf_counter() - t
                pod.close()
                _, down = link_bytes(link)
                exact = bits_of(out / FROM_STORE if way == "peer" else out) == want
                shutil.rmtree(out)
                row = {"missed": m, "held": held, "way": way, "seconds": round(seconds, 3),
                       "boundary_bytes": down, "bit_exact": exact, **plan}
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
                  "link_mbit": args.mbit, "rtt_ms": args.rtt_ms,
                  "s3_server": "rclone serve s3", "cpus": os.cpu_count(),
                  "python": platform.python_version()},
        "mirror_sync": mirror_sync,
        "results": rows,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
