"""A small transition of the vLLM-layout reference Llama for refit tests over a store.

Version 0 is :func:`random_checkpoint`; version 1 moves about 3% of the elements, as an
optimizer step would. Both come as state dicts (for receivers' dense loads) and as the
BF16 bit patterns an owner compares (:meth:`Transition.bits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import (
    ReferenceConfig,
    ReferenceModel,
    dense_state,
    random_checkpoint,
)
from dcr.serve.local import LocalDriver
from dcr.transport.receive import StoreSource
from dcr.transport.store import Store

CONFIG = ReferenceConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, tie_word_embeddings=False)


@dataclass(frozen=True)
class Transition:
    cfg: ReferenceConfig
    old: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]

    @staticmethod
    def bits(sd: dict[str, torch.Tensor]) -> ArrayCheckpoint:
        return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                    .view("<u2")) for n, t in sd.items()})

    @property
    def canonical(self) -> list[CanonicalTensor]:
        return [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                for n, t in self.old.items()]

    def receivers(self, tmp_path: Path, stores: Sequence[Store]
                  ) -> tuple[list[ReferenceModel], list[AgentService]]:
        """TP ranks at the old version, one per store, each an in-process agent that pulls
        its attempts from that store."""
        models, agents = [], []
        for r, store in enumerate(stores):
            model = ReferenceModel(self.cfg, tp_size=len(stores), tp_rank=r)
            model.load_weights(self.old.items())
            staging = tmp_path / f"rank-{r}"
            agents.append(AgentService(
                f"rank-{r}", LocalDriver([model], staging_dir=staging, checkpoint_root=tmp_path),
                lambda spec, store=store: StoreSource(store=store, version=spec.target_version,
                                                      attempt=spec.attempt),
                canonical=self.canonical, staging_dir=staging, version=0))
            models.append(model)
        return models, agents

    def exact(self, model: ReferenceModel, tp_size: int, tp_rank: int) -> bool:
        """Whether ``model`` holds, bit for bit, a dense load of the new version."""
        dense = ReferenceModel(self.cfg, tp_size=tp_size, tp_rank=tp_rank)
        dense.load_weights(self.new.items())
        a, b = dense_state(model), dense_state(dense)
        return sorted(a) == sorted(b) and all(
            torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def reference_transition(changed: float = 0.03) -> Transition:
    old = random_checkpoint(CONFIG, 0)
    gen = torch.Generator().manual_seed(1)
    new = {n: torch.where(torch.rand(t.shape, generator=gen) < changed,
                          (t.float() * 1.1 + 1e-3).to(torch.bfloat16), t)
           for n, t in old.items()}
    return Transition(cfg=CONFIG, old=old, new=new)
