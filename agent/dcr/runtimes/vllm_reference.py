"""A vLLM-layout reference runtime: weights held, named and loaded the way vLLM does it.

The stand-in for vLLM where it cannot be installed (tests, benchmarks, the demo): one TP
rank of a Llama or Qwen2-MoE model, parameters and loader only, no forward pass. Every
``weight_loader`` writes in place on views of ``param.data`` and never rebinds it, since DCR
intercepts exactly those writes. What it models and what not: docs/vllm-models.md, "Without
vLLM: the vLLM-layout reference runtime".
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from dcr.errors import ConfigError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value

ShardId = str | int | None

# (runtime module, checkpoint module, shard id): vLLM's table for fused projections.
stacked_params_mapping: list[tuple[str, str, str | int]] = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]

# (runtime expert parameter, checkpoint projection, shard id): FusedMoE's expert mapping.
expert_params_mapping: list[tuple[str, str, str]] = [
    ("w13_weight", "gate_proj", "w1"),
    ("w13_weight", "up_proj", "w3"),
    ("w2_weight", "down_proj", "w2"),
]

_LAYER_MODULE = r"^(?P<parent>model\.layers\.\d+\.(?:self_attn|mlp))"
_STACKED = [
    (re.compile(rf"{_LAYER_MODULE}\.{ckpt}\.weight$"), fused, sid)
    for fused, ckpt, sid in stacked_params_mapping
]
_EXPERT = re.compile(
    r"^(?P<parent>model\.layers\.\d+\.mlp)\.experts\.(?P<expert>\d+)"
    r"\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_BY_PROJ = {proj: (param, sid) for param, proj, sid in expert_params_mapping}

# Runtime modules that may be stored as FP8, with their number of logical shards
# (one weight_scale element each).
FP8_CAPABLE = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2,
               "mlp.down_proj": 1}


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    """The model's shape, in Hugging Face terms, plus the runtime's storage choices."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    tie_word_embeddings: bool
    vocab_pad_to: int = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
    num_experts: int = 0  # 0: dense MLP; >0: MoE layers with a router and stacked experts
    moe_intermediate_size: int = 0  # 0: intermediate_size
    fp8_modules: tuple[str, ...] = ()  # runtime module suffixes from FP8_CAPABLE
    dtype: torch.dtype = torch.bfloat16
    zero_vocab_padding: bool = True  # fill_(0) padding rows on each vocab load, as vLLM does

    def __post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                               "num_layers", "num_heads", "num_kv_heads",
                                               "vocab_pad_to")}
        for key, value in sizes.items():
            if value <= 0:
                raise ConfigError(f"ReferenceConfig.{key} must be positive, got {value}.")
        if min(self.head_dim, self.num_experts, self.moe_intermediate_size) < 0:
            raise ConfigError("head_dim, num_experts and moe_intermediate_size must be >= 0.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads}.")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.moe_intermediate_size == 0:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        for module in self.fp8_modules:
            if module not in FP8_CAPABLE or (self.num_experts and module.startswith("mlp.")):
                capable = sorted(m for m in FP8_CAPABLE
                                 if not (self.num_experts and m.startswith("mlp.")))
                raise ConfigError(f"fp8_modules entry {module!r} is not one of {capable}.")

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_pad_to) * self.vocab_pad_to


def hf_checkpoint_shapes(cfg: ReferenceConfig) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names and shapes of the model's Hugging Face checkpoint."""
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * hd)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.num_experts == 0:
            shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
            continue
        shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
        ie = cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (ie, h)
            shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (ie, h)
            shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, ie)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def random_checkpoint(cfg: ReferenceConfig, seed: int) -> dict[str, torch.Tensor]:
    """A reproducible random checkpoint in ``cfg.dtype``: norms near 1, weights near 0."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in hf_checkpoint_shapes(cfg).items():
        values = torch.randn(shape, generator=gen)
        out[name] = (1.0 + 0.1 * values if name.endswith("norm.weight") else 0.05 * values).to(
            cfg.dtype)
    return out


def local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global expert ids one EP rank holds: contiguous, the first ``E % ep`` one larger."""
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


@dataclass(frozen=True)
class _Cut:
    """Copy ``src.narrow(dim, src_start, length)`` into ``dst.narrow(dim, dst_start, length)``."""

    dim: int
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True, kw_only=True, eq=False)
class _Loader:
    """One parameter's ``weight_loader``: a table from shard id to the slice it copies.

    ``experts`` maps global expert ids to local slots (stacked expert parameters);
    ``scale`` is the FP8 ``weight_scale`` (one element per shard id, in table order);
    ``pad_rows_from`` is where a vocab shard's padding rows start.
    """

    cuts: Mapping[ShardId, _Cut | None]
    experts: Mapping[int, int] | None = None
    scale: torch.nn.Parameter | None = None
    pad_rows_from: int | None = None

    def __call__(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                 shard_id: ShardId = None, expert_id: int | None = None) -> bool:
        """Write this rank's part of ``loaded_weight`` in place; False if it holds none."""
        dst = param.data
        if self.experts is not None:
            if expert_id is None or expert_id not in self.experts:
                return False  # an expert held by another EP rank
            dst = dst[self.experts[expert_id]]
        cut = self.cuts[shard_id]
        src = loaded_weight
        if self.scale is not None:
            scale = _fp8_scale(src)
            src = (src.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            self.scale.data[list(self.cuts).index(shard_id)].copy_(scale)
        if cut is None:
            dst.copy_(src)
        else:
            dst.narrow(cut.dim, cut.dst_start, cut.length).copy_(
                src.narrow(cut.dim, cut.src_start, cut.length))
        if self.pad_rows_from is not None:
            param.data[self.pad_rows_from:].fill_(0)
        return True


_REPLICATED: Mapping[ShardId, _Cut | None] = {None: None}


@dataclass(frozen=True)
class _Spec:
    """One runtime parameter of a rank: name, local shape and its loader's tables."""

    name: str
    shape: tuple[int, ...]
    cuts: Mapping[ShardId, _Cut | None]
    experts: Mapping[int, int] | None = None
    pad_rows_from: int | None = None


def _fp8_scale(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp32 scale mapping ``amax(|w|)`` onto the FP8 maximum (1 for all zeros)."""
    amax = w.abs().amax().float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _route(name: str) -> tuple[str, ShardId, int | None]:
    """Checkpoint name -> (runtime parameter name, shard id, global expert id)."""
    if m := _EXPERT.match(name):
        param, expert_sid = _EXPERT_BY_PROJ[m["proj"]]
        return f"{m['parent']}.experts.{param}", expert_sid, int(m["expert"])
    for pattern, fused, sid in _STACKED:
        if m := pattern.match(name):
            return f"{m['parent']}.{fused}.weight", sid, None
    return name, None, None


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers pipeline stage ``pp_rank`` of ``pp_size`` holds, as vLLM
    partitions them by default: contiguous, equal, and the remainder one each to the
    stages just before the last (whose head and norm make it busier)."""
    counts = [num_layers // pp_size] * pp_size
    for k in range(num_layers % pp_size):
        counts[-2 - k] += 1
    first = sum(counts[:pp_rank])
    return range(first, first + counts[pp_rank])


def _check_parallel(cfg: ReferenceConfig, tp: int, rank: int, ep: bool, pp: int = 1,
                    pp_rank: int = 0) -> None:
    kv = cfg.num_kv_heads
    checks = [
        (0 <= rank < tp, f"tp_rank={rank} is outside tp_size={tp}"),
        (0 <= pp_rank < pp, f"pp_rank={pp_rank} is outside pp_size={pp}"),
        (pp <= cfg.num_layers, f"pp_size={pp} is more stages than {cfg.num_layers} layers"),
        (pp == 1 or not cfg.tie_word_embeddings,
         f"pp_size={pp} with tied embeddings: the head on the last stage would be a copy of "
         "the first stage's embedding, which this reference does not model"),
        (cfg.num_heads % tp == 0, f"num_heads={cfg.num_heads} is not divisible by tp={tp}"),
        (kv % tp == 0 or tp % kv == 0, f"num_kv_heads={kv} and tp={tp} divide neither way"),
        (cfg.padded_vocab % tp == 0,
         f"padded vocab {cfg.padded_vocab} is not divisible by tp={tp}"),
        (cfg.num_experts > 0 or cfg.intermediate_size % tp == 0,
         f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}"),
        (cfg.num_experts == 0 or ep or cfg.moe_intermediate_size % tp == 0,
         f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by tp={tp}"),
        (not ep or cfg.num_experts == 0 or cfg.num_experts >= tp,
         f"ep needs num_experts={cfg.num_experts} >= tp={tp}"),
    ]
    for ok, why in checks:
        if not ok:
            raise ConfigError(f"Cannot place the reference model: {why}.")


class ReferenceModel(torch.nn.Module):
    """One tensor-parallel rank of one pipeline stage of a Llama / Qwen2-MoE model in
    vLLM's runtime layout. A stage holds its decoder layers, the first the embedding and
    the last the final norm and head; its loader skips the tensors of other stages, as
    vLLM's does, and reports them unloaded."""

    def __init__(self, cfg: ReferenceConfig, tp_size: int = 1, tp_rank: int = 0,
                 ep: bool = False, pp_size: int = 1, pp_rank: int = 0) -> None:
        super().__init__()
        _check_parallel(cfg, tp_size, tp_rank, ep, pp_size, pp_rank)
        self.cfg, self.tp_size, self.tp_rank, self.ep = cfg, tp_size, tp_rank, ep
        self.pp_size, self.pp_rank = pp_size, pp_rank
        self.layers = stage_layers(cfg.num_layers, pp_size, pp_rank)
        self.local_experts = (local_experts(cfg.num_experts, tp_size, tp_rank) if ep
                              else range(cfg.num_experts))
        self._hf_shapes = hf_checkpoint_shapes(cfg)
        for spec in self._layout():
            self._add(spec)
        if cfg.tie_word_embeddings:  # vLLM ties by sharing the Parameter object
            self._attach("lm_head.weight", self.get_parameter("model.embed_tokens.weight"))

    def _layout(self) -> Iterator[_Spec]:
        """Every runtime parameter of this rank, with its shard table."""
        cfg, tp, r = self.cfg, self.tp_size, self.tp_rank
        h, hd = cfg.hidden_size, cfg.head_dim
        per_vocab = cfg.padded_vocab // tp
        v_start = min(r * per_vocab, cfg.vocab_size)
        v_rows = min(per_vocab, cfg.vocab_size - v_start)
        pad = v_rows if cfg.zero_vocab_padding else None
        first, last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        if first:
            yield _Spec("model.embed_tokens.weight", (per_vocab, h),
                        {None: _Cut(0, v_start, 0, v_rows)}, pad_rows_from=pad)
        q = cfg.num_heads * hd // tp
        kv = max(1, cfg.num_kv_heads // tp) * hd
        kv_rank = r // max(1, tp // cfg.num_kv_heads)  # ranks sharing a replicated KV head
        i, ie = cfg.intermediate_size // tp, cfg.moe_intermediate_size // (1 if self.ep else tp)
        ie_rank = 0 if self.ep else r
        slots = {g: s for s, g in enumerate(self.local_experts)}
        for layer in self.layers:
            p = f"model.layers.{layer}."
            yield _Spec(p + "input_layernorm.weight", (h,), _REPLICATED)
            yield _Spec(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h), {
                "q": _Cut(0, r * q, 0, q), "k": _Cut(0, kv_rank * kv, q, kv),
                "v": _Cut(0, kv_rank * kv, q + kv, kv)})
            yield _Spec(p + "self_attn.o_proj.weight", (h, q), {None: _Cut(1, r * q, 0, q)})
            yield _Spec(p + "post_attention_layernorm.weight", (h,), _REPLICATED)
            if cfg.num_experts == 0:
                yield _Spec(p + "mlp.gate_up_proj.weight", (2 * i, h), {
                    0: _Cut(0, r * i, 0, i), 1: _Cut(0, r * i, i, i)})
                yield _Spec(p + "mlp.down_proj.weight", (h, i), {None: _Cut(1, r * i, 0, i)})
                continue
            yield _Spec(p + "mlp.gate.weight", (cfg.num_experts, h), _REPLICATED)
            yield _Spec(p + "mlp.experts.w13_weight", (len(slots), 2 * ie, h), {
                "w1": _Cut(0, ie_rank * ie, 0, ie), "w3": _Cut(0, ie_rank * ie, ie, ie)},
                experts=slots)
            yield _Spec(p + "mlp.experts.w2_weight", (len(slots), h, ie), {
                "w2": _Cut(1, ie_rank * ie, 0, ie)}, experts=slots)
        if not last:
            return
        yield _Spec("model.norm.weight", (h,), _REPLICATED)
        if not cfg.tie_word_embeddings:
            yield _Spec("lm_head.weight", (per_vocab, h),
                        {None: _Cut(0, v_start, 0, v_rows)}, pad_rows_from=pad)

    def _add(self, spec: _Spec) -> None:
        module = spec.name.removesuffix(".weight")
        fp8 = any(module.endswith("." + m) for m in self.cfg.fp8_modules)
        scale = _zeros_param((len(spec.cuts),), torch.float32) if fp8 else None
        param = _zeros_param(spec.shape, FP8_DTYPE if fp8 else self.cfg.dtype)
        setattr(param, "weight_loader", _Loader(  # noqa: B010 (vLLM's set_weight_attrs)
            cuts=spec.cuts, experts=spec.experts, scale=scale, pad_rows_from=spec.pad_rows_from))
        self._attach(spec.name, param)
        if scale is not None:
            self._attach(module + ".weight_scale", scale)

    def _attach(self, dotted: str, param: torch.nn.Parameter) -> None:
        *path, leaf = dotted.split(".")
        module: torch.nn.Module = self
        for part in path:
            child = getattr(module, part, None)
            if not isinstance(child, torch.nn.Module):
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, param)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load canonical tensors in place, vLLM style; return the runtime names written.

        Raises KeyError for a name that is not in this model's checkpoint and ValueError
        for a tensor of the wrong shape. A tied model's ``lm_head.weight``, experts held
        by other EP ranks and tensors of other pipeline stages are skipped and not
        returned.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # the head is the embedding
            expected = self._hf_shapes.get(name)
            if expected is None:
                raise KeyError(f"{name!r} is not a tensor of this model's checkpoint.")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the "
                                 f"checkpoint shape {expected}.")
            target, shard_id, expert_id = _route(name)
            param = params.get(target)
            if param is None and self.pp_size > 1:
                continue  # another stage's tensor (vLLM: is_pp_missing_parameter)
            assert param is not None, target
            loader = getattr(param, "weight_loader", None)
            assert isinstance(loader, _Loader), target
            if loader(param, tensor, shard_id, expert_id):
                loaded.add(target)
                if loader.scale is not None:
                    loaded.add(target + "_scale")
        return loaded


def _zeros_param(shape: tuple[int, ...], dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


def dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Clones of every parameter and buffer, under every name (tied ones twice)."""
    named = itertools.chain(model.named_parameters(remove_duplicate=False),
                            model.named_buffers(remove_duplicate=False))
    return {name: t.detach().clone() for name, t in named}
