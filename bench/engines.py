"""Engine benchmark: a refit through vLLM's real Llama on CPU, three ways, side by side.

One vLLM ``LlamaForCausalLM`` (vLLM 0.33's own class, built on CPU in BF16 as the
engine tier builds it) takes one real AdamW step of its transformers twin (lr 1e-6 on
random tokens: about 1% of the BF16 elements change). The same step is applied:

* by DCR: payloads from ``diff_checkpoints`` with the receiver's profile, applied in
  place by ``ApplyEngine`` through the model's ``load_weights``; wire bytes are the
  payloads plus the manifest;
* by vLLM's own sparse path: ``load_checkpoint_weight_patches`` with one
  ``CheckpointWeightPatch`` (flat int32 indices, BF16 values) per changed tensor, NaN-
  masked through the same ``load_weights``; wire bytes are 4 + 2 per changed element,
  what its ``sparse_nccl`` backend broadcasts;
* densely: ``load_weights`` of the whole new checkpoint, already in memory; wire bytes
  are the checkpoint's tensors.

Every method starts from v0 on its own model and must end bit-identical (integer views
of every parameter and buffer) to the dense load. Apply times exclude building
payloads or patches (the sender's work) and reading files; each is the best and the
median of ``--repeat`` runs on ``--threads`` torch threads. Writes
``bench/results/engines.json`` with the command that made it. Not a test: nothing here
asserts speed. Runs from the vLLM venv (``tools/engines/setup.sh``)::

    ~/.cache/dcr-engines/vllm-0.33.0/bin/python bench/engines.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engines"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "dcr-engines" /
                                             "vllm-cache"))

import torch
import vllm_cpu  # the engine tier's helpers: checkpoints, vLLM models on CPU
from safetensors.torch import load_file

from dcr.apply.engine import ApplyEngine, CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.format.layout import manifest_key
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.vllm import VllmRuntime
from dcr.transport.store import MemoryStore

OUT = Path(__file__).resolve().parent / "results" / "engines.json"


def llama(layers: int) -> vllm_cpu.Family:
    return vllm_cpu.Family(name="llama-bench", config_cls="LlamaConfig", config={
        "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 8,
        "max_position_embeddings": 256, "tie_word_embeddings": False})


def timed(fn: Callable[[], Any], reset: Callable[[], None], repeat: int) -> dict[str, float]:
    """Best and median seconds of ``fn`` over ``repeat`` runs, ``reset`` before each."""
    times = []
    for _ in range(repeat):
        reset()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"best_s": min(times), "median_s": statistics.median(times)}


def sparse_patches(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[Any]:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20, help="decoder layers (20: 0.62 GB)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        load_checkpoint_weight_patches,
    )

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        v0, v1 = vllm_cpu.make_versions(llama(args.layers), Path(tmp), steps=1, lr=args.lr)
        make_s = time.perf_counter() - t0
        old, new = load_file(str(v0 / "model.safetensors")), load_file(
            str(v1 / "model.safetensors"))
        dense_bytes = sum(t.numel() * t.element_size() for t in new.values())
        vllm_cpu.init_distributed(v0, world=1, rank=0, port=vllm_cpu.free_port())
        models = {k: vllm_cpu.build_model(v0) for k in ("dcr", "vllm_patch", "dense")}

        def load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
            with vllm_cpu.current(model):
                model.load_weights(iter(state.items()))

        # DCR: prewarm once (a receiver does it at start), then diff and apply.
        dcr_model = models["dcr"]
        load(dcr_model, old)
        engine = ApplyEngine(VllmRuntime(dcr_model))
        with Checkpoint(v0) as ckpt:
            canonical = [CanonicalTensor(name=i.name, dtype=i.dtype.name,
                                         shape=tuple(i.shape)) for i in ckpt]
        t0 = time.perf_counter()
        with vllm_cpu.current(dcr_model):
            profile = engine.prewarm(canonical)
        prewarm_s = time.perf_counter() - t0
        payload_sets: list[list[bytes]] = []
        wire: dict[str, int] = {}
        changed = 0

        def encode() -> None:
            nonlocal changed
            store = MemoryStore()
            m = diff_checkpoints(Checkpoint(v0), Checkpoint(v1), store, EncodeSettings(
                version=1, base_version=0, profile=profile))
            payload_sets.append([store.get(e.key) for e in m.payloads])
            wire["payloads"] = sum(e.size for e in m.payloads)
            wire["manifest"] = len(store.get(manifest_key(1)))
            changed = m.stats.changed_elements

        encode_t = timed(encode, lambda: None, args.repeat)

        split: dict[str, float] = {}

        def dcr_apply() -> None:
            with vllm_cpu.current(dcr_model):
                report = engine.apply_payloads(payload_sets.pop())
            split.update(scatter_s=report.scatter_s, loader_s=report.loader_s,
                         intercept_s=report.intercept_s)

        dcr_t = timed(dcr_apply, lambda: load(dcr_model, old), args.repeat)

        # vLLM's own sparse path.
        t0 = time.perf_counter()
        patches = sparse_patches(old, new)
        patch_build_s = time.perf_counter() - t0
        patch_model = models["vllm_patch"]

        def vllm_patch() -> None:
            with vllm_cpu.current(patch_model):
                load_checkpoint_weight_patches(patch_model, patches)

        patch_t = timed(vllm_patch, lambda: load(patch_model, old), args.repeat)
        patch_bytes = sum(p.indices.numel() * 4 + p.values.numel() * 2 for p in patches)

        # Dense, from memory.
        dense_model = models["dense"]
        dense_t = timed(lambda: load(dense_model, new), lambda: load(dense_model, old),
                        args.repeat)

        exact = {k: vllm_cpu.differing(models[k], dense_model) == []
                 for k in ("dcr", "vllm_patch")}
        total = sum(t.numel() for t in new.values())

    def row(t: dict[str, float], bytes_: int, **extra: Any) -> dict[str, Any]:
        return {**t, "wire_bytes": bytes_, "wire_ratio_to_dense": bytes_ / dense_bytes,
                "dense_equivalent_gb_per_s": dense_bytes / t["best_s"] / 1e9, **extra}

    import vllm

    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch_threads": args.threads,
                    # other work on the machine while it ran (1-minute load averages)
                    "load_average_before_after": [load_before[0], os.getloadavg()[0]]},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "model": {"class": type(dense_model).__name__, "layers": args.layers,
                  "tensors": len(new), "elements": total, "dense_bytes": dense_bytes},
        "step": {"optimizer": "AdamW", "lr": args.lr, "changed_elements": changed,
                 "changed_fraction": changed / total, "make_checkpoints_s": make_s},
        "dcr": row(dcr_t, wire["payloads"] + wire["manifest"], payload_bytes=wire["payloads"],
                   manifest_bytes=wire["manifest"], prewarm_s=prewarm_s,
                   encode_best_s=encode_t["best_s"], bit_exact=exact["dcr"],
                   last_run_split=split,
                   classes=sorted(set(profile.tensors.values()))),
        "vllm_checkpoint_weight_patches": row(
            patch_t, patch_bytes, patches=len(patches), build_patches_s=patch_build_s,
            bit_exact=exact["vllm_patch"], wire="int32 indices + BF16 values (sparse_nccl)"),
        "dense_load_weights": row(dense_t, dense_bytes),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
