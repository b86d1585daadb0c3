"""The applier alone, both ways side by side: records expanded on the host or on the device.

A phase of ``gpu_check.py`` (``--engine reference``), in its own process's memory: two
copies of the checkpoint's transformers Llama on the device (``HFRuntime``), one applied
through ``Applier(expand="host")`` (positions built by the codec's C kernel, moved to the
device, scattered with torch), the other through ``Applier(expand="device")`` (compact
records copied from pinned memory on a stream of their own, expanded and scattered on the
device, one synchronization per set). Each gets the same payload sets in alternating
order: the real AdamW steps of the checkpoints, then uniform 1%, 3% and 5% one-ulp changes
on top. Per set and path: the apply's wall time and dense-equivalent GB/s, the applier's
split (decode, upload, expand, scatter, loader), and the check of every target
fingerprint after it (on the device path hashed where the weights live, ``xxh3.py``; on the
host path copied to the host first). After every set both copies must hold the same bits
and the manifest's target fingerprints; the result says so per set.

The same code runs on the CPU for the dry run (``MODEL_SIZE=tiny``): no numbers from it
stand for a GPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

PATHS = ("host", "device")


def _one_ulp(bits: Any, rate: float, seed: int) -> Any:
    """A uniform ``rate`` of a BF16 tensor's elements moved by one ulp (on the host)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = bits.copy()
    out[rng.random(bits.shape) < rate] += 1
    return out


def compare_paths(ckpts: Path, steps: int, device: str,
                  rates: tuple[float, ...] = (0.01, 0.03, 0.05)) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    from dcr.apply.applier import Applier, CanonicalTensor
    from dcr.checkpoint import ArrayCheckpoint, Checkpoint
    from dcr.format.profile import merge
    from dcr.owner.diff import diff_checkpoints
    from dcr.owner.settings import EncodeSettings
    from dcr.runtimes.hf import HFRuntime
    from dcr.transport.store import MemoryStore

    models = {p: LlamaForCausalLM.from_pretrained(ckpts / "v0", torch_dtype=torch.bfloat16)
              .to(device).eval() for p in PATHS}
    engines = {p: Applier(HFRuntime(m), device=device, expand=p)  # type: ignore[arg-type]
               for p, m in models.items()}
    with Checkpoint(ckpts / "v0") as c:
        canonical = [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=tuple(i.shape))
                     for i in c]
        dense_bytes = sum(i.nbytes for i in c)
    profile = merge(e.prewarm(canonical) for e in engines.values())

    def state_bits() -> dict[str, tuple[str, tuple[int, ...], Any]]:
        sd = models["host"].state_dict()
        return {t.name: ("BF16", t.shape, sd[t.name].detach().view(torch.int16).cpu().numpy()
                         .view(np.uint16).reshape(-1)) for t in canonical}

    def same_bits() -> bool:
        a, b = models["host"].state_dict(), models["device"].state_dict()
        return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)

    rows: list[dict[str, Any]] = []

    def apply_set(label: str, base: Any, target: Any, version: int) -> None:
        store = MemoryStore()
        m = diff_checkpoints(base, target, store, EncodeSettings(
            target_version=version, base_version=version - 1, mode="mixed", profile=profile,
            attempt=f"a-paths{version:04d}"))
        payloads = [store.get(e.key) for e in m.payloads]
        expect = {t.name: t.target for t in m.tensors}
        row: dict[str, Any] = {
            "set": label, "changed_pct": round(100 * m.stats.changed_elements
                                               / m.stats.total_elements, 3),
            "payload_bytes": m.stats.payload_bytes, "payloads": len(payloads)}
        for p in (PATHS if version % 2 else PATHS[::-1]):
            t0 = time.perf_counter()
            r = engines[p].apply_payloads(payloads)
            apply_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            differ = engines[p].check_targets(expect)
            check_s = time.perf_counter() - t0
            row[p] = {"apply_s": round(apply_s, 4),
                      "dense_equivalent_GBps": round(dense_bytes / apply_s / 1e9, 2),
                      "split_s": {k: round(getattr(r, k), 4) for k in (
                          "decode_s", "upload_s", "expand_s", "scatter_s", "loader_s",
                          "intercept_s")},
                      "upload_bytes": r.upload_bytes, "records": r.records,
                      "check_s": round(check_s, 4), "targets_differ": len(differ)}
        row["device_over_host"] = round(row["device"]["apply_s"] / row["host"]["apply_s"], 3)
        row["bit_exact"] = same_bits() and not any(row[p]["targets_differ"] for p in PATHS)
        rows.append(row)

    version = 0
    for v in range(1, steps + 1):
        version += 1
        with Checkpoint(ckpts / f"v{v - 1}") as b, Checkpoint(ckpts / f"v{v}") as t:
            apply_set(f"adamw v{v - 1}->v{v}", b, t, version)
    for k, rate in enumerate(rates):
        version += 1
        now = state_bits()
        moved = {n: (d, s, _one_ulp(bits, rate, seed=k)) for n, (d, s, bits) in now.items()}
        apply_set(f"uniform {100 * rate:g}%", ArrayCheckpoint(now), ArrayCheckpoint(moved),
                  version)
    models.clear()  # the two copies leave the device before the engine starts
    engines.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    best = {p: max(r[p]["dense_equivalent_GBps"] for r in rows) for p in PATHS}
    return {"dense_bytes": dense_bytes, "sets": rows, "best_dense_equivalent_GBps": best,
            "bit_exact": all(r["bit_exact"] for r in rows)}
