"""DCR's in-place apply through vLLM's real model classes, bit-exact against dense loads.

Each model family is built by vLLM itself (``get_model_architecture``: the class a
vLLM worker builds) on CPU at TP 1. The receiver holds v0, prewarms through the model's
own ``load_weights`` (its profile goes to the sender), and takes versions v1..v3, each
the diff of two real AdamW steps apart, in mixed or overwrite mode. After every step
every parameter and buffer must equal, bit for bit (integer views), a second model of
the same class loaded densely with that version through the same ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM does not import in this interpreter: the engine "
                    "tier runs with `make test-engines` (tools/engines/setup.sh)")

import torch
import vllm_cpu

from dcr.apply.applier import Applier
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.format.payload import Mode
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.loader import VllmRuntime
from dcr.transport.store import MemoryStore

pytestmark = pytest.mark.usefixtures("tp1")

FAMILIES = ["llama-tied", "llama", "qwen2-moe", "qwen2-moe-fused", "mixtral"]


def canonical(model_dir: Path) -> list[CanonicalTensor]:
    with Checkpoint(model_dir) as ckpt:
        return [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=tuple(i.shape))
                for i in ckpt]


@pytest.mark.parametrize("path", ["deferred", "staged"])
@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
@pytest.mark.parametrize("family", FAMILIES)
def test_refit_through_vllm_model_classes_matches_a_dense_load_bit_for_bit(
        family: str, mode: Mode, path: str, versions: Callable[[str], list[Path]]) -> None:
    """``deferred``: the engine as receivers run it (one loader call for the set, writes
    after it is checked); ``staged``: one call per tensor, every write read back."""
    dirs = versions(family)
    receiver, dense = vllm_cpu.build_model(dirs[0]), vllm_cpu.build_model(dirs[0])
    vllm_cpu.load_dense(receiver, dirs[0])
    engine = (Applier(VllmRuntime(receiver)) if path == "deferred" else
              Applier(VllmRuntime(receiver), defer=False, verify=True))
    with vllm_cpu.current(receiver):
        profile = engine.prewarm(canonical(dirs[0]))
    # Every BF16 tensor reaches storage through same-dtype copies of scratch views.
    assert set(profile.tensors.values()) == {"xor"}
    store = MemoryStore()
    for v in range(1, len(dirs)):
        m = diff_checkpoints(Checkpoint(dirs[v - 1]), Checkpoint(dirs[v]), store, EncodeSettings(
            target_version=v, base_version=v - 1, mode=mode, profile=profile))
        assert m.stats.changed_elements > 0
        with vllm_cpu.current(receiver):
            report = engine.apply_payloads([store.get(e.key) for e in m.payloads])
        assert report.records == m.stats.changed_elements
        assert report.loads == (1 if path == "deferred" else report.tensors)
        assert report.deferred == (report.tensors if path == "deferred" else 0)
        vllm_cpu.load_dense(dense, dirs[v])
        assert vllm_cpu.differing(receiver, dense) == [], f"after v{v}"


def test_the_layouts_under_test_are_vllms_fused_padded_and_stacked_ones(
        versions: Callable[[str], list[Path]]) -> None:
    """What the refit tests cover, checked on the models vLLM built."""
    llama = vllm_cpu.build_model(versions("llama-tied")[0])
    params = dict(llama.named_parameters())
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (64 + 2 * 32, 64)  # q, k, v fused; 2 KV heads of 16
    assert params["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 128, 64)
    embed = params["model.embed_tokens.weight"]
    assert embed.shape == (1024, 64)  # vocabulary 1000 padded to a multiple of 64
    assert "lm_head.weight" not in params  # tied: the head is the embedding
    assert llama.lm_head.weight.untyped_storage().data_ptr() == embed.untyped_storage(
        ).data_ptr()

    moe = dict(vllm_cpu.build_model(versions("qwen2-moe")[0]).named_parameters())
    assert moe["model.layers.0.self_attn.qkv_proj.bias"].shape == (128,)
    assert moe["model.layers.0.mlp.experts.routed_experts.w13_weight"].shape == (4, 64, 64)
    assert moe["model.layers.0.mlp.experts.routed_experts.w2_weight"].shape == (4, 64, 32)
    assert moe["model.layers.0.mlp.shared_expert.gate_up_proj.weight"].shape == (128, 64)
    with Checkpoint(versions("qwen2-moe")[0]) as ckpt:  # stored one tensor per expert
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in ckpt.tensors

    mixtral = dict(vllm_cpu.build_model(versions("mixtral")[0]).named_parameters())
    assert mixtral["model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"
                   ].shape == (4, 64, 64)


def test_padding_rows_stay_zero_after_a_refit(versions: Callable[[str], list[Path]]
                                              ) -> None:
    dirs = versions("llama-tied")
    receiver = vllm_cpu.build_model(dirs[0])
    vllm_cpu.load_dense(receiver, dirs[0])
    engine = Applier(VllmRuntime(receiver))
    with vllm_cpu.current(receiver):
        profile = engine.prewarm(canonical(dirs[0]))
    store = MemoryStore()
    m = diff_checkpoints(Checkpoint(dirs[0]), Checkpoint(dirs[1]), store,
                         EncodeSettings(target_version=1, base_version=0, profile=profile))
    with vllm_cpu.current(receiver):
        engine.apply_payloads([store.get(e.key) for e in m.payloads])
    padding = receiver.model.embed_tokens.weight[1000:]
    assert torch.equal(padding.view(torch.int16), torch.zeros_like(padding, dtype=torch.int16))
