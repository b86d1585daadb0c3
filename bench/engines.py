"""Engine benchmark: a refit through vLLM's real Llama on CPU, four ways, side by side.

One vLLM ``LlamaForCausalLM`` (vLLM 0.33's own class, built on CPU in BF16 as the
engine tier builds it) holds version v0, a random model. The new versions are:

* ``adamw``: one real AdamW step of its transformers twin (lr 1e-6 on random tokens:
  about 1-2% of the BF16 elements change);
* ``ulp-1%``, ``ulp-3%``, ``ulp-5%`` (``--rates``): that share of the elements, drawn
  uniformly, moved by one BF16 ulp (a change rate set exactly; uniform positions are
  the worst case for locality).

Each new version is applied, on a model of its own starting from v0 every time:

* ``dcr``: payloads from ``diff_checkpoints`` with the receiver's profile, applied in
  place by ``Applier`` through the model's ``load_weights`` (deferrable tensors in
  one call, writes after it is checked); wire bytes are the payloads plus the manifest;
* ``dcr_staged``: the same payloads through ``Applier(defer=False)``: every tensor
  staged in scratch and loaded one call each, the path every tensor took before;
* ``vllm_patch``: vLLM's own sparse path, ``load_checkpoint_weight_patches`` with one
  ``CheckpointWeightPatch`` (flat int32 indices, BF16 values) per changed tensor, NaN-
  masked through the same ``load_weights``; wire bytes are 4 + 2 per changed element,
  what its ``sparse_nccl`` backend broadcasts;
* ``dense``: ``load_weights`` of the whole new checkpoint, already in memory; wire bytes
  are the checkpoint's tensors.

Repeats are interleaved (repeat 1 of every method, then repeat 2, ...), so a burst of
other work on the machine hits every method alike. Each time is the best and the median
of ``--repeat`` runs on ``--threads`` torch threads, wall clock and the thread's CPU
time; dense-equivalent GB/s is the checkpoint's bytes over the best wall time (one
thread: per core). Every method must end bit-identical (integer views of every parameter
and buffer) to the dense load. Apply times exclude building payloads or patches (the
sender's work) and reading files. ``--profile`` adds cProfile's top functions for one
``dcr`` and ``dcr_staged`` apply of the first ``ulp`` case (each function's least
time over 3 profiled runs). Writes ``bench/results/engines.json`` with the
command that made it. Not a test: nothing here asserts speed. Runs from the vLLM venv
(``tools/engines/setup.sh``)::

    ~/.cache/dcr-engines/vllm-0.33.0/bin/python bench/engines.py --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "dcr-engines" /
                                             "vllm-cache"))

import numpy as np
import torch
import vllm_cpu  # the engine tier's helpers: checkpoints, vLLM models on CPU
from safetensors.torch import load_file

from dcr.apply.applier import Applier, ApplyReport, CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint, Checkpoint
from dcr.format.layout import manifest_key
from dcr.format.profile import ReceiverProfile
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.loader import VllmRuntime
from dcr.transport.store import MemoryStore

OUT = Path(__file__).resolve().parent / "results" / "engines.json"
State = dict[str, torch.Tensor]
METHODS = ("dcr", "dcr_staged", "vllm_patch", "dense")
PROFILE_RUNS = 3  # profiled applies per engine, each function's least time kept


def llama(layers: int) -> vllm_cpu.Family:
    return vllm_cpu.Family(name="llama-bench", config_cls="LlamaConfig", config={
        "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 8,
        "max_position_embeddings": 256, "tie_word_embeddings": False})


def one_ulp(state: State, rate: float, seed: int) -> State:
    """A uniform ``rate`` of elements moved by one BF16 ulp (away from zero)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        bits = t.view(torch.int16).clone()
        bits[torch.rand(t.shape, generator=gen) < rate] += 1
        out[name] = bits.view(torch.bfloat16)
    return out


def as_source(state: State) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.contiguous().view(torch.int16)
                                .numpy().view(np.uint16)) for n, t in state.items()})


def sparse_patches(old: State, new: State) -> list[Any]:
    """vLLM's sparse patches for the step: per changed tensor, the flat int32 indices
    of the elements whose bits changed and their new values."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
    )

    patches = []
    for name, t in new.items():
        flat_new, flat_old = t.reshape(-1), old[name].reshape(-1)
        changed = torch.nonzero(flat_new.view(torch.int16) != flat_old.view(torch.int16))
        idx = changed.reshape(-1).to(torch.int32)
        if idx.numel():
            patches.append(CheckpointWeightPatch(name=name, shape=tuple(t.shape),
                                                 dtype=t.dtype, values=flat_new[idx.long()],
                                                 indices=idx))
    return patches


def summary(wall: list[float], cpu: list[float], dense_bytes: int) -> dict[str, float]:
    best = min(wall)
    return {"best_s": best, "median_s": statistics.median(wall), "best_cpu_s": min(cpu),
            "dense_equivalent_gb_per_s": dense_bytes / best / 1e9}


def split(report: ApplyReport) -> dict[str, Any]:
    return {"decode_s": report.decode_s, "scatter_s": report.scatter_s,
            "loader_s": report.loader_s, "intercept_s": report.intercept_s,
            "loads": report.loads, "deferred_tensors": report.deferred,
            "records": report.records, "writes": report.writes}


def profile_top(runs: list[Callable[[], Callable[[], Any]]], top: int
                ) -> list[dict[str, Any]]:
    """cProfile's functions by their own time, over several runs of the same apply, each
    function's least time of them (cProfile reads the wall clock: on a shared machine a
    run that was preempted charges the wait to whatever function was running). Each of
    ``runs`` prepares a run (unprofiled) and returns it."""
    seen: dict[str, list[tuple[int, float, float]]] = {}
    for prepare in runs:
        fn = prepare()
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        for (path, line, func), (_, calls, tottime, cumtime, _) in stats.items():
            where = path.split("site-packages/")[-1].split("/work/main/")[-1]
            seen.setdefault(f"{where}:{line}({func})", []).append((calls, tottime, cumtime))
    rows = [{"function": name, "calls": max(c for c, _, _ in v),
             "tottime_s": round(min(t for _, t, _ in v), 5),
             "cumtime_s": round(min(c for _, _, c in v), 5)}
            for name, v in seen.items() if len(v) == len(runs)]
    return sorted(rows, key=lambda r: -r["tottime_s"])[:top]


class Bench:
    """The four models, the two engines, and what runs each method once."""

    def __init__(self, v0: Path, old: State, canonical: list[CanonicalTensor]) -> None:
        self.old = old
        self.models = {k: vllm_cpu.build_model(v0) for k in METHODS}
        for model in self.models.values():
            self.load(model, old)
        self.engines = {k: Applier(VllmRuntime(self.models[k]), defer=(k == "dcr"))
                        for k in ("dcr", "dcr_staged")}
        self.prewarm_s: dict[str, float] = {}
        profiles = []
        for k, engine in self.engines.items():
            t0 = time.perf_counter()
            with vllm_cpu.current(self.models[k]):
                profiles.append(engine.prewarm(canonical))
            self.prewarm_s[k] = time.perf_counter() - t0
        self.profile: ReceiverProfile = profiles[0]

    @staticmethod
    def load(model: torch.nn.Module, state: State) -> None:
        with vllm_cpu.current(model):
            model.load_weights(iter(state.items()))

    def run(self, method: str, payloads: list[bytes], patches: list[Any], new: State
            ) -> ApplyReport | None:
        model = self.models[method]
        with vllm_cpu.current(model):
            if method in self.engines:
                return self.engines[method].apply_payloads(payloads)
            if method == "vllm_patch":
                from vllm.model_executor.model_loader.checkpoint_weight_patch import (
                    load_checkpoint_weight_patches,
                )

                load_checkpoint_weight_patches(model, patches)
            else:
                model.load_weights(iter(new.items()))
        return None


def profiled(bench: Bench, method: str, payloads: list[bytes]
             ) -> Callable[[], Callable[[], Any]]:
    """Prepares one apply of ``method`` from v0 for the profiler: the reset is not
    profiled."""
    def prepare() -> Callable[[], Any]:
        bench.load(bench.models[method], bench.old)

        def run() -> Any:
            with vllm_cpu.current(bench.models[method]):
                return bench.engines[method].apply_payloads(payloads)

        return run

    return prepare


def run_case(bench: Bench, name: str, new: State, *, repeat: int, dense_bytes: int,
             elements: int, profile: bool) -> dict[str, Any]:
    old = bench.old
    case_id = name.replace("%", "pct")  # attempt ids allow [A-Za-z0-9._-]
    payload_sets, wire = [], 0
    encode_s, changed = [], 0
    for rep in range(repeat + (2 * PROFILE_RUNS if profile else 0)):  # ids never repeat
        store = MemoryStore()
        t0 = time.perf_counter()
        m = diff_checkpoints(as_source(old), as_source(new), store, EncodeSettings(
            target_version=1, base_version=0, profile=bench.profile, attempt=f"a-{case_id}-{rep}"))
        encode_s.append(time.perf_counter() - t0)
        payload_sets.append([store.get(e.key) for e in m.payloads])
        wire = sum(e.size for e in m.payloads) + len(store.get(manifest_key(1)))
        changed = m.stats.changed_elements
    t0 = time.perf_counter()
    patches = sparse_patches(old, new)
    patch_build_s = time.perf_counter() - t0
    wall: dict[str, list[float]] = {k: [] for k in METHODS}
    cpu: dict[str, list[float]] = {k: [] for k in METHODS}
    splits: dict[str, list[dict[str, Any]]] = {k: [] for k in bench.engines}
    for rep in range(repeat):
        for method in METHODS:
            bench.load(bench.models[method], old)
            w0, c0 = time.perf_counter(), time.thread_time()
            report = bench.run(method, payload_sets[rep], patches, new)
            wall[method].append(time.perf_counter() - w0)
            cpu[method].append(time.thread_time() - c0)
            if report is not None:
                splits[method].append(split(report))
    exact = {k: vllm_cpu.differing(bench.models[k], bench.models["dense"]) == []
             for k in METHODS if k != "dense"}
    rows = {k: summary(wall[k], cpu[k], dense_bytes) for k in METHODS}
    dense_best = rows["dense"]["best_s"]
    for k, row in rows.items():
        row["speedup_vs_dense"] = dense_best / row["best_s"]
        if k in splits:  # the split of the run with the best wall time
            row["split_of_best"] = splits[k][wall[k].index(min(wall[k]))]
        if k != "dense":
            row["bit_exact"] = exact[k]
    rows["dcr"]["wire_bytes"] = rows["dcr_staged"]["wire_bytes"] = wire
    rows["vllm_patch"]["wire_bytes"] = sum(p.indices.numel() * 4 + p.values.numel() * 2
                                           for p in patches)
    rows["vllm_patch"]["build_patches_s"] = patch_build_s
    rows["dense"]["wire_bytes"] = dense_bytes
    for row in rows.values():
        row["wire_ratio_to_dense"] = row["wire_bytes"] / dense_bytes
    out: dict[str, Any] = {
        "case": name, "changed_elements": changed, "changed_fraction": changed / elements,
        "encode_best_s": min(encode_s),
        "dcr_ns_per_changed_element": rows["dcr"]["best_s"] / changed * 1e9,
        "methods": rows,
    }
    if profile:
        spare = iter(payload_sets[repeat:])
        for method in bench.engines:
            out[f"profile_{method}_top_tottime"] = profile_top(
                [profiled(bench, method, next(spare)) for _ in range(PROFILE_RUNS)], 25)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20, help="decoder layers (20: 0.60 GB)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    ap.add_argument("--rates", default="1,3,5", help="ulp cases: percent of elements")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--profile", action="store_true", help="cProfile one dcr apply")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rates = [float(r) for r in args.rates.split(",") if r]

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        v0, v1 = vllm_cpu.make_versions(llama(args.layers), Path(tmp), steps=1, lr=args.lr)
        make_s = time.perf_counter() - t0
        old, adamw = (load_file(str(v / "model.safetensors")) for v in (v0, v1))
        dense_bytes = sum(t.numel() * t.element_size() for t in old.values())
        elements = sum(t.numel() for t in old.values())
        vllm_cpu.init_distributed(v0, world=1, rank=0, port=vllm_cpu.free_port())
        with Checkpoint(v0) as ckpt:
            canonical = [CanonicalTensor(name=i.name, dtype=i.dtype.name,
                                         shape=tuple(i.shape)) for i in ckpt]
        bench = Bench(v0, old, canonical)
        cases = [("adamw", adamw)] + [(f"ulp-{r:g}%", one_ulp(old, r / 100, seed=i))
                                      for i, r in enumerate(rates)]
        results = []
        for i, (name, new) in enumerate(cases):
            results.append(run_case(bench, name, new, repeat=args.repeat,
                                    dense_bytes=dense_bytes, elements=elements,
                                    profile=args.profile and i == 1))
            r = results[-1]
            print(f"{name:>8} {r['changed_fraction']:7.2%} " + "  ".join(
                f"{k} {m['best_s']:.3f}s ({m['dense_equivalent_gb_per_s']:.1f} GB/s)"
                for k, m in r["methods"].items()), flush=True)
        model_cls = type(bench.models["dense"]).__name__

    import vllm

    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch_threads": args.threads,
                    # other work on the machine while it ran (1-minute load averages)
                    "load_average_before_after": [load_before[0], os.getloadavg()[0]]},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "model": {"class": model_cls, "layers": args.layers, "tensors": len(old),
                  "elements": elements, "dense_bytes": dense_bytes,
                  "make_checkpoints_s": make_s},
        "adamw_lr": args.lr,
        "prewarm_s": bench.prewarm_s,
        "classes": sorted(set(bench.profile.tensors.values())),
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
