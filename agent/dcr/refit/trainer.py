"""The trainer every refit in this repository starts from: real optimizer steps, HF exports.

A small Llama learns byte tokens of real text with AdamW and exports a BF16 checkpoint after
each step; :func:`reference_fingerprint` is what a receiver must hold then. torch loads
lazily, so ``dcr --help`` does not import it. Why real steps: docs/architecture.md, "The main
job".
"""

from __future__ import annotations

import copy
import importlib
import inspect
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dcr.errors import ConfigError
from dcr.settings import option

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256  # byte tokens


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """The model's shape, the data and the optimizer. Defaults: the main job's trainer."""

    seed: int = option(0, metavar="N", doc="seed of the initial weights and of the batch sampler")
    lr: float = option(5e-7, doc="AdamW learning rate: an RL fine-tuning rate, at which "
                       "most BF16 elements round back to the same bits each step")
    warmup_steps: int = option(3, metavar="K", doc="optimizer steps before the first "
                               "export, leaving Adam's first, sign-like steps behind")
    hidden_size: int = option(512, metavar="N", doc="model width; with the defaults a 23M "
                              "parameter (47 MB BF16) model: large enough that a full "
                              "checkpoint's transfer across the main job's emulated link "
                              "shows, small enough to train on a CPU core")
    intermediate_size: int = option(1376, metavar="N", doc="MLP width (about 8/3 of the "
                                    "model width, as Llama's)")
    layers: int = option(8, metavar="N", doc="decoder layers")
    heads: int = option(8, doc="attention heads; must divide hidden_size", cli=False)
    kv_heads: int = option(4, doc="key/value heads (grouped-query attention, so the "
                           "vLLM-layout qkv fusion sees unequal parts); divides heads",
                           cli=False)
    seq: int = option(128, doc="tokens per training sequence (and max positions)",
                      cli=False)
    batch: int = option(8, doc="sequences per optimizer step", cli=False)
    corpus: tuple[str, ...] = option(("json", "argparse", "collections"),
                                     doc="stdlib modules whose source is the training text",
                                     cli=False)
    max_shard_size: str = option("2MB", doc="export shard size (transformers' notation): "
                                 "small, so even a small model is a sharded checkpoint",
                                 cli=False)

    def __post_init__(self) -> None:
        sizes = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                 "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads,
                 "seq": self.seq, "batch": self.batch}
        for name, value in sizes.items():
            if value < 1:
                raise ConfigError(f"Trainer setting {name}={value} must be at least 1.")
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise ConfigError(f"Trainer heads={self.heads} must divide hidden_size="
                              f"{self.hidden_size}, and kv_heads={self.kv_heads} heads.")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ConfigError(f"Trainer lr={self.lr} must be positive and warmup_steps="
                              f"{self.warmup_steps} not negative.")
        if not self.corpus:
            raise ConfigError("Trainer corpus names no module.")


def corpus(modules: tuple[str, ...]) -> bytes:
    """The source text of ``modules``, concatenated: real text, the same on every machine."""
    return "".join(inspect.getsource(importlib.import_module(m)) for m in modules).encode()


class Trainer:
    """A model, its optimizer and its data; :meth:`step` trains, :meth:`export` hands off."""

    cfg: LlamaConfig
    model: LlamaForCausalLM

    def __init__(self, settings: TrainerSettings | None = None) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        s = self.settings = settings or TrainerSettings()
        torch.manual_seed(s.seed)
        self.cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
            num_hidden_layers=s.layers, num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads, max_position_embeddings=s.seq,
            tie_word_embeddings=False,
        )
        self.model = LlamaForCausalLM(self.cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=s.lr, weight_decay=0.0)
        self.data: torch.Tensor = torch.tensor(list(corpus(s.corpus)), dtype=torch.long)
        self.gen = torch.Generator().manual_seed(s.seed)
        for _ in range(s.warmup_steps):
            self.step()

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        """One optimizer step on a random batch; the loss before it."""
        import torch

        s = self.settings
        starts = torch.randint(0, len(self.data) - s.seq - 1, (s.batch,), generator=self.gen)
        batch = torch.stack([self.data[i : i + s.seq] for i in starts.tolist()])
        loss = self.model(input_ids=batch, labels=batch).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def export(self, path: Path) -> Path:
        """Save BF16 weights at ``path`` as a sharded HF checkpoint (replacing it)."""
        import torch

        shutil.rmtree(path, ignore_errors=True)
        copy.deepcopy(self.model).to(torch.bfloat16).save_pretrained(  # type: ignore[arg-type]
            path, max_shard_size=self.settings.max_shard_size, safe_serialization=True)
        return path


def reference_fingerprint(ckpt: Path, runtime: str = "hf", *, tp_size: int = 1,
                          tp_rank: int = 0, fp8: tuple[str, ...] = ()) -> dict[str, str]:
    """What a dense load of ``ckpt`` through ``runtime``'s own loader holds, per tensor."""
    from dcr.checkpoint import Checkpoint
    from dcr.runtimes import build_runtime
    from dcr.runtimes.weights import checkpoint_tensors, runtime_fingerprint

    built = build_runtime(runtime, ckpt, tp_size=tp_size, tp_rank=tp_rank, fp8=fp8)
    with Checkpoint(ckpt) as c:
        built.load_weights(checkpoint_tensors(c).items())
    return runtime_fingerprint(built)
