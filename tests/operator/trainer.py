"""A small trainer for the operator's end-to-end test: real AdamW steps, HF exports.

A Llama-architecture model (transformers, random init) learns byte tokens of real text
(the standard library's own source) with AdamW at an RL-like learning rate; after every
optimizer step it exports a BF16 Hugging Face checkpoint, as a trainer hands a policy
version to rollout. Only a small share of the BF16 elements change per step.
"""

from __future__ import annotations

import copy
import inspect
import json
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ, BATCH = 64, 4


class Trainer:
    def __init__(self, seed: int = 0, lr: float = 1e-5) -> None:
        torch.manual_seed(seed)
        self.cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=SEQ,
                               tie_word_embeddings=False)
        self.model = LlamaForCausalLM(self.cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        text = "".join(inspect.getsource(m) for m in (json, shutil)).encode()
        self.data = torch.tensor(list(text), dtype=torch.long)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> float:
        starts = torch.randint(0, len(self.data) - SEQ - 1, (BATCH,), generator=self.gen)
        batch = torch.stack([self.data[s: s + SEQ] for s in starts.tolist()])
        loss = self.model(input_ids=batch, labels=batch).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def export(self, path: Path) -> Path:
        shutil.rmtree(path, ignore_errors=True)
        copy.deepcopy(self.model).to(torch.bfloat16).save_pretrained(  # type: ignore[arg-type]
            path, max_shard_size="200KB", safe_serialization=True)
        return path


def reference_fingerprint(ckpt: Path) -> dict[str, str]:
    """What a dense load of ``ckpt`` through the hf runtime's own loader holds."""
    from dcr.checkpoint import Checkpoint
    from dcr.receiver.host import checkpoint_tensors, runtime_fingerprint
    from dcr.runtimes import build_runtime

    runtime = build_runtime("hf", ckpt)
    with Checkpoint(ckpt) as c:
        runtime.load_weights(checkpoint_tensors(c).items())
    return runtime_fingerprint(runtime)
