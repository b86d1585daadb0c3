"""How prewarm classifies loader paths, on small hand-written loaders."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pytest
import torch

from dcr.apply.applier import Applier
from dcr.apply.intercept import LoaderPathError
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.format.profile import ReceiverProfile
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.transport.store import MemoryStore

Loader = Callable[[torch.Tensor, torch.Tensor], None]


class Toy:
    """One parameter ``p`` [8, 4] BF16 and a loader for canonical ``w`` [8, 4]."""

    def __init__(self, load: Loader) -> None:
        self.p = torch.zeros(8, 4, dtype=torch.bfloat16)
        self.load = load

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, t in weights:
            self.load(self.p, t)
        return {"p"}

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "p", self.p

    def close_gate(self) -> None: ...

    def open_gate(self) -> None: ...


def twice(p: torch.Tensor, t: torch.Tensor) -> None:
    p.copy_(t)
    p[:4].copy_(t[:4])  # the same bytes written again


def fill_under_copy(p: torch.Tensor, t: torch.Tensor) -> None:
    p.fill_(0)
    p[:, :2].copy_(t[:, :2])


def index_put(p: torch.Tensor, t: torch.Tensor) -> None:
    p[torch.tensor([0, 1])] = t[:2]


def refit(load: Loader) -> tuple[str, bool]:
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(8, 4, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[::3] += 1
    toy = Toy(load)
    toy.load_weights([("w", old)])
    engine = Applier(toy)
    cls = engine.prewarm([CanonicalTensor(name="w", dtype="BF16", shape=(8, 4))]).tensors["w"]
    src = {n: ArrayCheckpoint({"w": ("BF16", (8, 4), t.view(torch.int16).numpy()
                                     .view(np.uint16))}) for n, t in (("old", old), ("new", new))}
    store = MemoryStore()
    profile = ReceiverProfile(tensors={"w": cls})
    m = diff_checkpoints(src["old"], src["new"], store,
                         EncodeSettings(target_version=1, base_version=0, profile=profile))
    engine.apply_payloads([store.get(e.key) for e in m.payloads])
    dense = Toy(load)
    dense.load_weights([("w", new)])
    return cls, torch.equal(toy.p.view(torch.int16), dense.p.view(torch.int16))


def test_a_loader_writing_the_same_bytes_twice_is_overwrite_and_exact() -> None:
    assert refit(twice) == ("overwrite", True)


def test_a_fill_under_a_copy_is_dense_and_exact() -> None:
    assert refit(fill_under_copy) == ("dense", True)


def test_a_plain_copy_is_xor_and_exact() -> None:
    assert refit(lambda p, t: p.copy_(t)) == ("xor", True)


def test_a_write_other_than_copy_or_fill_is_refused_at_prewarm() -> None:
    with pytest.raises(LoaderPathError, match="index_put"):
        refit(index_put)
