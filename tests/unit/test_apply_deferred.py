"""The deferred set: one loader call for every deferrable tensor, writes once it is checked.

A toy runtime holds four BF16 parameters ``p0``..``p3``; canonical ``w0``..``w3`` copy
into them. Once armed, its loader misbehaves in one way per test: it fails after some
tensors, copies a tensor into another's parameter, or reads a parameter back. Each
misbehaviour during a deferred apply must leave every parameter exactly as it was,
and the protocol's retry (an overwrite attempt) must still reach a dense load's bits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pytest
import torch

from dcr.apply.applier import Applier, ApplyReport, DuplicatePayload
from dcr.apply.intercept import LoaderPathError
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.format.names import Mode
from dcr.format.profile import ReceiverProfile
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.transport.store import MemoryStore

N = 4
SHAPE = (8, 4)
State = dict[str, torch.Tensor]


class Toy:
    """Parameters ``p0``..``p3``; the loader copies canonical ``wK`` into ``pK``."""

    def __init__(self, *, read_back: bool = False) -> None:
        self.params = {f"p{k}": torch.zeros(SHAPE, dtype=torch.bfloat16) for k in range(N)}
        self.read_back = read_back  # read each parameter after writing it
        self.fail_after: int | None = None  # raise when asked for this many-th tensor
        self.astray = False  # copy w1 into p2 as well
        self.calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        loaded = set()
        for k, (name, t) in enumerate(weights):
            if k == self.fail_after:
                raise RuntimeError("loader failed mid-way")
            p = self.params["p" + name[1:]]
            p.copy_(t)
            if self.astray and name == "w1":
                self.params["p2"].copy_(t)
            if self.read_back:
                p.float().sum()
            loaded.add("p" + name[1:])
        return loaded

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.params.items()

    def bits(self) -> dict[str, torch.Tensor]:
        return {n: p.view(torch.int16).clone() for n, p in self.params.items()}


def versions() -> tuple[State, State]:
    gen = torch.Generator().manual_seed(0)
    old = {f"w{k}": torch.randn(SHAPE, generator=gen).to(torch.bfloat16) for k in range(N)}
    new = {}
    for name, t in old.items():
        bits = t.view(torch.int16).clone()
        bits.view(-1)[torch.rand(bits.numel(), generator=gen) < 0.3] += 1
        new[name] = bits.view(torch.bfloat16)
    return old, new


def source(state: State) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", SHAPE, t.view(torch.int16).numpy().view(np.uint16))
                            for n, t in state.items()})


def receiver(old: State, **kwargs: bool) -> tuple[Toy, Applier]:
    toy = Toy(**kwargs)
    toy.load_weights(old.items())
    engine = Applier(toy)
    engine.prewarm(CanonicalTensor(name=n, dtype="BF16", shape=SHAPE) for n in old)
    return toy, engine


def payloads(old: State, new: State, engine: Applier, *, mode: Mode = "mixed",
             attempt: str = "a-1") -> list[bytes]:
    store = MemoryStore()
    profile = ReceiverProfile(tensors={n: p.cls for n, p in engine.plans.items()})
    m = diff_checkpoints(source(old), source(new), store, EncodeSettings(
        target_version=1, base_version=0, profile=profile, mode=mode, attempt=attempt))
    return [store.get(e.key) for e in m.payloads]


def dense(new: State) -> dict[str, torch.Tensor]:
    toy = Toy()
    toy.load_weights(new.items())
    return toy.bits()


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def apply(engine: Applier, data: list[bytes]) -> ApplyReport:
    return engine.apply_payloads(data)


@pytest.mark.parametrize("defer", [True, False])
def test_a_set_applies_through_one_loader_call_or_one_per_tensor_to_the_same_bits(
        defer: bool) -> None:
    old, new = versions()
    toy, engine = receiver(old)
    engine.defer = defer
    data = payloads(old, new, engine)
    toy.calls = 0
    report = apply(engine, data)
    assert (toy.calls, report.loads, report.deferred) == ((1, 1, N) if defer else (N, N, 0))
    assert report.tensors == N
    assert equal(toy.bits(), dense(new))


@pytest.mark.parametrize("fail_after", [0, 1, 3])
def test_a_loader_failing_mid_way_through_the_set_leaves_every_parameter_as_it_was(
        fail_after: int) -> None:
    old, new = versions()
    toy, engine = receiver(old)
    data = payloads(old, new, engine)
    before = toy.bits()
    toy.fail_after = fail_after
    with pytest.raises(RuntimeError, match="mid-way"):
        apply(engine, data)
    assert equal(toy.bits(), before)
    toy.fail_after = None
    with pytest.raises(DuplicatePayload, match="already applied"):
        apply(engine, data)  # its ids were recorded: an XOR set never applies twice
    apply(engine, payloads(old, new, engine, mode="overwrite", attempt="a-retry"))
    assert equal(toy.bits(), dense(new))


def test_a_loader_writing_another_tensors_parameter_during_the_set_writes_nothing() -> None:
    old, new = versions()
    toy, engine = receiver(old)
    data = payloads(old, new, engine)
    before = toy.bits()
    toy.astray = True
    with pytest.raises(LoaderPathError, match=r"differ from prewarm.s.*nothing was written"):
        apply(engine, data)
    assert equal(toy.bits(), before)


def test_a_loader_reading_parameters_back_is_applied_one_tensor_at_a_time() -> None:
    old, new = versions()
    toy, engine = receiver(old, read_back=True)
    assert not any(p.deferrable for p in engine.plans.values())
    toy.calls = 0
    report = apply(engine, payloads(old, new, engine))
    assert (toy.calls, report.deferred) == (N, 0)
    assert equal(toy.bits(), dense(new))


def test_a_loader_that_starts_reading_parameters_during_the_set_writes_nothing() -> None:
    old, new = versions()
    toy, engine = receiver(old)
    data = payloads(old, new, engine)
    before = toy.bits()
    toy.read_back = True
    with pytest.raises(LoaderPathError, match=r"read parameter storage.*nothing was written"):
        apply(engine, data)
    assert equal(toy.bits(), before)
