"""Codec benchmark: payload size against the entropy bound and common layouts, and speed.

Datasets (BF16, transformer-shaped tensors):
  real     two consecutive exports of fp32 master weights trained by torch AdamW
           (lr 1e-6, after warm-up steps), cast to BF16: the change pattern of RL refits;
  syn-P%   the same base with a uniform random P% of elements moved by one BF16 ulp.

For each: DCR payload bytes (mixed and overwrite-only), the empirical entropy bound
(positions as Bernoulli(p) per tensor + empirical entropy of the XOR masks over the
checkpoint), full-tensor XOR + zstd-1, int32 index + value + zstd-1, dense zstd-1;
encode (`dcr diff` path: compare, code, compress, store, fingerprints) and decode+apply
GB/s of dense bytes at 1 and 2 threads, the codec alone (compare, code, compress;
in memory, one thread), and peak traced memory. Writes JSON to
bench/results/ and prints a table. Not a test: it asserts nothing about speed.

    .venv/bin/python bench/codec.py            # full run (~0.7 GB checkpoint)
    .venv/bin/python bench/codec.py --quick    # small smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from safetensors.torch import save_file

from dcr.checkpoint import Checkpoint
from dcr.codec.decode import Target, apply_items, decode
from dcr.codec.encode import PayloadBuilder, diff_range, encode_item
from dcr.format.dtypes import dtype
from dcr.format.payload import read_payload
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.transport.store import FileStore

Arrays = dict[str, np.ndarray]


def model_shapes(
    hidden: int, inter: int, vocab: int, layers: int, kv: int
) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    s |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return s


def adamw_pair(shapes: dict[str, tuple[int, ...]], warmup: int, seed: int) -> tuple[Arrays, Arrays]:
    """BF16 exports before and after one AdamW step, after ``warmup`` steps."""
    g = torch.Generator().manual_seed(seed)
    params = {
        n: torch.nn.Parameter(torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02)
        for n, s in shapes.items()
    }
    opt = torch.optim.AdamW(params.values(), lr=1e-6, weight_decay=0.01)
    row_scale = {n: torch.exp(torch.randn(s[0], 1, generator=g)) for n, s in shapes.items()}

    def step() -> None:
        for n, p in params.items():
            grad = torch.randn(p.shape, generator=g)
            p.grad = grad * (row_scale[n] if p.dim() > 1 else 1.0)
        opt.step()

    def export() -> Arrays:
        return {
            n: p.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            .reshape(-1).copy()
            for n, p in params.items()
        }

    for _ in range(warmup):
        step()
    before = export()
    step()
    return before, export()


def synthetic(base: Arrays, rate: float, seed: int) -> Arrays:
    """Move a uniform ``rate`` of elements by one ulp (away from zero or toward it)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n, b in base.items():
        t = b.copy()
        idx = np.flatnonzero(rng.random(b.size) < rate)
        mag = t[idx] & 0x7FFF
        up = (rng.random(idx.size) < 0.5) & (mag < 0x7F7F) | (mag == 0)
        t[idx] = np.where(up, t[idx] + 1, t[idx] - 1)
        out[n] = t
    return out


def save(arrays: Arrays, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    save_file({n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).reshape(shapes[n])
               for n, a in arrays.items()}, str(path))


def entropy_bits(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    p = c / c.sum()
    return float(-(c * np.log2(p)).sum())


def bound_bytes(base: Arrays, target: Arrays) -> float:
    pos_bits = 0.0
    hist = np.zeros(1 << 16, dtype=np.int64)
    for n, b in base.items():
        t = target[n]
        idx = np.flatnonzero(b != t)
        p = idx.size / b.size
        if 0 < p < 1:
            pos_bits += b.size * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
        hist += np.bincount(b[idx] ^ t[idx], minlength=1 << 16)
    return (pos_bits + entropy_bits(hist)) / 8


def baselines(base: Arrays, target: Arrays) -> dict[str, int]:
    z = zstandard.ZstdCompressor(level=1)
    full_xor = int32 = dense = 0
    for n, b in base.items():
        t = target[n]
        full_xor += len(z.compress((b ^ t).tobytes()))
        idx = np.flatnonzero(b != t)
        int32 += len(z.compress(idx.astype(np.int32).tobytes() + t[idx].tobytes()))
        dense += len(z.compress(t.tobytes()))
    return {"full_xor_zstd1": full_xor, "int32_index_value_zstd1": int32, "dense_zstd1": dense}


def codec_encode(base: Arrays, target: Arrays, shapes: dict[str, tuple[int, ...]],
                 bucket: int) -> list[bytes]:
    """The codec alone on one thread: compare, code and compress into sealed payloads."""
    sealed, pb, size = [], None, 0
    bf16 = dtype("BF16")
    for n, b in base.items():
        if pb is None or size + b.nbytes > bucket:
            if pb is not None and pb.items:
                sealed.append(pb.seal())
            pb, size = PayloadBuilder(base_version=0, target_version=1, attempt="a-bench",
                                      owner=0, seq=len(sealed), mode="mixed"), 0
        for lo in range(0, b.size, 1 << 24):
            d = diff_range(name=n, dtype=bf16, shape=shapes[n], start=lo,
                           base=b[lo : lo + (1 << 24)], target=target[n][lo : lo + (1 << 24)],
                           entry="xor")
            if d is not None:
                pb.add(encode_item(d), dense_bytes=d.values.nbytes)
        size += b.nbytes
    if pb is not None and pb.items:
        sealed.append(pb.seal())
    return sealed


def timed(f: Callable[[], Any], reps: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t0)
    return best, out


def peak_traced(f: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        f()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def run_dataset(name: str, base: Arrays, target: Arrays, shapes: dict[str, tuple[int, ...]],
                work: Path, reps: int, bucket_mib: int) -> dict[str, Any]:
    d = work / name
    d.mkdir()
    save(base, shapes, d / "base.safetensors")
    save(target, shapes, d / "target.safetensors")
    dense = sum(a.nbytes for a in base.values())
    changed = sum(int(np.count_nonzero(base[n] != target[n])) for n in base)
    res: dict[str, Any] = {"dataset": name, "dense_bytes": dense, "changed_elements": changed,
                           "total_elements": dense // 2, "change_pct": 100 * changed / (dense // 2)}

    def encode(threads: int, mode: str = "mixed", store_dir: str = "store") -> Any:
        shutil.rmtree(d / store_dir, ignore_errors=True)
        with Checkpoint(d / "base.safetensors") as b, Checkpoint(d / "target.safetensors") as t:
            return diff_checkpoints(b, t, FileStore(d / store_dir), EncodeSettings(
                target_version=1, base_version=0, mode=mode,  # type: ignore[arg-type]
                threads=threads, bucket_bytes=bucket_mib << 20))

    for threads in (1, 2):
        sec, m = timed(lambda threads=threads: encode(threads), reps)
        res[f"encode_s_{threads}t"] = sec
        res[f"encode_gbps_{threads}t"] = dense / sec / 1e9
    res["payload_bytes"] = m.stats.payload_bytes
    res["payloads"] = len(m.payloads)
    sec, _ = timed(lambda: codec_encode(base, target, shapes, bucket_mib << 20), reps)
    res["codec_encode_gbps_1t"] = dense / sec / 1e9
    res["peak_traced_encode_bytes"] = peak_traced(lambda: encode(1, store_dir="store-mem"))
    ow = encode(2, mode="overwrite", store_dir="store-ow")
    res["overwrite_only_bytes"] = ow.stats.payload_bytes

    blobs = [(d / "store" / e.key).read_bytes() for e in m.payloads]
    shapes_t = {n: tuple(shapes[n]) for n in base}

    def apply(threads: int) -> Arrays:
        out = {n: a.copy() for n, a in base.items()}
        targets = {n: Target(dtype="BF16", shape=shapes_t[n], bits=out[n]) for n in out}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            items = [i for its in pool.map(lambda blob: decode(read_payload(blob)), blobs)
                     for i in its]
        apply_items(items, targets, threads=threads)
        apply.seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
        return out

    for threads in (1, 2):
        best = math.inf
        for _ in range(reps):
            out = apply(threads)
            best = min(best, apply.seconds)  # type: ignore[attr-defined]
        assert all(np.array_equal(out[n], target[n]) for n in target), "decode+apply not exact"
        res[f"apply_s_{threads}t"] = best
        res[f"apply_gbps_{threads}t"] = dense / best / 1e9
    res["bit_exact"] = True
    res["peak_traced_apply_bytes"] = peak_traced(lambda: apply(1)) - dense  # minus the copy
    res["entropy_bound_bytes"] = bound_bytes(base, target)
    res |= baselines(base, target)
    res["ratio_to_bound"] = res["payload_bytes"] / res["entropy_bound_bytes"]
    res["payload_pct_dense"] = 100 * res["payload_bytes"] / dense
    res["bytes_per_changed"] = res["payload_bytes"] / max(1, changed)
    res["vs_full_xor"] = res["full_xor_zstd1"] / res["payload_bytes"]
    res["vs_int32_index_value"] = res["int32_index_value_zstd1"] / res["payload_bytes"]
    res["largest_tensor_bytes"] = max(a.nbytes for a in base.values())
    res["bucket_bytes"] = bucket_mib << 20
    shutil.rmtree(d)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small tensors, one repetition")
    ap.add_argument("--out", default="bench/results/codec.json")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.quick:
        shapes = model_shapes(hidden=256, inter=688, vocab=1024, layers=2, kv=64)
        args.reps = 1
    else:  # about 0.67 GB of BF16: Llama-style, hidden 2048, 4 layers, vocab 32000
        shapes = model_shapes(hidden=2048, inter=5632, vocab=32000, layers=4, kv=512)
    t0 = time.perf_counter()
    base, target = adamw_pair(shapes, warmup=5, seed=0)
    print(f"generated {sum(a.nbytes for a in base.values()) / 2**20:.0f} MiB BF16 in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    datasets = {"real-adamw": target}
    for pct in (1, 3, 5):
        datasets[f"syn-{pct}%"] = synthetic(base, pct / 100, seed=pct)
    results = []
    with tempfile.TemporaryDirectory(prefix="dcr-bench-") as work:
        for name, tgt in datasets.items():
            r = run_dataset(name, base, tgt, shapes, Path(work), args.reps, args.bucket_mib)
            results.append(r)
            print(f"{name}: done", file=sys.stderr)
    doc = {
        "benchmark": "codec",
        "command": "python bench/codec.py" + (" --quick" if args.quick else ""),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "zstandard": zstandard.__version__,
                    "platform": platform.platform()},
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(results))
    print(f"wrote {out}")


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'dataset':<11} {'chg %':>6} {'DCR %dense':>10} {'x bound':>8} {'B/chg':>6} "
            f"{'vs fullXOR':>10} {'vs int32':>8} {'ow-only %':>9} {'dense zstd %':>12} "
            f"{'codec enc 1t':>12} {'diff GB/s 1t/2t':>15} {'apply GB/s 1t/2t':>17}")
    lines = [head]
    for r in rows:
        d = r["dense_bytes"]
        lines.append(
            f"{r['dataset']:<11} {r['change_pct']:>6.2f} {r['payload_pct_dense']:>10.3f} "
            f"{r['ratio_to_bound']:>8.3f} {r['bytes_per_changed']:>6.3f} {r['vs_full_xor']:>9.2f}x "
            f"{r['vs_int32_index_value']:>7.2f}x {100 * r['overwrite_only_bytes'] / d:>9.3f} "
            f"{100 * r['dense_zstd1'] / d:>12.2f} "
            f"{r['codec_encode_gbps_1t']:>12.2f} "
            f"{r['encode_gbps_1t']:>7.2f}/{r['encode_gbps_2t']:<7.2f} "
            f"{r['apply_gbps_1t']:>8.2f}/{r['apply_gbps_2t']:<8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
