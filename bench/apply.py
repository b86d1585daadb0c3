"""Apply benchmark: in-place apply through the vLLM-layout reference runtime.

Measures, on one thread, the time to apply a ~1% BF16 delta to one rank through its
native loader under interception, split into decode (verify, decompress, validate),
scatter (positions, staging, DCR's deferred writes), loader (the runtime's own code) and
intercept (DCR's hook in the loader calls), as GB/s of dense-equivalent bytes
(the canonical tensors' bytes, and the bytes the rank holds); beside it, a dense
refit of the same rank through the same loader. Also: the coverage report (share of
weight bytes per class, merged over ranks) for each runtime, the scratch reserved
against the largest canonical tensor, and a 10-step bit-exactness check for every
runtime, TP 1/2/4, EP on/off, both modes. Writes bench/results/apply.json. Not a
test: nothing here asserts speed.

    .venv/bin/python bench/apply.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from dcr.apply.applier import Applier, CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.format.profile import coverage, merge
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.hf import HFRuntime
from dcr.runtimes.loader import VllmRuntime
from dcr.runtimes.vllm_reference import (
    ReferenceConfig,
    ReferenceModel,
    dense_state,
    random_checkpoint,
)
from dcr.transport.store import MemoryStore

State = dict[str, torch.Tensor]


def source(sd: State) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.contiguous().view(torch.int16)
                                .numpy().view(np.uint16)) for n, t in sd.items()})


def canonical(sd: State) -> list[CanonicalTensor]:
    return [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape)) for n, t in sd.items()]


def one_ulp(sd: State, rate: float, seed: int) -> State:
    """A uniform ``rate`` of elements moved by one BF16 ulp (away from zero)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in sd.items():
        bits = t.view(torch.int16).clone()
        mask = torch.rand(t.shape, generator=gen) < rate
        bits[mask] += 1
        out[n] = bits.view(torch.bfloat16)
    return out


def throughput_config(quick: bool) -> ReferenceConfig:
    """The Llama-shaped model the throughput runs use (0.62 GB BF16; ``quick``: small)."""
    if quick:
        return ReferenceConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408,
                               num_layers=2, num_heads=8, num_kv_heads=8,
                               tie_word_embeddings=False)
    return ReferenceConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_layers=4, num_heads=16, num_kv_heads=4,
                           tie_word_embeddings=False)


def throughput(cfg: ReferenceConfig, tp: int, reps: int) -> dict[str, Any]:
    base = random_checkpoint(cfg, 0)
    dense_bytes = sum(t.numel() * t.element_size() for t in base.values())
    model = ReferenceModel(cfg, tp_size=tp, tp_rank=0)
    model.load_weights(base.items())
    engine = Applier(VllmRuntime(model))
    profile = engine.prewarm(canonical(base))
    best: dict[str, Any] = {}
    for rep in range(reps):
        new = one_ulp(base, 0.01, seed=rep)
        store = MemoryStore()
        m = diff_checkpoints(source(base), source(new), store, EncodeSettings(
            target_version=rep + 1, base_version=rep, profile=profile, attempt=f"a-{rep}"))
        payloads = [store.get(e.key) for e in m.payloads]
        t0 = time.perf_counter()
        report = engine.apply_payloads(payloads)
        seconds = time.perf_counter() - t0
        if not best or seconds < best["seconds"]:
            best = {"seconds": seconds, "decode_s": report.decode_s,
                    "scatter_s": report.scatter_s, "loader_s": report.loader_s,
                    "intercept_s": report.intercept_s, "loads": report.loads,
                    "deferred": report.deferred, "records": report.records,
                    "tensors": report.tensors}
        base = new
    t0 = time.perf_counter()
    model.load_weights(base.items())
    dense_s = time.perf_counter() - t0
    largest = max(t.numel() * t.element_size() for t in base.values())
    rank_bytes = sum(t.numel() * t.element_size() for t in dense_state(model).values())
    return {
        "tp": tp, "rank": 0, "dense_bytes": dense_bytes, "rank_bytes": rank_bytes, **best,
        "apply_gbps": dense_bytes / best["seconds"] / 1e9,
        "apply_gbps_rank_bytes": rank_bytes / best["seconds"] / 1e9,
        "dense_refit_s": dense_s, "speedup_vs_dense_refit": dense_s / best["seconds"],
        "scratch_bytes": engine._scratch.numel(), "largest_tensor_bytes": largest,
        "scratch_vs_largest": engine._scratch.numel() / largest,
    }


def bit_exact_run(cfg: ReferenceConfig, tp: int, ep: bool, mode: str, steps: int) -> bool:
    params = {n: torch.nn.Parameter(t.float()) for n, t in random_checkpoint(cfg, 1).items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    export = lambda: {n: p.detach().to(torch.bfloat16) for n, p in params.items()}  # noqa: E731
    old = export()
    ranks = [ReferenceModel(cfg, tp_size=tp, tp_rank=r, ep=ep) for r in range(tp)]
    engines = []
    for model in ranks:
        model.load_weights(old.items())
        engines.append(Applier(VllmRuntime(model)))
    profile = merge(e.prewarm(canonical(old)) for e in engines)
    store = MemoryStore()
    for v in range(1, steps + 1):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        new = export()
        m = diff_checkpoints(source(old), source(new), store, EncodeSettings(
            target_version=v, base_version=v - 1, mode=mode, profile=profile))  # type: ignore[arg-type]
        for e in engines:
            e.apply_payloads([store.get(x.key) for x in m.payloads])
        old = new
    for r, model in enumerate(ranks):
        dense = ReferenceModel(cfg, tp_size=tp, tp_rank=r, ep=ep)
        dense.load_weights(old.items())
        a, b = dense_state(model), dense_state(dense)
        if any(not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a):
            return False
    return True


def hf_bit_exact_run(kind: str, mode: str, steps: int) -> bool:
    """The same check through transformers models (HFRuntime, load_state_dict)."""
    small = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}

    def build() -> torch.nn.Module:
        if kind == "llama":
            return LlamaForCausalLM(LlamaConfig(**small))
        return MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4,
                                                num_experts_per_tok=2))

    torch.manual_seed(0)
    master = build()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-4)
    export = lambda: {n: t.detach().to(torch.bfloat16)  # noqa: E731
                      for n, t in master.state_dict().items()}
    old = export()
    receiver = build().to(torch.bfloat16)
    runtime = HFRuntime(receiver)
    runtime.load_weights(old.items())
    engine = Applier(runtime)
    profile = engine.prewarm(canonical(old))
    store = MemoryStore()
    for v in range(1, steps + 1):
        tokens = torch.randint(0, 128, (2, 16))
        loss = master(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        new = export()
        m = diff_checkpoints(source(old), source(new), store, EncodeSettings(
            target_version=v, base_version=v - 1, mode=mode, profile=profile))  # type: ignore[arg-type]
        engine.apply_payloads([store.get(x.key) for x in m.payloads])
        old = new
    dense = build().to(torch.bfloat16)
    HFRuntime(dense).load_weights(old.items())
    a, b = receiver.state_dict(), dense.state_dict()
    return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def coverage_rows(cfgs: dict[str, ReferenceConfig]) -> dict[str, dict[str, float]]:
    rows = {}
    for label, cfg in cfgs.items():
        ckpt = random_checkpoint(cfg, 0)
        nbytes = {n: t.numel() * t.element_size() for n, t in ckpt.items()}
        tp = 2
        profiles = [Applier(VllmRuntime(ReferenceModel(cfg, tp_size=tp, tp_rank=r,
                                                           ep=cfg.num_experts > 0)))
                    .prewarm(canonical(ckpt)) for r in range(tp)]
        rows[f"vllm-reference {label} (TP{tp})"] = coverage(merge(profiles), nbytes)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2)).to(torch.bfloat16)
    sd = {n: t.detach() for n, t in llama.state_dict().items()}
    prof = Applier(HFRuntime(llama)).prewarm(canonical(sd))
    rows["transformers Llama"] = coverage(prof, {n: t.numel() * 2 for n, t in sd.items()})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results/apply.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    small = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 4}
    cfgs = {
        "dense+fp8 o_proj": ReferenceConfig(**small, tie_word_embeddings=True,
                                            fp8_modules=("self_attn.o_proj",)),
        "moe": ReferenceConfig(**small, tie_word_embeddings=False, num_experts=8,
                               moe_intermediate_size=32),
    }
    big = throughput_config(args.quick)
    rows = [throughput(big, tp, reps=1 if args.quick else 3) for tp in (1, 2)]
    print(f"{'TP':>3} {'apply GB/s':>10} {'rank GB/s':>9} {'decode s':>8} {'scatter s':>9} "
          f"{'loader s':>9} {'intercept s':>11} "
          f"{'dense refit s':>13} {'vs dense':>8} {'scratch/largest':>15}")
    for r in rows:
        print(f"{r['tp']:>3} {r['apply_gbps']:>10.2f} {r['apply_gbps_rank_bytes']:>9.2f} "
              f"{r['decode_s']:>8.3f} {r['scatter_s']:>9.3f} {r['loader_s']:>9.3f}"
              f" {r['intercept_s']:>11.3f} {r['dense_refit_s']:>13.3f} "
              f"{r['speedup_vs_dense_refit']:>7.1f}x {r['scratch_vs_largest']:>15.2f}")
    steps = 3 if args.quick else 10
    exact = {}
    for label, cfg in cfgs.items():
        for tp in (1, 2, 4):
            for ep in ((False, True) if cfg.num_experts else (False,)):
                for mode in ("mixed", "overwrite"):
                    key = f"{label} TP{tp} EP{'on' if ep else 'off'} {mode}"
                    exact[key] = bit_exact_run(cfg, tp, ep, mode, steps)
                    print(f"{key}: {steps} steps bit-exact = {exact[key]}", file=sys.stderr)
    for kind in ("llama", "mixtral"):
        for mode in ("mixed", "overwrite"):
            key = f"transformers {kind} {mode}"
            exact[key] = hf_bit_exact_run(kind, mode, steps)
            print(f"{key}: {steps} steps bit-exact = {exact[key]}", file=sys.stderr)
    cov = coverage_rows(cfgs)
    for label, c in cov.items():
        print(f"coverage {label}: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in c.items()))
    doc = {
        "benchmark": "apply",
        "command": "python bench/apply.py" + (" --quick" if args.quick else ""),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": 1},
        "throughput_config": {k: str(v) for k, v in vars(big).items()},
        "throughput": rows, "bit_exact_steps": steps, "bit_exact": exact, "coverage": cov,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"all bit-exact: {all(exact.values())}; wrote {args.out}")


if __name__ == "__main__":
    main()
