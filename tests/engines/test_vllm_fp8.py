"""An FP8 receiver: vLLM's online FP8 quantization of a BF16 checkpoint.

With ``ModelConfig(quantization="fp8")`` vLLM 0.33 quantizes inside ``load_weights``:
its layerwise loader collects a layer's BF16 weights and, once the layer is complete,
runs ``process_weights_after_loading``, which calls ``ops.scaled_fp8_quant``, a CUDA
kernel of ``vllm._C``, which neither wheel has for the CPU, so on CPU the load itself fails
(the first test pins where, so the day vLLM gains the op the GPU test below can run
here). The refit itself needs a GPU: it runs in a rank process on CUDA.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM does not import in this interpreter: the engine "
                    "tier runs with `make test-engines` (tools/engines/setup.sh)")

import torch
import vllm_cpu
from ranks import Ranks

from dcr.checkpoint import Checkpoint
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.transport.store import MemoryStore


@pytest.mark.usefixtures("tp1")
def test_online_fp8_needs_a_cuda_kernel_that_the_cpu_build_lacks(
        versions: Callable[[str], list[Path]]) -> None:
    model = vllm_cpu.build_model(versions("llama")[0], quantization="fp8")
    # The CUDA wheel has no such op (AttributeError); the CPU build registers it without
    # a CPU kernel (RuntimeError: it takes no arguments).
    with pytest.raises((AttributeError, RuntimeError), match="static_scaled_fp8_quant"):
        vllm_cpu.load_dense(model, versions("llama")[0])


@pytest.fixture
def gpu_rank(versions: Callable[[str], list[Path]], checkpoint_root: Path,
             tmp_path: Path) -> Iterator[tuple[Ranks, Path]]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: vLLM's online FP8 quantizes inside load_weights "
                    "with _C.static_scaled_fp8_quant, which only the CUDA build has")
    staging = tmp_path / "staging"
    staging.mkdir()
    group = Ranks(1, versions("qwen2-moe")[0], tmp_path, device="cuda", env={
        "DCR_STAGING_DIR": str(staging), "DCR_CHECKPOINT_ROOT": str(checkpoint_root),
        "VLLM_CACHE_ROOT": os.environ["VLLM_CACHE_ROOT"]})
    yield group, staging
    group.close()


@pytest.mark.gpu
def test_fp8_receiver_refit_matches_a_dense_load(
        gpu_rank: tuple[Ranks, Path], versions: Callable[[str], list[Path]]) -> None:
    ranks, staging = gpu_rank
    dirs = versions("llama")
    for target in ("applied", "dense"):
        ranks.call("build", target, {"model": str(dirs[0]), "quantization": "fp8"})
    ranks.call("dcr_load_dense", "applied", json.dumps({"checkpoint": "llama/v0",
                                                        "expect": None}))
    answers = ranks.call("dcr_prewarm", "applied", vllm_cpu.canonical_request(dirs[0]))
    profile = merge(ReceiverProfile(tensors=a["profile"]) for a in answers)
    for v in range(1, len(dirs)):
        store = MemoryStore()
        m = diff_checkpoints(Checkpoint(dirs[v - 1]), Checkpoint(dirs[v]), store,
                             EncodeSettings(target_version=v, base_version=v - 1, profile=profile))
        names = [f"fp8-v{v}-{i}.dcrp" for i in range(len(m.payloads))]
        for name, e in zip(names, m.payloads, strict=True):
            (staging / name).write_bytes(store.get(e.key))
        ranks.call("dcr_apply", "applied", json.dumps({"payloads": names}))
        ranks.call("dcr_load_dense", "dense", json.dumps({"checkpoint": f"llama/v{v}",
                                                          "expect": None}))
        assert ranks.call("compare", arg=["applied", "dense"]) == [[]], f"after v{v}"
