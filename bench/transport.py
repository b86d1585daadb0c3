"""Transport benchmark: a refit across an emulated WAN, object store vs relay tree vs full.

Sides: the trainer and a real S3-compatible server (``rclone serve s3``) sit on the
training side; N rollout nodes each reach the training side through their own emulated
link (``bench/linkemu.py``: a bandwidth cap and a propagation delay). Local links
inside the rollout side are loopback, unshaped.

With ``--topology shared`` all nodes share one boundary link instead (an inter-region
pipe), which is where sending each payload across once pays off.

Three ways to get version 1 of a 1 GiB BF16 checkpoint (3% of elements changed) onto
every node, each measured end to end (publish, then all nodes done), side by side:

* ``full``: upload the checkpoint once, every node downloads all of it (the reference
  every speedup is measured against: a plain checkpoint sync);
* ``dcr-s3``: ``dcr diff`` uploads payloads and manifest, every node downloads them
  and applies them to its copy of version 0;
* ``dcr-relay``: the trainer streams payloads through the link to the root of a relay
  tree inside the rollout side, which forwards them down the tree over local links;
  every node applies them.

Bytes crossing the boundary are counted by the link emulators. Nodes are separate
processes; they import and load version 0 before the clock starts, and for DCR they
receive (``dcr.transport.receive``) while the trainer is still encoding and sending. Results go to
bench/results/transport.json.

    .venv/bin/python bench/transport.py [--nodes 4] [--gib 1] [--mbit 250] [--rtt-ms 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from dcr.checkpoint import Checkpoint, fingerprint
from dcr.codec.decode import Target, apply_items, decode
from dcr.format.payload import Payload
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.tokens import write_token_file
from dcr.transport.receive import Source, StoreSource, receive
from dcr.transport.relay import RelaySource
from dcr.transport.relay.publish import RelayPublisher
from dcr.transport.store import open_store

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
KEY, SECRET = "dcrbenchaccesskey", "dcrbenchsecretkey0123456789"
BUCKET, ATTEMPT = "bench", "a-bench"
TOKEN, PUBLISH_TOKEN = "bench-read-token-0001", "bench-publish-token-0001"  # relay: nodes read
BUCKET_BYTES = 256 << 20  # set from --bucket-mib


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


# --- the checkpoint ------------------------------------------------------------------


def make_checkpoints(work: Path, gib: float, pct: float) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    n_tensors = 64
    per = int(gib * (1 << 30) / 2 / n_tensors)
    base, target = {}, {}
    for i in range(n_tensors):
        f32 = (rng.standard_normal(per, dtype=np.float32) * 0.02).view(np.uint32)
        b = (f32 >> 16).astype(np.uint16)
        t = b.copy()
        idx = np.flatnonzero(rng.random(per) < pct / 100)
        t[idx] += 1
        name = f"model.layers.{i}.weight"
        base[name] = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
        target[name] = torch.from_numpy(t.view(np.int16)).view(torch.bfloat16)
    save_file(base, str(work / "v0.safetensors"))
    save_file(target, str(work / "v1.safetensors"))
    return work / "v0.safetensors", work / "v1.safetensors"


# --- processes -----------------------------------------------------------------------


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, args: list[str], **kw: Any) -> subprocess.Popen[str]:
        p = subprocess.Popen(args, text=True, **kw)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def start_link(procs: Procs, target_port: int, mbit: float, rtt_ms: float
               ) -> tuple[subprocess.Popen[str], int]:
    p = procs.start([sys.executable, str(HERE / "linkemu.py"), "--listen", "127.0.0.1:0",
                     "--to", f"127.0.0.1:{target_port}", "--mbit", str(mbit),
                     "--rtt-ms", str(rtt_ms)], stdout=subprocess.PIPE)
    assert p.stdout is not None
    port = int(p.stdout.readline().strip().rsplit(":", 1)[1])
    return p, port


def link_bytes(p: subprocess.Popen[str]) -> tuple[int, int]:
    """Stop a link emulator and read how many bytes crossed it (up, down)."""
    p.terminate()
    out, _ = p.communicate(timeout=10)
    m = re.search(r"bytes up (\d+) down (\d+)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def s3_env(port: int) -> dict[str, str]:
    return {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1"}


def start_nodes(procs: Procs, n: int, mode: str, base: Path, endpoints: list[str]
                ) -> list[subprocess.Popen[str]]:
    nodes = []
    for i in range(n):
        env = s3_env(int(endpoints[i].rsplit(":", 1)[1])) if mode != "dcr-relay" else None
        nodes.append(procs.start(
            [sys.executable, __file__, "node", "--mode", mode, "--base", str(base),
             "--endpoint", endpoints[i]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
    for p in nodes:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"a node did not start: {line!r}")
    return nodes


def go(nodes: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    for p in nodes:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in nodes:
        assert p.stdout is not None
        results.append(json.loads(p.stdout.readline()))
    return results


# --- a rollout node ------------------------------------------------------------------


def node_main(args: argparse.Namespace) -> None:
    """One rollout node: hold version 0, wait for "go", fetch, apply, verify, report."""
    targets: dict[str, Target] = {}
    if args.mode != "full":
        with Checkpoint(Path(args.base)) as ckpt:
            for info in ckpt:
                targets[info.name] = Target(dtype=info.dtype.name, shape=info.shape,
                                            bits=np.array(ckpt.bits(info.name)))
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    if args.mode == "full":
        data = open_store(f"s3://{BUCKET}/full").get("v1.safetensors")
        result: dict[str, Any] = {"bytes": len(data), "exact": True}
    else:
        source: Source = (
            StoreSource(store=open_store(f"s3://{BUCKET}/dcr"), version=1, attempt=ATTEMPT)
            if args.mode == "dcr-s3"
            else RelaySource(f"http://{args.endpoint}", TOKEN, ATTEMPT)
        )
        received = 0

        def apply(payload: Payload) -> None:  # runs while later payloads still arrive
            nonlocal received
            received += len(payload.data)
            apply_items(decode(payload), targets, threads=2)

        manifest = receive(source, ATTEMPT, apply)
        if isinstance(source, RelaySource):
            source.close()
        want = {t.name: t.target for t in manifest.tensors}
        exact = all(fingerprint(t.bits) == want[n] for n, t in targets.items())
        result = {"bytes": received, "exact": exact}
    result["seconds"] = time.perf_counter() - t0
    print(json.dumps(result), flush=True)


# --- the three ways ------------------------------------------------------------------


def node_links(procs: Procs, s3_port: int, n: int, mbit: float, rtt: float, shared: bool
               ) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """Each node's way to the training side: its own link, or one link they all share."""
    links = [start_link(procs, s3_port, mbit, rtt) for _ in range(1 if shared else n)]
    endpoints = [f"127.0.0.1:{links[0 if shared else i][1]}" for i in range(n)]
    return [p for p, _ in links], endpoints


def run_full(procs: Procs, s3_port: int, v1: Path, n: int, mbit: float, rtt: float,
             shared: bool) -> dict[str, Any]:
    links, endpoints = node_links(procs, s3_port, n, mbit, rtt, shared)
    nodes = start_nodes(procs, n, "full", v1, endpoints)
    os.environ.update(s3_env(s3_port))
    t0 = time.perf_counter()
    open_store(f"s3://{BUCKET}/full").put("v1.safetensors", v1.read_bytes())
    publish = time.perf_counter() - t0
    results = go(nodes)
    total = publish + max(r["seconds"] for r in results)
    crossed = sum(link_bytes(p)[1] for p in links)
    return {"publish_s": publish, "nodes": results, "total_s": total,
            "boundary_bytes": crossed}


def run_dcr_s3(procs: Procs, s3_port: int, v0: Path, v1: Path, n: int, mbit: float,
               rtt: float, shared: bool) -> dict[str, Any]:
    links, endpoints = node_links(procs, s3_port, n, mbit, rtt, shared)
    nodes = start_nodes(procs, n, "dcr-s3", v0, endpoints)
    os.environ.update(s3_env(s3_port))
    results_box: list[list[dict[str, Any]]] = []
    t0 = time.perf_counter()
    waiter = threading.Thread(target=lambda: results_box.append(go(nodes)))
    waiter.start()  # nodes poll the store while the trainer uploads: pipelined
    with Checkpoint(v0) as b, Checkpoint(v1) as t:
        m = diff_checkpoints(b, t, open_store(f"s3://{BUCKET}/dcr"),
                             EncodeSettings(version=1, base_version=0, attempt=ATTEMPT,
                                          bucket_bytes=BUCKET_BYTES))
    publish = time.perf_counter() - t0
    waiter.join()
    total = time.perf_counter() - t0
    results = results_box[0]
    crossed = sum(link_bytes(p)[1] for p in links)
    return {"publish_s": publish, "payload_bytes": m.stats.payload_bytes, "nodes": results,
            "total_s": total, "boundary_bytes": crossed}


def run_dcr_relay(procs: Procs, v0: Path, v1: Path, n: int, mbit: float, rtt: float,
                  fanout: int, work: Path) -> dict[str, Any]:
    ports = [free_port() for _ in range(n)]
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    token_file = write_token_file(work / "token", TOKEN)
    publish_file = write_token_file(work / "publish-token", PUBLISH_TOKEN)
    for i, port in enumerate(ports):
        procs.start([sys.executable, "-m", "dcr", "relay", "--listen", f"127.0.0.1:{port}",
                     "--members", members, "--index", str(i), "--fanout", str(fanout),
                     "--token-file", str(token_file), "--publish-token-file",
                     str(publish_file)], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
    for port in ports:
        wait_http(f"http://127.0.0.1:{port}/healthz")
    link, link_port = start_link(procs, ports[0], mbit, rtt)  # trainer -> root: the boundary
    nodes = start_nodes(procs, n, "dcr-relay", v0, [f"127.0.0.1:{p}" for p in ports])
    push = RelayPublisher(f"relay+http://127.0.0.1:{link_port}", token=PUBLISH_TOKEN)
    results_box: list[list[dict[str, Any]]] = []
    t0 = time.perf_counter()
    waiter = threading.Thread(target=lambda: results_box.append(go(nodes)))
    waiter.start()  # nodes poll their relay while the trainer streams: pipelined
    with Checkpoint(v0) as b, Checkpoint(v1) as t:
        settings = EncodeSettings(version=1, base_version=0, attempt=ATTEMPT,
                                bucket_bytes=BUCKET_BYTES)
        m = diff_checkpoints(b, t, push, settings)
    publish = time.perf_counter() - t0
    waiter.join()
    total = time.perf_counter() - t0
    push.close()
    up, _ = link_bytes(link)
    return {"publish_s": publish, "payload_bytes": m.stats.payload_bytes,
            "nodes": results_box[0], "total_s": total, "boundary_bytes": up}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    node = sub.add_parser("node")
    node.add_argument("--mode", required=True)
    node.add_argument("--base", required=True)
    node.add_argument("--endpoint", required=True)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--pct", type=float, default=3.0)
    ap.add_argument("--mbit", type=float, default=250.0)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--fanout", type=int, default=2)
    ap.add_argument("--bucket-mib", type=int, default=256, help="dense MiB per payload")
    ap.add_argument("--topology", choices=["per-node", "shared"], default="per-node",
                    help="per-node: a link per rollout node; shared: one boundary link")
    ap.add_argument("--out", default="bench/results/transport.json")
    args = ap.parse_args()
    if args.cmd == "node":
        node_main(args)
        return
    global BUCKET_BYTES
    BUCKET_BYTES = args.bucket_mib << 20
    procs = Procs()
    work = Path(tempfile.mkdtemp(prefix="dcr-transport-"))
    try:
        v0, v1 = make_checkpoints(work, args.gib, args.pct)
        s3_port = free_port()
        data = work / "s3"
        (data / BUCKET).mkdir(parents=True)
        procs.start([str(BIN / "rclone"), "serve", "s3", "--addr", f"127.0.0.1:{s3_port}",
                     "--auth-key", f"{KEY},{SECRET}", str(data)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(f"http://127.0.0.1:{s3_port}/")
        n, mbit, rtt, shared = args.nodes, args.mbit, args.rtt_ms, args.topology == "shared"
        rows = {
            "full": run_full(procs, s3_port, v1, n, mbit, rtt, shared),
            "dcr-s3": run_dcr_s3(procs, s3_port, v0, v1, n, mbit, rtt, shared),
            "dcr-relay": run_dcr_relay(procs, v0, v1, n, mbit, rtt, args.fanout, work),
        }
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
    full = rows["full"]["total_s"]
    dense = int(args.gib * (1 << 30))
    link_bytes_s = mbit * 1e6 / 8
    doc = {
        "benchmark": "transport",
        "command": " ".join(["python", "bench/transport.py", *sys.argv[1:]]),
        "setup": {"nodes": n, "checkpoint_bytes": dense, "changed_pct": args.pct,
                  "link_mbit": mbit, "rtt_ms": rtt, "relay_fanout": args.fanout,
                  "topology": args.topology, "bucket_mib": args.bucket_mib,
                  "s3_server": "rclone serve s3", "cpus": os.cpu_count(),
                  "python": platform.python_version()},
        "results": rows,
        "speedup_vs_full": {k: full / r["total_s"] for k, r in rows.items()},
        "relay_vs_s3": rows["dcr-s3"]["total_s"] / rows["dcr-relay"]["total_s"],
        "full_download_link_efficiency": (
            rows["full"]["boundary_bytes"] / (rows["full"]["total_s"] - rows["full"]["publish_s"])
            / (link_bytes_s * (1 if shared else n))),
        "all_exact": all(r["exact"] for k in ("dcr-s3", "dcr-relay") for r in rows[k]["nodes"]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'way':<10} {'total s':>8} {'publish s':>9} {'boundary MB':>11} {'vs full':>8}")
    for k, r in rows.items():
        print(f"{k:<10} {r['total_s']:>8.2f} {r['publish_s']:>9.2f} "
              f"{r['boundary_bytes'] / 1e6:>11.1f} {doc['speedup_vs_full'][k]:>7.1f}x")
    print(f"relay vs object store: {doc['relay_vs_s3']:.2f}x; full-download link efficiency "
          f"{100 * doc['full_download_link_efficiency']:.0f}%; all exact: {doc['all_exact']}")


if __name__ == "__main__":
    main()
