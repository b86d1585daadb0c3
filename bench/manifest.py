"""Manifest benchmark: how many bytes a manifest costs, by encoding, next to its payloads.

Models:
  main-job   the model ``dcr refit`` / ``make demo`` trains (trainer defaults), one real
             AdamW step after its warm-up, encoded as the main job does (two owners: two
             manifest parts, summed);
  llama-102  the trainer's Llama at 11 layers and width 512: 102 tensors, the size of
             model the manifest was first measured on (one owner);
  moe-many   a synthetic MoE checkpoint with thousands of tensors (8 layers x 128 experts
             x 3 projections plus attention, BF16), a uniform 1% of elements moved by one
             ulp (one owner).

For each: the manifest as format version 1 wrote it (JSON, indent 1: the same model
dumped as the v1 writer did, ``format_version`` 1) and where its bytes go (fingerprint
and name values with their quotes, whitespace, the rest: keys, punctuation, numbers, payload
keys and digests); compact JSON; compact JSON in zstd at several levels; the
version 2 object as the writer seals it; and two bounds: an ideal binary layout (16 raw
bytes per distinct fingerprint plus the rest of the document at zstd level 19) and the
fingerprints' own entropy (16 bytes per distinct fingerprint: they are random). Also the
payload bytes of the same step, and the seconds to seal and read the manifest. Writes
``bench/results/manifest.json`` with the command that made it. Not a test: it asserts
nothing.

    .venv/bin/python bench/manifest.py            # ~3 minutes on 2 cores
    .venv/bin/python bench/manifest.py --quick    # main-job only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from dcr.checkpoint import ArrayCheckpoint, Checkpoint, TensorSource
from dcr.format.manifest import LEVEL, PREAMBLE_SIZE, Manifest
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.refit.trainer import Trainer, TrainerSettings
from dcr.transport.store import MemoryStore

OUT = Path(__file__).resolve().parent / "results" / "manifest.json"
_FP = re.compile(rb'"xxh3-128:[0-9a-f]{32}"')
_NAME = re.compile(rb'(?<="name": )"[^"]*"')


def trained(settings: TrainerSettings, work: Path) -> tuple[Path, Path]:
    t = Trainer(settings)
    v0 = t.export(work / "v0")
    t.step()
    return v0, t.export(work / "v1")


def moe(layers: int, experts: int, rate: float, seed: int = 0) -> tuple[TensorSource, TensorSource]:
    """BF16 bits of a small-expert MoE and the same with ``rate`` of elements one ulp off."""
    rng = np.random.default_rng(seed)
    hidden, expert_inter, kv = 256, 128, 64
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (4096, hidden),
                                          "model.norm.weight": (hidden,),
                                          "lm_head.weight": (4096, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (hidden, hidden),
                   p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden),
                   p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate.weight": (experts, hidden)}
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": (expert_inter, hidden),
                       q + "up_proj.weight": (expert_inter, hidden),
                       q + "down_proj.weight": (hidden, expert_inter)}
    base, target = {}, {}
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        b = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
        b = (b >> 16).astype(np.uint16)
        t = b.copy()
        idx = np.flatnonzero(rng.random(n) < rate)
        t[idx] = np.where(t[idx] & 0x7FFF, t[idx] - 1, t[idx] + 1)
        base[name], target[name] = ("BF16", shape, b), ("BF16", shape, t)
    return ArrayCheckpoint(base), ArrayCheckpoint(target)


def v1_bytes(m: Manifest) -> bytes:
    """The manifest as format version 1 wrote it: the model as indented JSON."""
    doc = m.model_dump_json(indent=1)
    return doc.replace('"format_version": 2', '"format_version": 1', 1).encode()


def measure(parts: list[Manifest]) -> dict[str, Any]:
    """Bytes of every encoding, summed over the manifest parts of one attempt."""
    out: dict[str, Any] = {}

    def add(key: str, n: int) -> None:
        out[key] = out.get(key, 0) + n

    for m in parts:
        v1, compact = v1_bytes(m), m.document()
        add("v1_json_indent1", len(v1))
        add("v1_fingerprints", sum(len(x) for x in _FP.findall(v1)))
        add("v1_names", sum(len(x) for x in _NAME.findall(v1)))
        add("v1_whitespace", len(v1) - len(compact))  # the same document, compact
        add("compact_json", len(compact))
        for level in (1, 3, 9, 19):
            z = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(compact)
            add(f"zstd{level}_compact_json_in_container", PREAMBLE_SIZE + len(z))
        add("v2", len(m.pack()))
        fps = {x for t in m.tensors for x in (t.base, t.target)}
        rest = _FP.sub(b'""', compact)
        add("bound_binary_fingerprints", PREAMBLE_SIZE + 16 * len(fps) + len(
            zstandard.ZstdCompressor(level=19).compress(rest)))
        add("bound_fingerprint_entropy", 16 * len(fps))
        add("distinct_fingerprints", len(fps))
        add("tensors", len(m.tensors))
        add("payloads", len(m.payloads))
        add("payload_bytes", m.stats.payload_bytes)
        add("changed_elements", m.stats.changed_elements)
        add("total_elements", m.stats.total_elements)
        add("dense_bytes", m.stats.dense_bytes)
    out["v1_rest"] = (out["v1_json_indent1"] - out["v1_fingerprints"] - out["v1_names"]
                      - out["v1_whitespace"])
    out["changed_pct"] = 100 * out["changed_elements"] / out["total_elements"]
    out["v1_pct_of_payload"] = 100 * out["v1_json_indent1"] / out["payload_bytes"]
    out["v2_pct_of_payload"] = 100 * out["v2"] / out["payload_bytes"]
    out["v1_over_v2"] = out["v1_json_indent1"] / out["v2"]
    out["v2_over_binary_bound"] = out["v2"] / out["bound_binary_fingerprints"]
    out["v1_bytes_per_tensor"] = out["v1_json_indent1"] / max(1, out["tensors"])
    out["v2_bytes_per_tensor"] = out["v2"] / max(1, out["tensors"])
    return out


def timings(parts: list[Manifest], repeat: int = 5) -> dict[str, float]:
    """Best seconds to seal and to read every part, and the traced peak of one read."""
    packed = [m.pack() for m in parts]
    seal = min(_time(lambda: [m.pack() for m in parts]) for _ in range(repeat))
    read = min(_time(lambda: [Manifest.parse(d, "bench") for d in packed])
               for _ in range(repeat))
    tracemalloc.start()
    for d in packed:
        Manifest.parse(d, "bench")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    entries = sum(len(m.tensors) + len(m.payloads) for m in parts)
    return {"seal_s": seal, "read_s": read, "read_us_per_entry": 1e6 * read / entries,
            "read_peak_bytes": peak, "read_peak_bytes_per_entry": peak / entries}


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def encode(base: TensorSource, target: TensorSource, owners: int) -> list[Manifest]:
    store = MemoryStore()
    return [diff_checkpoints(base, target, store, EncodeSettings(
        target_version=1, base_version=0, owner=k, owners=owners, attempt="a-bench",
        attempt_manifest=True)) for k in range(owners)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the main job's model only")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        models: list[tuple[str, dict[str, Any], Any]] = [
            ("main-job", {"owners": 2}, lambda: trained(TrainerSettings(), Path(tmp, "a"))),
        ]
        if not args.quick:
            models += [
                ("llama-102", {"owners": 1}, lambda: trained(TrainerSettings(
                    layers=11, hidden_size=512, intermediate_size=1376,
                    max_shard_size="64MB"), Path(tmp, "b"))),
                ("moe-many", {"owners": 1}, lambda: moe(layers=8, experts=128, rate=0.01)),
            ]
        for name, how, make in models:
            t0 = time.perf_counter()
            a, b = make()
            base = Checkpoint(a) if isinstance(a, Path) else a
            target = Checkpoint(b) if isinstance(b, Path) else b
            parts = encode(base, target, how["owners"])
            row = {"model": name, "owners": how["owners"], **measure(parts),
                   **timings(parts), "build_s": time.perf_counter() - t0}
            results.append(row)
            print(f"{name:10} {row['tensors']:6} tensors  payload {row['payload_bytes']:>9} B  "
                  f"manifest v1 {row['v1_json_indent1']:>8} B ({row['v1_pct_of_payload']:.1f}%)"
                  f"  v2 {row['v2']:>7} B ({row['v2_pct_of_payload']:.2f}%)  "
                  f"{row['v1_over_v2']:.1f}x smaller, {row['v2_over_binary_bound']:.2f}x the "
                  "binary bound")
    doc = {
        "command": "python bench/manifest.py" + (" --quick" if args.quick else ""),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "zstd": zstandard.ZSTD_VERSION},
        "writer_level": LEVEL,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
