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

Besides the three ways, each run measures what each stage needs alone, uncontended, on
this machine: the owner's encode into memory and a receiver's decode + apply from memory,
at 1 and 2 threads (per-core rates and the 2-core speed-up). The *limit* of a way is
``max(encode alone, link time of the payload bytes, apply alone) + one round trip``;
each DCR way reports its end-to-end time over that limit. Peak resident memory is read
from every node, relay node and a ``dcr diff`` process encoding the same transition
(``ru_maxrss``), next to the model's own bytes.

    .venv/bin/python bench/transport.py [--nodes 4] [--gib 1] [--mbit 250] [--rtt-ms 20]

``bench/evaluate.py`` (``make evaluate``) runs it over model sizes, change rates,
topologies, owners, fan-outs and node counts.
"""

from __future__ import annotations

import argparse
import contextlib
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from dcr.checkpoint import Checkpoint, fingerprint
from dcr.codec.decode import Target, apply_items, decode
from dcr.format.payload import Payload, read_payload
from dcr.http.tokens import write_token_file
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.transport.receive import Source, StoreSource, receive
from dcr.transport.relay import RelaySource
from dcr.transport.relay.publish import RelayPublisher
from dcr.transport.store import MemoryStore, Store, open_store

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


def make_checkpoints(work: Path, gib: float, pct: float, data: str = "synthetic",
                     cache: Path | None = None) -> tuple[Path, Path]:
    """Version 0 and 1 of a BF16 checkpoint of ``gib`` GiB, as safetensors files.

    ``synthetic``: 64 equal tensors of N(0, 0.02) with a uniform ``pct`` % of elements moved
    by one ulp. ``real-adamw``: Llama-shaped tensors trained by ``torch.optim.AdamW`` at
    lr 1e-6 (``bench/codec.py``'s ``adamw_pair``), the exports before and after one step;
    ``pct`` is ignored (the optimizer decides what changes). With ``cache``, files made
    before for the same arguments are reused (version 0 is shared across rates).
    """
    where = cache or work
    where.mkdir(parents=True, exist_ok=True)
    tag = f"{data}-{gib:g}gib"
    v0 = where / f"{tag}-v0.safetensors"
    v1 = where / (f"{tag}-v1.safetensors" if data == "real-adamw"
                  else f"{tag}-{pct:g}pct-v1.safetensors")
    if v0.exists() and v1.exists():
        return v0, v1
    if data == "real-adamw":
        _make_adamw(v0, v1, gib)
    else:
        _make_synthetic(v0, v1, gib, pct)
    return v0, v1


def _make_synthetic(v0: Path, v1: Path, gib: float, pct: float) -> None:
    import torch
    from safetensors.torch import save_file

    n_tensors = 64
    per = int(gib * (1 << 30) / 2 / n_tensors)
    base, target = {}, {}
    rng = np.random.default_rng(0)
    flip = np.random.default_rng(int(pct * 1000) + 1)
    for i in range(n_tensors):
        f32 = (rng.standard_normal(per, dtype=np.float32) * 0.02).view(np.uint32)
        b = (f32 >> 16).astype(np.uint16)
        t = b.copy()
        idx = np.flatnonzero(flip.random(per, dtype=np.float32) < pct / 100)
        t[idx] += 1
        name = f"model.layers.{i}.weight"
        base[name] = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
        target[name] = torch.from_numpy(t.view(np.int16)).view(torch.bfloat16)
    if not v0.exists():
        save_file(base, str(v0))
    save_file(target, str(v1))


def _make_adamw(v0: Path, v1: Path, gib: float) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from codec import adamw_pair, model_shapes, save

    torch.set_num_threads(os.cpu_count() or 1)
    hidden, inter, vocab, kv = 2048, 5632, 32000, 512
    per_layer = 2 * hidden * hidden + 2 * kv * hidden + 3 * inter * hidden + 2 * hidden
    layers = max(1, round((gib * (1 << 30) / 2 - 2 * vocab * hidden) / per_layer))
    shapes = model_shapes(hidden=hidden, inter=inter, vocab=vocab, layers=layers, kv=kv)
    before, after = adamw_pair(shapes, warmup=5, seed=0)
    save(before, shapes, v0)
    save(after, shapes, v1)


# --- processes -----------------------------------------------------------------------


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.s3_pid = 0

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


def start_nodes(procs: Procs, n: int, mode: str, base: Path, endpoints: list[str],
                owners: int = 1, threads: int = 2) -> list[subprocess.Popen[str]]:
    nodes = []
    for i in range(n):
        env = s3_env(int(endpoints[i].rsplit(":", 1)[1])) if mode != "dcr-relay" else None
        nodes.append(procs.start(
            [sys.executable, __file__, "node", "--mode", mode, "--base", str(base),
             "--endpoint", endpoints[i], "--owners", str(owners), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
    for p in nodes:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"a node did not start: {line!r}")
    return nodes


def tell(nodes: list[subprocess.Popen[str]], word: str) -> list[dict[str, Any]]:
    """Send every node ``word``; read one JSON line from each."""
    for p in nodes:
        assert p.stdin is not None
        p.stdin.write(word + "\n")
        p.stdin.flush()
    results = []
    for p in nodes:
        assert p.stdout is not None
        results.append(json.loads(p.stdout.readline()))
    return results


def go(nodes: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """Start the refit on every node; each answers when it has applied the last payload."""
    return tell(nodes, "go")


def verified(nodes: list[subprocess.Popen[str]], results: list[dict[str, Any]]
             ) -> list[dict[str, Any]]:
    """Once every node is done: each checks its bits against the manifest (hashing the
    whole model, which would steal cores from nodes still applying if done earlier)."""
    return [r | v for r, v in zip(results, tell(nodes, "verify"), strict=True)]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuUse:
    """CPU seconds each group of processes spends between ``start`` and ``stop``: where
    this machine's cores went during a refit."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        return {k: sum(cpu_seconds(p) for p in pids) for k, pids in self.groups.items()}

    def stop(self) -> dict[str, float]:
        after = self._read()
        return {k: round(after[k] - self.before[k], 3) for k in self.groups}


def peak_rss(pid: int) -> int:
    """A live process's peak resident bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


# --- a rollout node ------------------------------------------------------------------


def load_targets(base: Path) -> dict[str, Target]:
    with Checkpoint(base) as ckpt:
        return {info.name: Target(dtype=info.dtype.name, shape=info.shape,
                                  bits=np.array(ckpt.bits(info.name))) for info in ckpt}


def reset_peak_rss() -> int:
    """Reset this process's peak resident size to its current one (``clear_refs`` 5);
    return the current resident bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return peak_rss(os.getpid())


def node_main(args: argparse.Namespace) -> None:
    """One rollout node: hold version 0, wait for "go", fetch, apply, verify, report.

    Its store client or relay connection is opened before "ready", as a long-running
    agent holds one: loading the S3 client is not part of any refit.
    """
    targets = load_targets(Path(args.base)) if args.mode != "full" else {}
    source: Source | None = None
    if args.mode == "full":
        full = open_store(f"s3://{BUCKET}/full")
    elif args.mode == "dcr-s3":
        source = StoreSource(store=open_store(f"s3://{BUCKET}/dcr"), version=1,
                             attempt=ATTEMPT, owners=args.owners)
    else:
        source = RelaySource(f"http://{args.endpoint}", TOKEN, ATTEMPT, owners=args.owners)
    held = reset_peak_rss()  # the model's copy and the libraries: what the node holds anyway
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()  # system-wide: the parent compares it with its own clock
    if source is None:
        data = full.get("v1.safetensors")
        done = time.monotonic()
        result: dict[str, Any] = {"bytes": len(data)}
    else:
        received, applying = 0, 0.0

        def apply(payload: Payload) -> None:  # runs while later payloads still arrive
            nonlocal received, applying
            a0 = time.perf_counter()
            received += len(payload.data)
            apply_items(decode(payload), targets, threads=args.threads)
            applying += time.perf_counter() - a0

        manifest = receive(source, ATTEMPT, apply, owners=args.owners)
        done = time.monotonic()
        if isinstance(source, RelaySource):
            source.close()
        want = {t.name: t.target for t in manifest.tensors}
        result = {"bytes": received, "apply_s": applying}
    result["done_monotonic"], result["seconds"] = done, done - t0
    result["held_rss_bytes"], result["peak_rss_bytes"] = held, peak_rss(os.getpid())
    print(json.dumps(result), flush=True)
    sys.stdin.readline()  # "verify": the benchmark's check, after every node is done
    print(json.dumps({"exact": source is None or all(
        fingerprint(t.bits) == want[n] for n, t in targets.items())}), flush=True)


# --- each stage alone ----------------------------------------------------------------


def encode_settings(owner: int, owners: int, threads: int) -> EncodeSettings:
    return EncodeSettings(target_version=1, base_version=0, attempt=ATTEMPT, owner=owner,
                          owners=owners, threads=threads, bucket_bytes=BUCKET_BYTES,
                          attempt_manifest=owners > 1)


def encode(v0: Path, v1: Path, stores: list[Store], threads: int) -> list[Any]:
    """Every owner's part of the transition into its store, the owners concurrently."""
    owners = len(stores)

    def one(k: int) -> Any:
        with Checkpoint(v0) as b, Checkpoint(v1) as t:
            return diff_checkpoints(b, t, stores[k], encode_settings(k, owners, threads))

    if owners == 1:
        return [one(0)]
    with ThreadPoolExecutor(owners) as pool:
        return list(pool.map(one, range(owners)))


def largest_tensor(path: Path) -> int:
    with Checkpoint(path) as ckpt:
        return max(i.nbytes for i in ckpt)


def stages_alone(v0: Path, v1: Path, owners: int, threads: int) -> dict[str, Any]:
    """Encode alone (into memory) and decode + apply alone (from memory), at 1 and 2
    threads per owner or receiver, best of three; checks the apply is bit-exact."""
    out: dict[str, Any] = {}
    stores: list[MemoryStore] = []
    for t in sorted({1, 2, threads}):
        best = float("inf")
        for _ in range(3):
            stores = [MemoryStore() for _ in range(owners)]
            t0 = time.perf_counter()
            manifests = encode(v0, v1, list(stores), t)
            best = min(best, time.perf_counter() - t0)
        out[f"encode_s_{t}t"] = best
    out["payload_bytes"] = sum(m.stats.payload_bytes for m in manifests)
    out["changed_elements"] = sum(m.stats.changed_elements for m in manifests)
    out["total_elements"] = sum(m.stats.total_elements for m in manifests)
    blobs = [store.get(e.key) for store, m in zip(stores, manifests, strict=True)
             for e in m.payloads]
    want = {t.name: t.target for m in manifests for t in m.tensors}
    for t in sorted({1, 2, threads}):
        best = float("inf")
        for _ in range(3):
            targets = load_targets(v0)
            t0 = time.perf_counter()
            for blob in blobs:
                apply_items(decode(read_payload(blob)), targets, threads=t)
            best = min(best, time.perf_counter() - t0)
            if not all(fingerprint(x.bits) == want[n] for n, x in targets.items()):
                raise RuntimeError("decode + apply alone is not bit-exact")
            del targets
        out[f"apply_s_{t}t"] = best
    return out


def owner_memory(v0: Path, v1: Path, work: Path, threads: int) -> dict[str, int]:
    """Memory of one ``dcr diff`` process encoding the transition, sampled every 5 ms from
    /proc: its largest anonymous resident size (what it allocates) and its peak resident
    size (VmHWM, which also counts the memory-mapped checkpoints' pages it touched). Not
    ``ru_maxrss``: a child's counts the parent's resident pages at fork."""
    store = work / "rss-store"
    p = subprocess.Popen([str(BIN / "dcr"), "diff", "--store", str(store), "--version", "1",
                          "--threads", str(threads), "--bucket-mib", str(BUCKET_BYTES >> 20),
                          "--json", str(v0), str(v1)], stdout=subprocess.DEVNULL)
    anon = hwm = 0
    status = Path(f"/proc/{p.pid}/status")
    while p.poll() is None:
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("RssAnon:"):
                    anon = max(anon, int(line.split()[1]) * 1024)
                elif line.startswith("VmHWM:"):
                    hwm = max(hwm, int(line.split()[1]) * 1024)
        time.sleep(0.005)
    shutil.rmtree(store, ignore_errors=True)
    if p.returncode != 0:
        raise RuntimeError(f"dcr diff exited {p.returncode}")
    return {"owner_peak_rss_bytes": hwm, "owner_peak_anon_bytes": anon}


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
    store = open_store(f"s3://{BUCKET}/full")
    t0 = time.perf_counter()
    store.put("v1.safetensors", v1.read_bytes())
    publish = time.perf_counter() - t0
    results = verified(nodes, go(nodes))
    total = publish + max(r["seconds"] for r in results)
    crossed = sum(link_bytes(p)[1] for p in links)
    return {"publish_s": publish, "nodes": results, "total_s": total,
            "boundary_bytes": crossed}


def run_dcr_s3(procs: Procs, s3_port: int, v0: Path, v1: Path, n: int, mbit: float,
               rtt: float, shared: bool, owners: int, threads: int) -> dict[str, Any]:
    links, endpoints = node_links(procs, s3_port, n, mbit, rtt, shared)
    nodes = start_nodes(procs, n, "dcr-s3", v0, endpoints, owners, threads)
    os.environ.update(s3_env(s3_port))
    results_box: list[list[dict[str, Any]]] = []
    stores: list[Store] = [open_store(f"s3://{BUCKET}/dcr") for _ in range(owners)]
    cpu = CpuUse({"owner and harness": [os.getpid()], "nodes": [p.pid for p in nodes],
                  "S3 server": [procs.s3_pid], "links": [p.pid for p in links]})
    t0 = time.monotonic()
    waiter = threading.Thread(target=lambda: results_box.append(go(nodes)))
    waiter.start()  # nodes poll the store while the trainer uploads: pipelined
    manifests = encode(v0, v1, stores, threads)
    publish = time.monotonic() - t0
    waiter.join()
    total = max(r["done_monotonic"] for r in results_box[0]) - t0
    cpu_s = cpu.stop()
    results = verified(nodes, results_box[0])
    crossed = sum(link_bytes(p)[1] for p in links)
    return {"publish_s": publish,
            "payload_bytes": sum(m.stats.payload_bytes for m in manifests),
            "nodes": results, "total_s": total, "boundary_bytes": crossed, "cpu_s": cpu_s}


def start_relays(procs: Procs, work: Path, n: int, fanout: int = 2
                 ) -> tuple[list[int], list[subprocess.Popen[str]]]:
    """A relay tree of ``n`` ``dcr relay`` processes on loopback, each answering its
    health probe; their ports (the root's first) and processes."""
    ports = [free_port() for _ in range(n)]
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    token_file = write_token_file(work / "token", TOKEN)
    publish_file = write_token_file(work / "publish-token", PUBLISH_TOKEN)
    relays = []
    for i, port in enumerate(ports):
        relays.append(procs.start(
            [sys.executable, "-m", "dcr", "relay", "--listen", f"127.0.0.1:{port}",
             "--members", members, "--index", str(i), "--fanout", str(fanout),
             "--token-file", str(token_file), "--publish-token-file", str(publish_file)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for port in ports:
        wait_http(f"http://127.0.0.1:{port}/healthz")
    return ports, relays


def run_dcr_relay(procs: Procs, v0: Path, v1: Path, n: int, mbit: float, rtt: float,
                  fanout: int, work: Path, threads: int, owners: int = 1) -> dict[str, Any]:
    ports, relays = start_relays(procs, work, n, fanout)
    link, link_port = start_link(procs, ports[0], mbit, rtt)  # trainer -> root: the boundary
    nodes = start_nodes(procs, n, "dcr-relay", v0, [f"127.0.0.1:{p}" for p in ports],
                        owners, threads)
    pushes: list[Store] = [RelayPublisher(f"relay+http://127.0.0.1:{link_port}",
                                          token=PUBLISH_TOKEN) for _ in range(owners)]
    results_box: list[list[dict[str, Any]]] = []
    cpu = CpuUse({"owner and harness": [os.getpid()], "nodes": [p.pid for p in nodes],
                  "relays": [p.pid for p in relays], "links": [link.pid]})
    t0 = time.monotonic()
    waiter = threading.Thread(target=lambda: results_box.append(go(nodes)))
    waiter.start()  # nodes poll their relay while the trainer streams: pipelined
    parts = encode(v0, v1, pushes, threads)  # every owner's part through the one root
    publish = time.monotonic() - t0
    waiter.join()
    total = max(r["done_monotonic"] for r in results_box[0]) - t0
    cpu_s = cpu.stop()
    results = verified(nodes, results_box[0])
    for push in pushes:
        push.close()  # type: ignore[attr-defined]
    up, _ = link_bytes(link)
    return {"publish_s": publish, "payload_bytes": sum(m.stats.payload_bytes for m in parts),
            "nodes": results, "total_s": total, "boundary_bytes": up, "cpu_s": cpu_s,
            "relay_peak_rss_bytes": [peak_rss(r.pid) for r in relays]}


def limit(alone: dict[str, Any], threads: int, mbit: float, rtt_ms: float, nodes: int
          ) -> dict[str, Any]:
    """What the slowest stage needs alone, plus one round trip: no way can beat it.

    ``machine_s`` is a second floor that holds only here, where the owner and every node
    share this machine's cores: their encode and apply work (one thread's seconds) spread
    over all cores, plus the round trip. Real parties each have their own cores.
    """
    stages = {"encode_s": alone[f"encode_s_{threads}t"],
              "link_s": alone["payload_bytes"] / (mbit * 1e6 / 8),
              "apply_s": alone[f"apply_s_{threads}t"]}
    slowest = max(stages, key=lambda k: stages[k])
    cpu = (alone["encode_s_1t"] + nodes * alone["apply_s_1t"]) / (os.cpu_count() or 1)
    return {**stages, "rtt_s": rtt_ms / 1000, "slowest": slowest,
            "limit_s": stages[slowest] + rtt_ms / 1000,
            "machine_s": max(stages[slowest], cpu) + rtt_ms / 1000}


WAYS = ("full", "dcr-s3", "dcr-relay")


def relay_run(v0: Path, v1: Path, args: argparse.Namespace, work: Path, owners: int
              ) -> dict[str, Any]:
    """One refit through a fresh relay tree by ``owners`` owners, its processes stopped
    after it (four nodes' copies of the model are all this machine can hold at once)."""
    procs = Procs()
    load = os.getloadavg()
    try:
        r = run_dcr_relay(procs, v0, v1, args.nodes, args.mbit, args.rtt_ms, args.fanout,
                          work, args.threads, owners)
    finally:
        procs.stop()
    return {"owners": owners, "total_s": r["total_s"], "publish_s": r["publish_s"],
            "boundary_bytes": r["boundary_bytes"], "payload_bytes": r["payload_bytes"],
            "node_seconds": [n["seconds"] for n in r["nodes"]],
            "exact": all(n["exact"] for n in r["nodes"]), "cpu_s": r["cpu_s"],
            "node_peak_rss_bytes": max(n["peak_rss_bytes"] for n in r["nodes"]),
            "relay_peak_rss_bytes": max(r["relay_peak_rss_bytes"]),
            "load_before": [round(x, 2) for x in load],
            "load_after": [round(x, 2) for x in os.getloadavg()]}


def compare_owners(v0: Path, v1: Path, args: argparse.Namespace, work: Path
                   ) -> dict[str, Any]:
    """The relay refit by each owner count of ``--compare-owners``, ``--rounds`` times,
    interleaved (each round starts with the count the last one ended with, so a busy spell
    of this shared machine falls on both); per count the median of its runs, and each
    count's median over the first's."""
    counts = [int(c) for c in args.compare_owners.split(",")]
    runs = []
    for r in range(args.rounds):
        for k in counts if r % 2 == 0 else counts[::-1]:
            runs.append({"round": r, **relay_run(v0, v1, args, work, k)})
            print(json.dumps(runs[-1]), flush=True)

    def median(k: int, key: str) -> float:
        return float(np.median([x[key] for x in runs if x["owners"] == k]))

    summary = {str(k): {key: median(k, key) for key in ("total_s", "publish_s",
                                                       "boundary_bytes")}
               for k in counts}
    first = summary[str(counts[0])]
    for s in summary.values():
        s["total_over_first"] = s["total_s"] / first["total_s"]
        s["boundary_over_first"] = s["boundary_bytes"] / first["boundary_bytes"]
    return {"runs": runs, "median": summary,
            "all_exact": all(x["exact"] for x in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    node = sub.add_parser("node")
    node.add_argument("--mode", required=True)
    node.add_argument("--base", required=True)
    node.add_argument("--endpoint", required=True)
    node.add_argument("--owners", type=int, default=1)
    node.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--pct", type=float, default=3.0)
    ap.add_argument("--data", choices=["synthetic", "real-adamw"], default="synthetic",
                    help="synthetic: --pct %% of elements moved by one ulp; real-adamw: one "
                    "AdamW step (lr 1e-6) of Llama-shaped tensors")
    ap.add_argument("--mbit", type=float, default=250.0)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--fanout", type=int, default=2)
    ap.add_argument("--owners", type=int, default=1,
                    help="encoders splitting the tensors, each publishing its part")
    ap.add_argument("--threads", type=int, default=2,
                    help="threads of each owner and each node's apply")
    ap.add_argument("--bucket-mib", type=int, default=256, help="dense MiB per payload")
    ap.add_argument("--topology", choices=["per-node", "shared"], default="per-node",
                    help="per-node: a link per rollout node; shared: one boundary link")
    ap.add_argument("--ways", default=",".join(WAYS),
                    help="which of full, dcr-s3, dcr-relay to run (comma-separated)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="keep the generated checkpoints here and reuse them")
    ap.add_argument("--compare-owners", default=None, metavar="N,M",
                    help="instead of the ways: the relay refit by each of these owner "
                    "counts, side by side (--rounds times, interleaved)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per owner count")
    ap.add_argument("--out", default="bench/results/transport.json")
    args = ap.parse_args()
    if args.cmd == "node":
        node_main(args)
        return
    if args.compare_owners:
        owners_main(args)
        return
    ways = args.ways.split(",")
    if not set(ways) <= set(WAYS):
        ap.error(f"--ways {args.ways!r}: choose from {', '.join(WAYS)}")
    global BUCKET_BYTES
    BUCKET_BYTES = args.bucket_mib << 20
    procs = Procs()
    work = Path(tempfile.mkdtemp(prefix="dcr-transport-"))
    n, mbit, rtt, shared = args.nodes, args.mbit, args.rtt_ms, args.topology == "shared"
    rows: dict[str, dict[str, Any]] = {}
    alone: dict[str, Any] = {}
    try:
        v0, v1 = make_checkpoints(work, args.gib, args.pct, args.data, args.cache)
        dense = v1.stat().st_size
        if ways != ["full"]:
            alone = stages_alone(v0, v1, args.owners, args.threads)
            alone |= owner_memory(v0, v1, work, args.threads)
            alone["largest_tensor_bytes"] = largest_tensor(v0)
            alone["bucket_bytes"] = BUCKET_BYTES
        s3_port = free_port()
        data = work / "s3"
        (data / BUCKET).mkdir(parents=True)
        procs.s3_pid = procs.start(
            [str(BIN / "rclone"), "serve", "s3", "--addr", f"127.0.0.1:{s3_port}",
             "--auth-key", f"{KEY},{SECRET}", str(data)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
        wait_http(f"http://127.0.0.1:{s3_port}/")
        if "full" in ways:
            rows["full"] = run_full(procs, s3_port, v1, n, mbit, rtt, shared)
        if "dcr-s3" in ways:
            rows["dcr-s3"] = run_dcr_s3(procs, s3_port, v0, v1, n, mbit, rtt, shared,
                                        args.owners, args.threads)
        if "dcr-relay" in ways:
            rows["dcr-relay"] = run_dcr_relay(procs, v0, v1, n, mbit, rtt, args.fanout, work,
                                              args.threads, args.owners)
    finally:
        procs.stop()
        shutil.rmtree(work, ignore_errors=True)
    link_bytes_s = mbit * 1e6 / 8
    doc: dict[str, Any] = {
        "benchmark": "transport",
        "command": " ".join(["python", "bench/transport.py", *sys.argv[1:]]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": {"nodes": n, "checkpoint_bytes": dense, "data": args.data,
                  "changed_pct": args.pct if args.data == "synthetic" else None,
                  "link_mbit": mbit, "rtt_ms": rtt, "relay_fanout": args.fanout,
                  "owners": args.owners, "threads": args.threads,
                  "topology": args.topology, "bucket_mib": args.bucket_mib,
                  "s3_server": "rclone serve s3", "cpus": os.cpu_count(),
                  "python": platform.python_version()},
        "results": rows,
    }
    if alone:
        alone["changed_pct"] = 100 * alone["changed_elements"] / alone["total_elements"]
        doc["stages_alone"] = alone
        doc["limit"] = limit(alone, args.threads, mbit, rtt, n)
        doc["over_limit"] = {k: r["total_s"] / doc["limit"]["limit_s"]
                             for k, r in rows.items() if k != "full"}
        doc["all_exact"] = all(r["exact"] for k, row in rows.items() if k != "full"
                               for r in row["nodes"])
    if "full" in rows:
        full = rows["full"]
        doc["speedup_vs_full"] = {k: full["total_s"] / r["total_s"] for k, r in rows.items()}
        doc["full_download_link_efficiency"] = (
            full["boundary_bytes"] / (full["total_s"] - full["publish_s"])
            / (link_bytes_s * (1 if shared else n)))
    if {"dcr-s3", "dcr-relay"} <= set(rows):
        doc["relay_vs_s3"] = rows["dcr-s3"]["total_s"] / rows["dcr-relay"]["total_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'way':<10} {'total s':>8} {'publish s':>9} {'boundary MB':>11} {'vs full':>8} "
          f"{'/ limit':>8}")
    for k, r in rows.items():
        vs = doc.get("speedup_vs_full", {}).get(k)
        over = doc.get("over_limit", {}).get(k)
        print(f"{k:<10} {r['total_s']:>8.2f} {r['publish_s']:>9.2f} "
              f"{r['boundary_bytes'] / 1e6:>11.1f} "
              f"{f'{vs:.1f}x' if vs else '-':>8} {f'{over:.2f}x' if over else '-':>8}")
    for k, r in rows.items():
        if "cpu_s" in r:
            print(f"{k} CPU seconds: " + ", ".join(f"{g} {v:.2f}" for g, v in r["cpu_s"].items()))
    if alone:
        lim = doc["limit"]
        print(f"limit {lim['limit_s']:.3f} s ({lim['slowest']}: encode {lim['encode_s']:.3f}, "
              f"link {lim['link_s']:.3f}, apply {lim['apply_s']:.3f}, rtt {lim['rtt_s']:.3f}; "
              f"on this machine's shared cores {lim['machine_s']:.3f}); "
              f"changed {alone['changed_pct']:.2f}%; all exact: {doc['all_exact']}")


def owners_main(args: argparse.Namespace) -> None:
    """``--compare-owners``: the relay refit by each owner count, into ``--out``."""
    global BUCKET_BYTES
    BUCKET_BYTES = args.bucket_mib << 20
    work = Path(tempfile.mkdtemp(prefix="dcr-transport-"))
    try:
        v0, v1 = make_checkpoints(work, args.gib, args.pct, "synthetic", args.cache)
        dense = v1.stat().st_size
        compared = compare_owners(v0, v1, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"benchmark": "transport-relay-owners",
           "command": " ".join(["python", "bench/transport.py", *sys.argv[1:]]),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "setup": {"nodes": args.nodes, "checkpoint_bytes": dense, "data": "synthetic",
                     "changed_pct": args.pct, "link_mbit": args.mbit, "rtt_ms": args.rtt_ms,
                     "relay_fanout": args.fanout, "threads": args.threads,
                     "topology": "per-node", "bucket_mib": args.bucket_mib,
                     "rounds": args.rounds, "cpus": os.cpu_count(),
                     "python": platform.python_version()},
           **compared}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for k, s in compared["median"].items():
        print(f"owners {k}: median total {s['total_s']:.2f} s "
              f"({s['total_over_first']:.2f}x the first), publish {s['publish_s']:.2f} s, "
              f"{s['boundary_bytes'] / 1e6:.1f} MB across the boundary")
    print(f"all exact: {compared['all_exact']}; wrote {args.out}")


if __name__ == "__main__":
    main()
