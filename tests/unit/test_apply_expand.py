"""The device path's expansion (``dcr.apply.expand``) against the codec's C kernel.

Records reach the device location-coded and become positions there with torch operations;
the same operations run here on the CPU. Over random payloads (every dtype, both entry
kinds, gap and run coding, escapes of one, two and four bytes, tensors split into several
items) the positions must equal the C kernel's, and a scatter with them must give the
bits the C scatter gives. Then the applier itself: the vLLM-layout reference runtime at
TP 2 (fused qkv and gate_up, experts with and without expert parallelism, an FP8 module
on the staged dense path, tied and padded vocabularies) refits through
``Applier(expand="device")`` to the bits of a dense load, and to the bits the host path
gives, with the records used in place and packed into one buffer as CUDA receives them;
a payload that fails validation never reaches the upload. The golden fixtures and
the hostile-payload suite run through this path too (``test_golden.py``,
``test_payload_attacks.py``: their ``kernel`` parameter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from dcr.apply import expand
from dcr.apply.applier import Applier
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint
from dcr.codec.decode import DecodedItem, Target, apply_items, decode
from dcr.codec.encode import PayloadBuilder, diff_range, encode_item
from dcr.errors import MalformedPayload
from dcr.format.dtypes import DTYPES, dtype
from dcr.format.payload import ItemHeader, pack_payload, read_payload
from dcr.format.profile import merge
from dcr.format.regions import region_key
from dcr.owner.diff import diff_checkpoints, target_sums
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.loader import VllmRuntime
from dcr.runtimes.vllm_reference import (
    ReferenceConfig,
    ReferenceModel,
    dense_state,
    random_checkpoint,
)
from dcr.transport.store import MemoryStore

DTYPE_NAMES = ["BF16", "F16", "F32", "F64", "F8_E4M3", "I64", "I32", "U8", "BOOL"]
PATTERNS = ["sparse", "dense", "runs", "far", "single", "edges", "whole"]


def _changed(rng: np.random.Generator, n: int, pattern: str) -> np.ndarray:
    """Ascending distinct positions in [0, n), shaped to exercise one coding."""
    if pattern == "sparse":  # gaps, most under 255, some escaped
        pos = rng.choice(n, size=max(1, n // 300), replace=False)
    elif pattern == "dense":
        pos = np.flatnonzero(rng.random(n) < 0.3)
    elif pattern == "runs":  # clustered: run coding
        starts = rng.choice(n, size=max(1, n // 2000), replace=False)
        pos = np.unique(np.concatenate([np.arange(s, min(n, s + rng.integers(4, 60)))
                                        for s in starts]))
    elif pattern == "far":  # few changes, gaps escaped in two and four bytes
        pos = np.unique(np.concatenate([[0], rng.choice(n, size=4, replace=False), [n - 1]]))
    elif pattern == "single":
        pos = rng.choice(n, size=1)
    elif pattern == "edges":
        pos = np.array([0, n - 1])
    else:
        pos = np.arange(n)
    return np.sort(pos).astype(np.int64)


def _random_bits(rng: np.random.Generator, n: int, dt: str) -> np.ndarray:
    bits = DTYPES[dt].bits
    if dt == "BOOL":
        return rng.integers(0, 2, size=n, dtype=np.uint8)
    return rng.integers(0, 1 << (8 * bits.itemsize), size=n, dtype=np.uint64).astype(bits)


def _case(seed: int) -> tuple[bytes, dict[str, np.ndarray], dict[str, np.ndarray],
                              dict[str, tuple[str, tuple[int, ...]]]]:
    """A sealed payload of three tensors, with their base and target bits."""
    rng = np.random.default_rng(seed)
    pb = PayloadBuilder(base_version=1, target_version=2, attempt="a-expand", owner=0,
                        seq=seed, mode="mixed")
    base: dict[str, np.ndarray] = {}
    target: dict[str, np.ndarray] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for k in range(3):
        dt = DTYPE_NAMES[int(rng.integers(len(DTYPE_NAMES)))]
        pattern = PATTERNS[int(rng.integers(len(PATTERNS)))]
        rows = int(rng.integers(1, 400))
        shape = (rows, 220) if pattern != "far" else (rows + 400, 220)  # far: > 65,791
        n = rows * 220 if pattern != "far" else (rows + 400) * 220
        b = _random_bits(rng, n, dt)
        t = b.copy()
        pos = _changed(rng, n, pattern)
        if dt == "BOOL":
            t[pos] ^= 1
        else:
            flips = _random_bits(rng, len(pos), dt)
            flips[flips == 0] = 1
            t[pos] ^= flips
        entry = "overwrite" if dt in ("BOOL", "F8_E4M3") or rng.random() < 0.4 else "xor"
        name = f"t{k}"
        cuts = np.unique(rng.integers(1, n, size=int(rng.integers(0, 3))))
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            d = diff_range(name=name, dtype=dtype(dt), shape=shape, start=int(lo),
                           base=b[lo:hi], target=t[lo:hi], entry=entry)
            if d is not None:
                pb.add(encode_item(d), dense_bytes=int(b[lo:hi].nbytes))
        base[name], target[name], meta[name] = b, t, (dt, shape)
    return pb.seal(), base, target, meta


def _targets(base: dict[str, np.ndarray],
             meta: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Target]:
    return {n: Target(dtype=meta[n][0], shape=meta[n][1], bits=b.copy().reshape(meta[n][1]))
            for n, b in base.items()}


def _c_positions(item: DecodedItem) -> np.ndarray:
    out = np.empty(item.header.count, dtype=np.int64)
    item.positions(out)
    return out


@pytest.mark.parametrize("seed", range(60))
def test_positions_and_bits_equal_the_c_kernel(seed: int) -> None:
    data, base, target, meta = _case(seed)
    items = decode(read_payload(data))
    codings = set()
    for item in items:
        codings.add((item.header.loc, item.header.loc_width))
        got = expand.expand_item(expand.on_host([item]).items[0])
        assert got.dtype == torch.int64
        assert np.array_equal(got.numpy(), _c_positions(item)), item.header.where
    by_c, by_torch = _targets(base, meta), _targets(base, meta)
    assert apply_items(items, by_c) == expand.apply_items(items, by_torch)
    for name, want in target.items():
        assert np.array_equal(by_c[name].bits.reshape(-1), want), name
        assert by_torch[name].bits.tobytes() == by_c[name].bits.tobytes(), name


@pytest.mark.parametrize("seed", range(8))
def test_blocked_cpu_scatter_gives_the_same_bits(seed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU scatter goes in blocks of records; blocks of 5 cut every item many times."""
    monkeypatch.setattr(expand, "CPU_BLOCK", 5)
    data, base, target, meta = _case(seed)
    items = decode(read_payload(data))
    got = _targets(base, meta)
    expand.apply_items(items, got)
    for name, want in target.items():
        assert np.array_equal(got[name].bits.reshape(-1), want), name


def test_the_random_cases_reach_every_coding_and_escape_width() -> None:
    """Control: the cases above cover gaps and runs, escapes of 1, 2 and 4 bytes, every
    dtype, both entries and tensors split into several items."""
    seen: set[Any] = set()
    for seed in range(60):
        data, *_ = _case(seed)
        header = read_payload(data).header
        names = [i.name for i in header.items]
        seen.add(("split",) if len(names) != len(set(names)) else ("whole",))
        for i in header.items:
            seen |= {("loc", i.loc, i.loc_width), ("dtype", i.dtype), ("entry", i.entry)}
    for width in (0, 1, 2, 4):
        assert ("loc", "gaps", width) in seen
    assert any(s[:2] == ("loc", "runs") for s in seen)
    assert {("dtype", d) for d in DTYPE_NAMES} <= seen
    assert {("entry", "xor"), ("entry", "overwrite"), ("split",)} <= seen


def test_many_items_of_one_tensor_concatenate_in_order() -> None:
    """A tensor whose records come in several items (several payloads or owners): the
    device path expands each and the positions ascend across them."""
    rng = np.random.default_rng(7)
    n = 50_000
    b = _random_bits(rng, n, "BF16")
    t = b.copy()
    t[_changed(rng, n, "sparse")] ^= 0x0101
    pb = PayloadBuilder(base_version=1, target_version=2, attempt="a-x", owner=0, seq=0,
                        mode="mixed")
    for lo in range(0, n, 10_000):
        d = diff_range(name="w", dtype=dtype("BF16"), shape=(n,), start=lo,
                       base=b[lo : lo + 10_000], target=t[lo : lo + 10_000], entry="xor")
        assert d is not None
        pb.add(encode_item(d), dense_bytes=20_000)
    items = decode(read_payload(pb.seal()))
    positions, values = expand.on_host(items).expand()
    want = np.concatenate([_c_positions(i) for i in items])
    assert np.array_equal(positions.numpy(), want)
    assert np.array_equal(values.numpy().view(np.uint16), (b ^ t)[want])


# --- the applier's device path on the vLLM-layout reference runtime ----------------------

DENSE = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=True,
                        fp8_modules=("self_attn.o_proj",))
MOE = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=4, tie_word_embeddings=False, num_experts=4,
                      moe_intermediate_size=16)


def _export(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.to(torch.bfloat16) for n, p in params.items()}


def _source(sd: dict[str, torch.Tensor]) -> ArrayCheckpoint:
    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                .view(np.uint16)) for n, t in sd.items()})


def _steps(cfg: ReferenceConfig, steps: int) -> Iterator[dict[str, torch.Tensor]]:
    """BF16 exports of fp32 weights that take AdamW steps at an RL-like rate."""
    params = {n: torch.nn.Parameter(t.float()) for n, t in random_checkpoint(cfg, 3).items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    yield _export({n: p.detach() for n, p in params.items()})
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        yield _export({n: p.detach() for n, p in params.items()})


def _ints(model: torch.nn.Module) -> dict[str, bytes]:
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes()
            for n, t in dense_state(model).items()}


@pytest.mark.parametrize(("cfg", "ep"), [(DENSE, False), (MOE, False), (MOE, True)],
                         ids=["dense-fp8-tied", "moe", "moe-ep"])
@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
def test_device_path_refits_to_dense_bits_at_tp2(cfg: ReferenceConfig, ep: bool,
                                                 mode: str) -> None:
    exports = _steps(cfg, 3)
    old = next(exports)
    canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                 for n, t in old.items()]
    ranks: dict[str, list[tuple[ReferenceModel, Applier]]] = {
        "host": [], "device": [], "packed": []}
    for where, rows in ranks.items():
        for r in range(2):
            model = ReferenceModel(cfg, tp_size=2, tp_rank=r, ep=ep)
            model.load_weights(old.items())
            rows.append((model, Applier(VllmRuntime(model), expand="host" if where == "host"
                                        else "device", pack=where == "packed")))
    profiles = [e.prewarm(canonical) for rows in ranks.values() for _, e in rows]
    profile = merge(profiles)
    store = MemoryStore()
    for version, new in enumerate(exports, start=1):
        m = diff_checkpoints(_source(old), _source(new), store, EncodeSettings(
            target_version=version, base_version=version - 1, mode=mode, profile=profile))  # type: ignore[arg-type]
        payloads = [store.get(e.key) for e in m.payloads]
        expect = {t.name: t.target for t in m.tensors} | m.region_sums()
        assert len(m.region_sums()) == sum(len(r) for r in profile.regions.values()) > 0
        for r in range(2):
            dense = ReferenceModel(cfg, tp_size=2, tp_rank=r, ep=ep)
            dense.load_weights(new.items())
            want = _ints(dense)
            reports = {}
            for where, rows in ranks.items():
                model, engine = rows[r]
                reports[where] = engine.apply_payloads(payloads)
                got = _ints(model)
                assert [n for n in want if got[n] != want[n]] == [], (where, r, version)
                assert engine.check_targets(expect) == {}, (where, r, version)
                assert engine.regions  # every rank holds some tensor in part, and checks it
            for where in ("device", "packed"):
                assert reports[where].records == reports["host"].records
                assert reports[where].names == reports["host"].names
            assert reports["packed"].upload_bytes > 0 == reports["device"].upload_bytes
            # no 64-bit positions travel: less than 8 bytes a record, values included
            assert reports["packed"].upload_bytes < 8 * reports["packed"].records
        old = new


def test_the_device_check_names_a_tensor_with_one_flipped_bit() -> None:
    """check_targets on the device path hashes where the weights live (xxh3.py): one bit
    flipped in one expert's storage on one rank is named, with what the rank holds."""
    state = random_checkpoint(MOE, 2)
    model = ReferenceModel(MOE, tp_size=2, tp_rank=1, ep=True)
    model.load_weights(state.items())
    engine = Applier(VllmRuntime(model), expand="device")
    engine.prewarm([CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                    for n, t in state.items()])
    expect = {n: _source(state).fingerprint(n) for n in state}
    assert engine.check_targets(expect) == {}
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # expert 3 lives on rank 1
    assert name in engine.readable
    w2 = dict(model.named_parameters())["model.layers.1.mlp.experts.w2_weight"]
    with torch.no_grad():
        w2.view(torch.int16)[-1, 0, 0] ^= 1 << 3  # the last local expert: number 3
    differ = engine.check_targets(expect)
    assert list(differ) == [name]
    assert differ[name].startswith("xxh3-128:")
    assert differ[name] != expect[name]


def test_a_payload_that_fails_validation_never_reaches_the_upload(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing reaches the device before every record is validated: a payload whose last
    gap reaches past its item is refused by decode, and upload is never called."""
    model = ReferenceModel(DENSE)
    state = random_checkpoint(DENSE, 1)
    model.load_weights(state.items())
    engine = Applier(VllmRuntime(model), expand="device")
    engine.prewarm([CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                    for n, t in state.items()])
    name = "model.layers.0.mlp.down_proj.weight"
    shape = tuple(state[name].shape)
    n = int(np.prod(shape))

    def payload(last_gap: int) -> bytes:
        """Two XOR records at 5 and 6 + last_gap, the second gap escaped (2 bytes)."""
        esc = last_gap - 255
        item = ItemHeader(name=name, dtype="BF16", shape=shape, start=0, stop=n, entry="xor",
                          loc="gaps", count=2, runs=0, escapes=1, loc_width=2, len_width=0)
        streams = {"loc.0": bytes([5, 255]), "esc.0": bytes([esc & 0xFF]),
                   "esc.1": bytes([esc >> 8]), "val.xor.BF16.0": b"\x01\x01",
                   "val.xor.BF16.1": b"\x00\x00"}
        return pack_payload(base_version=0, target_version=1, attempt="a-bad", owner=0,
                            seq=last_gap, mode="mixed", items=(item,), streams=streams)

    calls: list[object] = []
    real = engine._uploader.upload
    monkeypatch.setattr(engine._uploader, "upload", lambda g: calls.append(g) or real(g))
    before = _ints(model)
    with pytest.raises(MalformedPayload, match=f"reach element {n}, past the item"):
        engine.apply_payloads([payload(n - 6)])  # the second record would be element n
    assert calls == []
    assert _ints(model) == before
    engine.apply_payloads([payload(n - 7)])  # the last element: applies
    assert len(calls) == 1
    base = state[name].view(torch.int16).numpy().view(np.uint16).reshape(-1)
    got = dense_state(model)[name].view(torch.int16).numpy().view(np.uint16).reshape(-1)
    want = base.copy()
    want[[5, n - 1]] ^= 1
    assert np.array_equal(got, want)


@pytest.mark.parametrize("expand_on", ["host", "device"])
def test_a_rank_holding_half_an_expert_checks_its_region_and_names_a_flipped_bit(
        expand_on: str) -> None:
    """Without expert parallelism each TP rank holds half of every expert: no whole
    fingerprint is in its reach, so it checks the region its profile names against the
    owner's sum of the target there, on either expansion path, and one flipped bit in one
    expert's shard is named with the sum it holds."""
    state = random_checkpoint(MOE, 2)
    model = ReferenceModel(MOE, tp_size=2, tp_rank=1)
    model.load_weights(state.items())
    engine = Applier(VllmRuntime(model), expand=expand_on)  # type: ignore[arg-type]
    profile = engine.prewarm([CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                              for n, t in state.items()])
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert name not in engine.readable
    assert name in profile.regions
    source = _source(state)
    expect = {region_key(r.tensor, r.spans): r.sum
              for info in source if info.name in profile.regions
              for r in target_sums(source, info, profile.regions[info.name])}
    assert engine.check_targets(expect) == {}
    w2 = dict(model.named_parameters())["model.layers.1.mlp.experts.w2_weight"]
    with torch.no_grad():
        w2.view(torch.int16)[3, 5, 1] ^= 1 << 3
    differ = engine.check_targets(expect)
    (key,) = differ
    assert key.startswith(f"{name}@")
    assert differ[key].startswith("sum64:")
    assert differ[key] != expect[key]
