"""The vLLM-layout reference runtime shards, fuses, skips and converts like vLLM's loaders.

Expected shards are computed here independently (``torch.chunk``, ``np.array_split``), and
the union over ranks is rebuilt without any layout knowledge: a float32 twin of each model
is loaded with tensors whose values are their own global element ids, so every stored
element says which canonical element it came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr.errors import ConfigError
from dcr.runtimes.vllm_reference import (
    ReferenceConfig,
    ReferenceModel,
    dense_state,
    hf_checkpoint_shapes,
    random_checkpoint,
)

FP8 = torch.float8_e4m3fn
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

DENSE = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
# 65 tokens pad to 128: at tp=4 rank 2 holds one real row and rank 3 none.
DENSE_TIED = dataclasses.replace(DENSE, vocab_size=65, tie_word_embeddings=True)
MOE = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=True, num_experts=6,
                      moe_intermediate_size=16)
MOE_UNTIED = dataclasses.replace(MOE, tie_word_embeddings=False)
FP8_DENSE = dataclasses.replace(
    DENSE, fp8_modules=("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj"))
FP8_MOE = dataclasses.replace(MOE, fp8_modules=("self_attn.o_proj",))

CONFIGS = {"dense": DENSE, "dense_tied": DENSE_TIED, "moe": MOE, "moe_untied": MOE_UNTIED,
           "fp8_dense": FP8_DENSE, "fp8_moe": FP8_MOE}
LAYOUTS = [
    pytest.param(cfg, tp, ep, id=f"{key}-tp{tp}{'-ep' if ep else ''}")
    for key, cfg in CONFIGS.items()
    for tp in (1, 2, 4)
    for ep in ((False, True) if cfg.num_experts else (False,))
]
NON_FP8_LAYOUTS = [p for p in LAYOUTS if not p.values[0].fp8_modules]  # type: ignore[union-attr]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_INT_VIEW[t.element_size()])


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{what}: bits differ"


def _loaded(cfg: ReferenceConfig, tp: int, rank: int, ep: bool,
            ckpt: dict[str, torch.Tensor]) -> ReferenceModel:
    model = ReferenceModel(cfg, tp_size=tp, tp_rank=rank, ep=ep)
    model.load_weights(ckpt.items())
    return model


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().max() / 448.0
    return (w.float() / scale).clamp(-448.0, 448.0).to(FP8), scale.reshape(1)


def _expected_rank(cfg: ReferenceConfig, ck: dict[str, torch.Tensor], tp: int, r: int,
                   ep: bool) -> dict[str, torch.Tensor]:
    """This rank's runtime parameters, derived from the checkpoint without the module."""
    fp8 = set(cfg.fp8_modules)

    def rows(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
        return t.chunk(n, dim=0)[i]

    def cols(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
        return t.chunk(n, dim=1)[i]

    def vocab(t: torch.Tensor) -> torch.Tensor:
        padded = -(-cfg.vocab_size // cfg.vocab_pad_to) * cfg.vocab_pad_to
        full = torch.zeros(padded, cfg.hidden_size, dtype=t.dtype)
        full[: cfg.vocab_size] = t
        return rows(full, tp, r)

    def put(module: str, parts: list[tuple[torch.Tensor, Callable[[torch.Tensor], Any]]]) -> None:
        """Store ``cat(shard(t) for t, shard in parts)``, quantized per part for FP8."""
        suffix = module.split(".", 3)[-1]
        if suffix in fp8:
            quant = [(*_quantized(t), shard) for t, shard in parts]
            out[module + ".weight"] = torch.cat([shard(q) for q, _, shard in quant])
            out[module + ".weight_scale"] = torch.cat([scale for _, scale, _ in quant])
        else:
            out[module + ".weight"] = torch.cat([s(t) for t, s in parts])

    embed = ck["model.embed_tokens.weight"]
    out = {"model.embed_tokens.weight": vocab(embed), "model.norm.weight": ck["model.norm.weight"],
           "lm_head.weight": vocab(embed if cfg.tie_word_embeddings else ck["lm_head.weight"])}
    kv_shards = min(tp, cfg.num_kv_heads)
    kv_index = r * kv_shards // tp  # consecutive ranks share a replicated KV head
    experts = np.array_split(np.arange(cfg.num_experts), tp)[r] if ep else range(cfg.num_experts)
    etp, er = (1, 0) if ep else (tp, r)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = ck[p + norm]
        put(p + "self_attn.qkv_proj", [
            (ck[p + "self_attn.q_proj.weight"], lambda t: rows(t, tp, r)),
            (ck[p + "self_attn.k_proj.weight"], lambda t: rows(t, kv_shards, kv_index)),
            (ck[p + "self_attn.v_proj.weight"], lambda t: rows(t, kv_shards, kv_index))])
        put(p + "self_attn.o_proj", [(ck[p + "self_attn.o_proj.weight"], lambda t: cols(t, tp, r))])
        if not cfg.num_experts:
            put(p + "mlp.gate_up_proj", [(ck[p + "mlp.gate_proj.weight"], lambda t: rows(t, tp, r)),
                                         (ck[p + "mlp.up_proj.weight"], lambda t: rows(t, tp, r))])
            put(p + "mlp.down_proj", [(ck[p + "mlp.down_proj.weight"], lambda t: cols(t, tp, r))])
            continue
        out[p + "mlp.gate.weight"] = ck[p + "mlp.gate.weight"]
        e = p + "mlp.experts."
        out[e + "w13_weight"] = torch.stack([
            torch.cat([rows(ck[f"{e}{x}.gate_proj.weight"], etp, er),
                       rows(ck[f"{e}{x}.up_proj.weight"], etp, er)]) for x in experts])
        out[e + "w2_weight"] = torch.stack(
            [cols(ck[f"{e}{x}.down_proj.weight"], etp, er) for x in experts])
    return out


@pytest.mark.parametrize(("cfg", "tp", "ep"), LAYOUTS)
def test_each_rank_holds_exactly_its_vllm_shards(cfg: ReferenceConfig, tp: int, ep: bool) -> None:
    ckpt = random_checkpoint(cfg, seed=1)
    for rank in range(tp):
        state = dense_state(_loaded(cfg, tp, rank, ep, ckpt))
        want = _expected_rank(cfg, ckpt, tp, rank, ep)
        assert sorted(state) == sorted(want)
        for name, tensor in want.items():
            _assert_bits_equal(state[name], tensor, f"rank {rank}/{tp} {name}")


def _id_checkpoint(cfg: ReferenceConfig) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every canonical element valued by its 1-based global id (exact in float32)."""
    ids: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}
    offset = 0
    for name, shape in hf_checkpoint_shapes(cfg).items():
        n = int(np.prod(shape))
        offsets[name] = offset
        ids[name] = torch.arange(offset + 1, offset + n + 1, dtype=torch.float32).reshape(shape)
        offset += n
    assert offset < 2**24
    return ids, offsets


@pytest.mark.parametrize(("cfg", "tp", "ep"), NON_FP8_LAYOUTS)
def test_union_over_ranks_rebuilds_every_canonical_tensor_bit_for_bit(
        cfg: ReferenceConfig, tp: int, ep: bool) -> None:
    ckpt = random_checkpoint(cfg, seed=2)
    id_ckpt, offsets = _id_checkpoint(cfg)
    total = sum(t.numel() for t in id_ckpt.values())
    flat = torch.zeros(total, dtype=torch.int16)
    covered = torch.zeros(total, dtype=torch.bool)
    for rank in range(tp):
        twin = _loaded(dataclasses.replace(cfg, dtype=torch.float32), tp, rank, ep, id_ckpt)
        real = dense_state(_loaded(cfg, tp, rank, ep, ckpt))
        for name, id_param in dense_state(twin).items():
            where = id_param.reshape(-1).long()
            bits = _bits(real[name]).reshape(-1)
            held = where > 0
            assert not bits[~held].any(), f"rank {rank} {name}: a padding element is not zero"
            pos = where[held] - 1
            again = covered[pos]  # replicated copies must agree bit for bit
            assert torch.equal(flat[pos][again], bits[held][again]), f"{name}: replicas differ"
            flat[pos] = bits[held]
            covered[pos] = True
    assert bool(covered.all()), f"{int((~covered).sum())} canonical elements held by no rank"
    for name, tensor in ckpt.items():
        got = flat[offsets[name]: offsets[name] + tensor.numel()].view(tensor.shape)
        assert torch.equal(got, _bits(tensor)), f"{name}: union of ranks differs"


@pytest.mark.parametrize("tp", [2, 4])
def test_ep_rank_skips_experts_held_by_other_ranks(tp: int) -> None:
    ckpt = random_checkpoint(MOE, seed=3)
    owners = np.array_split(np.arange(MOE.num_experts), tp)
    for rank in range(tp):
        model = ReferenceModel(MOE, tp_size=tp, tp_rank=rank, ep=True)
        before = dense_state(model)
        for e in range(MOE.num_experts):
            for proj, param in (("gate_proj", "w13_weight"), ("up_proj", "w13_weight"),
                                ("down_proj", "w2_weight")):
                name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
                with _WriteRecorder() as rec:
                    got = model.load_weights([(name, ckpt[name])])
                mine = e in owners[rank]
                assert got == ({f"model.layers.1.mlp.experts.{param}"} if mine else set())
                assert bool(rec.writes) == mine
        after = dense_state(model)
        assert torch.equal(_bits(after["model.layers.0.mlp.experts.w13_weight"]),
                           _bits(before["model.layers.0.mlp.experts.w13_weight"]))


def test_without_ep_every_rank_loads_every_expert() -> None:
    ckpt = random_checkpoint(MOE, seed=4)
    name = f"model.layers.0.mlp.experts.{MOE.num_experts - 1}.down_proj.weight"
    for rank in range(4):
        model = ReferenceModel(MOE, tp_size=4, tp_rank=rank)
        assert model.load_weights([(name, ckpt[name])]) == {"model.layers.0.mlp.experts.w2_weight"}


def test_tied_lm_head_is_the_embedding_parameter_and_is_skipped() -> None:
    assert "lm_head.weight" not in hf_checkpoint_shapes(DENSE_TIED)
    model = ReferenceModel(DENSE_TIED, tp_size=2, tp_rank=0)
    head, embed = model.get_parameter("lm_head.weight"), model.get_parameter(
        "model.embed_tokens.weight")
    assert head is embed
    assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    stray = torch.ones(DENSE_TIED.vocab_size, DENSE_TIED.hidden_size, dtype=DENSE_TIED.dtype)
    assert model.load_weights([("lm_head.weight", stray)]) == set()
    assert not head.any()
    ckpt = random_checkpoint(DENSE_TIED, seed=5)
    got = model.load_weights([("model.embed_tokens.weight", ckpt["model.embed_tokens.weight"])])
    assert got == {"model.embed_tokens.weight"}
    assert torch.equal(_bits(head), _bits(ckpt["model.embed_tokens.weight"][:64]))


@pytest.mark.parametrize(("tp", "rank", "real_rows"), [(1, 0, 65), (4, 2, 1), (4, 3, 0)])
def test_vocab_padding_rows_are_zero_after_every_load(tp: int, rank: int, real_rows: int) -> None:
    ckpt = random_checkpoint(DENSE_TIED, seed=6)
    model = ReferenceModel(DENSE_TIED, tp_size=tp, tp_rank=rank)
    embed = model.get_parameter("model.embed_tokens.weight")
    model.load_weights(ckpt.items())
    assert not embed[real_rows:].any()
    embed.data[real_rows:] = 1.0  # dirty the padding: vLLM's loader zero-fills it again
    model.load_weights(ckpt.items())
    assert not embed[real_rows:].any()
    if real_rows:
        assert embed[:real_rows].any()


def test_padding_is_left_untouched_when_zero_fill_is_off() -> None:
    cfg = dataclasses.replace(DENSE, zero_vocab_padding=False)
    model = ReferenceModel(cfg, tp_size=2, tp_rank=1)
    embed = model.get_parameter("model.embed_tokens.weight")
    embed.data[100 - 64:] = 1.0
    with _WriteRecorder() as rec:
        model.load_weights(random_checkpoint(cfg, seed=7).items())
    assert {op for op, *_ in rec.writes} == {"copy_"}
    assert bool((embed[100 - 64:] == 1.0).all())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fp8_weights_dequantize_close_to_the_canonical_tensor(tp: int) -> None:
    ckpt = random_checkpoint(FP8_DENSE, seed=8)
    p = "model.layers.1."
    for rank in range(tp):
        model = _loaded(FP8_DENSE, tp, rank, False, ckpt)
        weight = model.get_parameter(p + "self_attn.o_proj.weight")
        scale = model.get_parameter(p + "self_attn.o_proj.weight_scale")
        assert weight.dtype == FP8
        assert scale.dtype == torch.float32
        assert scale.shape == (1,)
        want = ckpt[p + "self_attn.o_proj.weight"].float().chunk(tp, dim=1)[rank]
        got = weight.float() * scale
        torch.testing.assert_close(got, want, rtol=2**-4, atol=float(scale) * 2**-9)
        qkv_scale = model.get_parameter(p + "self_attn.qkv_proj.weight_scale")
        for i, proj in enumerate("qkv"):
            amax = ckpt[f"{p}self_attn.{proj}_proj.weight"].float().abs().max()
            assert float(qkv_scale[i]) == pytest.approx(float(amax) / 448.0, rel=1e-6)


def test_changing_one_fp8_element_changes_the_scale_and_most_stored_bytes() -> None:
    ckpt = random_checkpoint(FP8_DENSE, seed=9)
    name = "model.layers.0.mlp.down_proj.weight"
    model = _loaded(FP8_DENSE, 2, 1, False, ckpt)
    before = dense_state(model)
    changed = ckpt[name].clone()
    changed[0, 0] = changed.abs().max() * 4  # in rank 0's columns, not this rank's
    assert model.load_weights([(name, changed)]) == {name, name + "_scale"}
    after = dense_state(model)
    assert not torch.equal(after[name + "_scale"], before[name + "_scale"])
    flipped = (_bits(after[name]) != _bits(before[name])).float().mean()
    assert float(flipped) > 0.5


class _WriteRecorder(TorchDispatchMode):
    """Records every mutating aten op: (name, destination storage, source storage, dtypes)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, int, int | None, torch.dtype, torch.dtype | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func._schema.is_mutable:
            dst = args[0]
            src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
            self.writes.append((func.overloadpacket.__name__, dst.untyped_storage().data_ptr(),
                                None if src is None else src.untyped_storage().data_ptr(),
                                dst.dtype, None if src is None else src.dtype))
        return func(*args, **(kwargs or {}))


def _storages(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, int]]:
    for name, param in model.named_parameters(remove_duplicate=False):
        yield name, param, param.untyped_storage().data_ptr()


@pytest.mark.parametrize(("cfg", "tp", "ep"), LAYOUTS)
def test_every_write_is_an_in_place_copy_into_parameter_storage(
        cfg: ReferenceConfig, tp: int, ep: bool) -> None:
    ckpt = random_checkpoint(cfg, seed=10)
    scratch = {t.untyped_storage().data_ptr() for t in ckpt.values()}
    for rank in range(tp):
        model = ReferenceModel(cfg, tp_size=tp, tp_rank=rank, ep=ep)
        ptrs = {name: ptr for name, _, ptr in _storages(model)}
        converted = {ptr for _, p, ptr in _storages(model) if p.dtype != cfg.dtype}
        vocab = {ptrs["model.embed_tokens.weight"], ptrs["lm_head.weight"]}
        with _WriteRecorder() as rec:
            loaded = model.load_weights(ckpt.items())
        assert loaded == set(ptrs) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
        assert {name: ptr for name, _, ptr in _storages(model)} == ptrs
        assert rec.writes
        for op, dst, src, dst_dtype, src_dtype in rec.writes:
            assert dst in ptrs.values(), f"{op} wrote outside parameter storage"
            assert op in ("copy_", "fill_"), op
            if op == "fill_":
                assert dst in vocab  # vLLM zero-fills vocab padding rows
            elif dst not in converted:  # the dtype-preserving path reads the loaded tensor itself
                assert src in scratch
                assert src_dtype == dst_dtype


def test_unknown_checkpoint_names_raise_key_error_naming_them() -> None:
    model = ReferenceModel(MOE, tp_size=2, tp_rank=0, ep=True)
    t = torch.zeros(32, 32, dtype=MOE.dtype)
    for name in ("model.layers.0.self_attn.qkv_proj.weight",  # a runtime name, not canonical
                 "model.layers.0.mlp.gate_proj.weight",  # dense name in an MoE model
                 "model.layers.7.self_attn.o_proj.weight",
                 "model.layers.0.mlp.experts.6.down_proj.weight",
                 "xmodel.layers.0.self_attn.q_proj.weight"):
        with pytest.raises(KeyError, match=name.replace(".", r"\.")):
            model.load_weights([(name, t)])


def test_a_tensor_of_the_wrong_shape_is_rejected() -> None:
    model = ReferenceModel(DENSE)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        model.load_weights([("model.norm.weight", torch.zeros(31, dtype=DENSE.dtype))])


@pytest.mark.parametrize(("cfg", "tp", "match"), [
    (DENSE, 3, "num_heads=4"),
    (dataclasses.replace(DENSE, num_heads=8, num_kv_heads=8, vocab_pad_to=4), 8,
     "padded vocab 100"),
])
def test_unplaceable_parallel_layouts_are_rejected(cfg: ReferenceConfig, tp: int,
                                                   match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ReferenceModel(cfg, tp_size=tp)


def test_fp8_is_refused_for_expert_mlps() -> None:
    with pytest.raises(ConfigError, match=r"mlp\.down_proj"):
        dataclasses.replace(MOE, fp8_modules=("mlp.down_proj",))


def test_random_checkpoint_is_reproducible_and_in_the_config_dtype() -> None:
    a, b = random_checkpoint(MOE, seed=11), random_checkpoint(MOE, seed=11)
    assert a.keys() == hf_checkpoint_shapes(MOE).keys()
    for name, t in a.items():
        assert t.dtype == MOE.dtype
        assert tuple(t.shape) == hf_checkpoint_shapes(MOE)[name]
        assert torch.equal(_bits(t), _bits(b[name]))


def test_only_the_hf_runtime_holds_weights_off_the_cpu(tmp_path: Any) -> None:
    """`dcr serve --device cuda` moves a transformers model; the vLLM-layout reference
    model has CPU kernels only, and asking for another device is refused by name."""
    from transformers import LlamaConfig

    from dcr.runtimes import build_runtime

    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="'vllm-ref' holds its weights on the CPU only, "
                                          "not on 'cuda'"):
        build_runtime("vllm-ref", tmp_path, device="cuda")
    model = build_runtime("hf", tmp_path, device="cpu").model  # type: ignore[attr-defined]
    assert {p.device.type for p in model.parameters()} == {"cpu"}
