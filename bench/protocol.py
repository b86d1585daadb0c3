"""Protocol benchmark: overhead per refit and the cost of recovering from a failure.

Two rollout pods on loopback, each a ``dcr serve`` reference server holding both ranks
of a tensor-parallel pair of the vLLM-layout reference runtime (a ~1 GiB BF16
Llama-shaped model) and a ``dcr agent`` sidecar driving it over HTTP through a shared
staging directory: four engine ranks. An in-process encoder (the trainer API) publishes
to a file store; the coordinator drives the agents over HTTP and commits in SQLite.
Refits alternate between two checkpoints that differ in 1% of the elements, so every
refit moves 1% of the elements.

* overhead: a refit whose candidate equals the baseline (no payloads) measures the
  protocol's own stages (prepare + gate + open_apply, flush, commit, finish); the same
  stages are also reported inside the 1% refits.
* clean: 1% refits, median wall time.
* recovery: 1% refits whose first attempt's last payload is corrupted in the store, so
  every agent detects it only after applying the others (late detection): the attempt
  fails, every agent stops, and the overwrite retry commits. Ratio to clean.

Writes bench/results/protocol.json. Not a test: nothing here asserts speed.

    .venv/bin/python bench/protocol.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from dcr.checkpoint import Checkpoint
from dcr.format.layout import parse_payload_key
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.encoder import Encoder
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.records import CommitRecord
from dcr.refit.launch import AgentProcess, Process, ServeProcess
from dcr.transport.store import FileStore

OVERHEAD_STAGES = ("prepare", "flush", "commit", "finish")


def make_checkpoints(root: Path, layers: int, rate: float) -> tuple[Path, Path]:
    """Two sharded BF16 checkpoints of one Llama config, differing in ``rate`` of elements."""
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                      tie_word_embeddings=False)
    shapes = {"model.embed_tokens.weight": (32000, 2048), "lm_head.weight": (32000, 2048),
              "model.norm.weight": (2048,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + f"self_attn.{x}_proj.weight": (2048, 2048) for x in "qkvo"}
        shapes |= {p + "mlp.gate_proj.weight": (5504, 2048), p + "mlp.up_proj.weight":
                   (5504, 2048), p + "mlp.down_proj.weight": (2048, 5504),
                   p + "input_layernorm.weight": (2048,),
                   p + "post_attention_layernorm.weight": (2048,)}
    gen = torch.Generator().manual_seed(0)
    a, b = root / "a", root / "b"
    for d in (a, b):
        d.mkdir(parents=True)
        cfg.save_pretrained(d)
    index: dict[str, str] = {}
    names = sorted(shapes)
    for shard, start in enumerate(range(0, len(names), 8)):
        part = names[start : start + 8]
        ta, tb = {}, {}
        for n in part:
            t = (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16)
            mask = torch.rand(shapes[n], generator=gen) < rate
            u = t.clone()
            u[mask] = (t[mask].float() * 1.01 + 1e-3).to(torch.bfloat16)
            ta[n], tb[n] = t, u
        fname = f"model-{shard:05d}.safetensors"
        save_file(ta, a / fname)
        save_file(tb, b / fname)
        index |= {n: fname for n in part}
    for d in (a, b):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return a, b


class CorruptLast:
    """A store that flips one byte of owner 0's payload ``seq`` for flagged attempts."""

    def __init__(self, inner: FileStore) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.attempts: set[str] = set()
        self.seq = 0

    def put(self, key: str, data: bytes) -> None:
        k = parse_payload_key(key)
        if k is not None and k.attempt in self.attempts and (k.owner, k.seq) == (0, self.seq):
            data = data[:-1] + bytes([data[-1] ^ 0x40])
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, 2 repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/protocol.json")
    args = ap.parse_args()
    layers, repeats = (1, 2) if args.quick else (8, args.repeats)
    root = Path(tempfile.mkdtemp(prefix="dcr-bench-protocol-"))
    try:
        result = run(root, layers, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "refits"}, indent=1))


def run(root: Path, layers: int, repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    a, b = make_checkpoints(root / "ckpt", layers, 0.01)
    print(f"checkpoints written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    token = secrets.token_hex(16)
    store = CorruptLast(FileStore(root / "store"))
    staging = [root / f"pod-{i}" / "staging" for i in range(2)]
    servers = [ServeProcess(name=f"serve-{i}", workdir=root / f"pod-{i}" / "serve",
                            args=["--model", str(a), "--runtime", "vllm-ref", "--tp-size", "2",
                                  "--staging-dir", str(staging[i]), "--checkpoint-root",
                                  str(root / "ckpt")]) for i in range(2)]
    agents = [AgentProcess(name=f"agent-{i}", token=token, state_dir=root / f"pod-{i}" / "agent",
                           args=["--store", store.uri, "--engine-url", servers[i].url,
                                 "--staging-dir", str(staging[i]), "--canonical", str(a)])
              for i in range(2)]
    procs: list[Process] = [*servers, *agents]
    for d in staging:
        d.mkdir(parents=True)
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.wait_ready(600)
        clients = [ag.client(timeout_s=120) for ag in agents]
        profile = merge(ReceiverProfile.model_validate(c.profile()) for c in clients)
        ckpt = {0: Checkpoint(a), 1: Checkpoint(b)}
        dense = sum(i.nbytes for i in ckpt[0])
        enc = Encoder(store=store, baseline=ckpt[0], version=0, profile=profile)
        commits = SqliteCommitStore(root / "commit.db", CommitRecord(
            committed_version=0, baseline_id="ckpt-0", attempt=""))
        coord = Coordinator(commits, [enc], clients)
        refits: list[dict[str, Any]] = []

        def refit(kind: str, same: bool = False) -> dict[str, Any]:
            v = enc.version + 1
            other = ckpt[1] if enc.baseline is ckpt[0] else ckpt[0]
            enc.set_candidate(enc.baseline if same else other, v)
            first = len(coord.history)
            t = time.perf_counter()
            coord.refit(v, f"ckpt-{v}")
            total = time.perf_counter() - t
            hist = coord.history[first:]
            row = {"kind": kind, "version": v, "total_s": total,
                   "attempts": [(h.mode, h.outcome.split(":")[0]) for h in hist],
                   "stages": hist[-1].stages,
                   "overhead_s": sum(hist[-1].stages.get(s, 0.0) for s in OVERHEAD_STAGES),
                   "payload_bytes": enc.manifests[-1].stats.payload_bytes,
                   "payloads": len(enc.manifests[-1].payloads)}
            refits.append(row)
            print(f"{kind:>9} v{v}: {total:6.2f} s, overhead {row['overhead_s']:.3f} s, "
                  f"{row['attempts']}", file=sys.stderr)
            return row

        refit("warmup")
        clean = [refit("clean") for _ in range(repeats)]
        empty = [refit("no-change", same=True) for _ in range(repeats)]
        store.seq = clean[0]["payloads"] - 1  # the last payload of owner 0
        original = coord._run

        def flag_first(attempt: Any, *rest: Any) -> Any:
            if attempt.mode == "mixed":  # the first attempt; the retry runs clean
                store.attempts.add(attempt.id)
            return original(attempt, *rest)

        coord._run = flag_first  # type: ignore[method-assign]
        recovery = [refit("recovery") for _ in range(repeats)]
        coord._run = original  # type: ignore[method-assign]
        for c in ckpt.values():
            c.close()
        coord.close()
    finally:
        for proc in procs:
            proc.stop()
    med = statistics.median
    t_clean, t_rec = med(r["total_s"] for r in clean), med(r["total_s"] for r in recovery)
    return {
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "machine": platform.machine()},
        "model": {"dense_bytes": dense, "layers": layers, "change_rate": 0.01,
                  "agents": "2 pods (dcr serve + dcr agent), each a vLLM-layout TP2 pair"},
        # The protocol alone: a refit with nothing to send (no encode, no apply work).
        "protocol_overhead_s": med(r["overhead_s"] for r in empty),
        # The same stages inside 1% refits; flush there includes the apply's tail.
        "prepare_flush_commit_finish_in_1pct_refits_s": med(r["overhead_s"] for r in clean),
        "clean_refit_s_median": t_clean,
        "recovery_refit_s_median": t_rec,
        "recovery_over_clean": t_rec / t_clean,
        "recovery_attempts": recovery[0]["attempts"],
        "refits": refits,
    }


if __name__ == "__main__":
    main()
