"""Decompression bombs at the apply engine: a small payload must stay small until refused.

A payload's streams decompress to sizes its header declares, and those follow from its
items. A receiver therefore checks every item against its canonical tensors (name, dtype,
shape) before it decompresses a byte, and decodes under limits derived from its model
(:meth:`DecodeLimits.for_tensors`). Each hostile payload here is a few KiB that would
decompress to hundreds of MiB; the engine must refuse it with a sentence naming the
tensor, and the peak of Python-tracked memory (bytes, numpy) during the call must stay
under 64 MiB, far below what decompressing would take.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pytest
import torch

from dcr.apply.applier import Applier
from dcr.apply.plan import CanonicalTensor
from dcr.errors import DcrError, LimitExceeded, TargetMismatch
from dcr.format.payload import DecodeLimits, ItemHeader, Payload, pack_payload, read_payload

HUGE = 1 << 27  # elements the hostile items declare: 128 MiB per one-byte stream
PEAK_BOUND = 64 << 20  # generous: the refused payloads are a few KiB


class Toy:
    """One BF16 parameter ``w`` [64, 32], loaded by a plain copy."""

    def __init__(self) -> None:
        self.p = torch.zeros(64, 32, dtype=torch.bfloat16)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _, t in weights:
            self.p.copy_(t)
        return {"w"}

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "w", self.p


@pytest.fixture
def engine() -> Applier:
    e = Applier(Toy())
    e.prewarm([CanonicalTensor(name="w", dtype="BF16", shape=(64, 32))])
    return e


def overwrite_all(name: str, dtype: str, shape: tuple[int, ...], value: int = 1) -> bytes:
    """A sealed payload overwriting every element of one tensor, every gap zero."""
    n = int(np.prod(shape))
    size = {"U8": 1, "BF16": 2}[dtype]
    item = ItemHeader(name=name, dtype=dtype, shape=shape, start=0, stop=n, entry="overwrite",
                      loc="gaps", count=n, runs=0, escapes=0, loc_width=0, len_width=0)
    streams = {"loc.0": bytes(n)}
    streams |= {f"val.overwrite.{dtype}.{k}": bytes([value]) * n for k in range(size)}
    return pack_payload(base_version=0, target_version=1, attempt="a-bomb", owner=0, seq=0,
                        mode="overwrite", items=(item,), streams=streams)


def peak_of(call: Callable[[], object]) -> tuple[BaseException | None, int]:
    """Run ``call``; the error it raised (or None) and the peak of traced memory."""
    tracemalloc.start()
    try:
        call()
    except DcrError as e:
        return e, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return None, 0


@pytest.mark.parametrize(("name", "dtype", "needles"), [
    ("model.layers.9.mlp.missing.weight", "U8",
     ["model.layers.9.mlp.missing.weight", "no canonical tensor"]),
    ("w", "BF16", [f"Item w[0:{HUGE}]", f"BF16[{HUGE}]", "BF16[64, 32]"]),
])
def test_item_that_does_not_fit_the_model_is_refused_before_any_stream_is_decompressed(
        engine: Applier, name: str, dtype: str, needles: list[str]) -> None:
    """Fails on 5b0b0ae: the engine decoded every stream (here 256-384 MiB) before it
    compared the items with its tensors."""
    data = overwrite_all(name, dtype, (HUGE,))
    assert len(data) < 64 << 10, len(data)  # the bomb is small
    payload = read_payload(data)  # as a receiver holds it: framing, digest, header
    error, peak = peak_of(lambda: engine.apply_payloads([payload]))
    assert isinstance(error, TargetMismatch), error
    for needle in needles:
        assert needle in str(error), (needle, str(error))
    assert peak < PEAK_BOUND, f"peak {peak >> 20} MiB while refusing a {len(data)}-byte payload"
    assert not torch.any(engine.runtime.p.view(torch.int16))  # type: ignore[attr-defined]


def test_payload_bytes_declaring_a_stream_over_the_model_are_refused_by_its_limits(
        engine: Applier) -> None:
    """Fails on 5b0b0ae: bytes were read under the default limits (8 GiB a stream), so a
    128 MiB stream for a 2048-element model was decompressed before anything refused it."""
    data = overwrite_all("model.layers.9.mlp.missing.weight", "U8", (HUGE,))
    error, peak = peak_of(lambda: engine.apply_payloads([data]))
    assert isinstance(error, LimitExceeded), error
    assert f"[{HUGE}]" in str(error), str(error)
    assert "2048 elements" in str(error), str(error)
    assert peak < PEAK_BOUND, f"peak {peak >> 20} MiB"


def test_model_limits_bound_streams_by_all_elements_and_never_refuse_an_honest_payload(
        ) -> None:
    """The derived limits are sound: ``loc.0`` spans every tensor a payload touches (so a
    stream may outgrow the largest tensor) and an overwrite of a whole tensor carries a
    location byte per element beside its values (more than the tensor's own bytes)."""
    tensors = [("BF16", (64, 32)), ("F32", (8,)), ("U8", (3, 3, 3))]
    limits = DecodeLimits.for_tensors(tensors)
    assert limits.max_elements == 2048
    assert limits.max_ndim == 3
    assert limits.max_stream_bytes == 2048 + 8 + 27
    assert limits.max_total_bytes == 2048 * (2 + 17) + 8 * (4 + 17) + 27 * (1 + 17)
    assert DecodeLimits.for_tensors([]).max_elements == 0
    # the loosest honest payload: every element of the largest tensor, overwritten
    read_payload(overwrite_all("w", "BF16", (64, 32)), limits)


def test_an_honest_whole_tensor_overwrite_applies_under_the_model_limits(
        engine: Applier) -> None:
    engine.apply_payloads([overwrite_all("w", "BF16", (64, 32), value=0x3F)])
    assert torch.all(engine.runtime.p.view(torch.int16) == 0x3F3F)  # type: ignore[attr-defined]


def test_engine_limits_come_from_the_prewarmed_tensors(engine: Applier) -> None:
    assert engine.limits == DecodeLimits.for_tensors([("BF16", (64, 32))])
    assert isinstance(read_payload(overwrite_all("w", "BF16", (64, 32)), engine.limits),
                      Payload)
