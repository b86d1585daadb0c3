"""End-to-end refits through the real ``dcr`` command line, run as subprocesses.

A base checkpoint holds tensors of every dtype DCR moves (BF16, F16, F32, F64, F8_E4M3,
F8_E5M2, I8, I16, I32, I64, U8, BOOL), with random bits (so floats include NaNs of many
payloads and infinities), 0-d and empty tensors. The target changes 1-5% of most
tensors, every element of one, clustered runs of another, nothing in one, and plants
bit-only changes: NaN payloads, -0.0 <-> +0.0, finite -> Inf. Through ``python -m dcr``:

* ``diff --json`` then ``patch`` on a copy of the base gives the target bit for bit, for
  a single file and a sharded directory, in mixed and overwrite mode, with
  ``--bucket-mib 1`` so several payloads are written; the JSON summary matches the truth
  and the store;
* ``patch`` refuses a checkpoint at neither base nor target, a corrupted, truncated or
  missing payload, and a manifest of another version, with exit 1, a ``dcr: error:``
  message naming the culprit, and every checkpoint file byte-identical;
* a re-run is a no-op, and a run after a simulated crash (some shards already at the
  target, a stale temporary file) completes; a link planted at a temporary name is never
  written through, and a copy that fails (the disk full) leaves no temporary file;
* ``inspect`` (JSON and table) reports the true changed counts;
* ``diff`` of checkpoints with different tensors, shapes or dtypes fails naming the
  tensor; ``--help`` works; usage errors exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr.errors import LimitExceeded, TargetMismatch
from dcr.format.manifest import open_document, seal_document

ITEMSIZE = {
    "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
    "I8": 1, "I16": 2, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1,
}

# (name, dtype, shape, change): a float fraction scatters changes over that share of
# the elements; "all", "none", "runs" and "scalar" are described in _make_target.
SPEC: list[tuple[str, str, tuple[int, ...], float | str]] = [
    ("buffers.bool_mask", "BOOL", (4096,), 0.03),
    ("buffers.i16", "I16", (4096,), 0.02),
    ("buffers.i32", "I32", (8192,), 0.05),
    ("buffers.i64", "I64", (8192,), 0.01),
    ("buffers.i8", "I8", (4096,), 0.04),
    ("buffers.u8", "U8", (4096,), 0.03),
    ("empty.bias", "F32", (0, 16), "none"),
    ("lm_head.weight", "F16", (128, 256), "all"),
    ("model.embed_tokens.weight", "BF16", (1024, 512), 0.02),
    ("model.layers.0.input_layernorm.weight", "BF16", (512,), "none"),
    ("model.layers.0.mlp.down_proj.weight", "F32", (256, 1024), 0.03),
    ("model.layers.0.mlp.fp8_e4m3.weight", "F8_E4M3", (256, 256), 0.04),
    ("model.layers.0.mlp.fp8_e5m2.weight", "F8_E5M2", (256, 256), 0.04),
    ("model.layers.0.mlp.up_proj.weight", "F16", (512, 512), "runs"),
    ("model.layers.0.self_attn.q_proj.weight", "F64", (128, 256), 0.01),
    ("model.norm.zero", "F32", (), "scalar"),
    ("step", "I64", (), "scalar"),
]

# Three shards, each with at least one changed tensor.
SHARDS = [
    ["buffers.bool_mask", "buffers.i16", "buffers.i32", "buffers.i64", "buffers.i8",
     "buffers.u8", "empty.bias", "lm_head.weight", "step"],
    ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
     "model.layers.0.mlp.down_proj.weight"],
    ["model.layers.0.mlp.fp8_e4m3.weight", "model.layers.0.mlp.fp8_e5m2.weight",
     "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight",
     "model.norm.zero"],
]

# (base bits -> target bits) that only a bit-level compare sees or that hit special
# values: NaN payload changes, -0.0 <-> +0.0, finite -> Inf, Inf -> -Inf. The last pair
# of each list is an unchanged NaN, which a float compare would wrongly count.
PLANTED: dict[str, list[tuple[int, int]]] = {
    "F64": [(0x7FF8000000000001, 0x7FF8000000000002), (1 << 63, 0), (0x3FF0 << 48, 0x7FF0 << 48),
            (0x7FF8000000000005, 0x7FF8000000000005)],
    "F32": [(0x7FC00001, 0x7FC00002), (0x80000000, 0), (0, 0x80000000),
            (0x3F800000, 0x7F800000), (0x7F800000, 0xFF800000), (0x7FC00009, 0x7FC00009)],
    "F16": [(0x7E01, 0x7E02), (0x8000, 0), (0x3C00, 0x7C00), (0x7E07, 0x7E07)],
    "BF16": [(0x7FC1, 0x7FC2), (0x8000, 0), (0x3F80, 0x7F80), (0x7FC3, 0x7FC3)],
    "F8_E4M3": [(0x7F, 0xFF), (0x80, 0), (0x38, 0x7E), (0x7F, 0x7F)],
    "F8_E5M2": [(0x7D, 0x7E), (0x80, 0), (0x3C, 0x7C), (0x7F, 0x7F)],
}

MODES = {"mixed": ("--version", "2"), "overwrite": ("--version", "9", "--base-version", "7")}
VERSION = {"mixed": 2, "overwrite": 9}
BASE_VERSION = {"mixed": 1, "overwrite": 7}
REQUIRED_KEYS = {"tensors", "changed_elements", "total_elements", "dense_bytes",
                 "payload_bytes", "seconds"}


# --- building the scenario -------------------------------------------------------------


def _random_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    if dtype == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8)
    u = np.dtype(f"<u{ITEMSIZE[dtype]}")
    return rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)


def _masks(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Nonzero XOR masks: mostly low-bit flips (like small updates), some arbitrary."""
    u = np.dtype(f"<u{ITEMSIZE[dtype]}")
    if dtype == "BOOL":
        return np.ones(n, dtype=u)
    low = rng.integers(1, 256, n).astype(u)
    wide = rng.integers(1, np.iinfo(u).max, n, dtype=u, endpoint=True)
    return np.where(rng.random(n) < 0.7, low, wide).astype(u)


def _make_target(
    rng: np.random.Generator, dtype: str, base: np.ndarray, change: float | str
) -> tuple[np.ndarray, np.ndarray]:
    """Return (base, target) bits; ``base`` may get planted special values."""
    base = base.copy()
    target = base.copy()
    n = base.size
    if change == "none":
        return base, target
    if change == "all":
        return base, base ^ _masks(rng, dtype, n)
    if change == "scalar":
        if dtype == "F32":  # -0.0 -> +0.0: equal as floats, different bits
            base[0], target[0] = 0x80000000, 0
        else:  # a step counter
            base[0], target[0] = 41, 42
        return base, target
    if change == "runs":  # clustered: runs of 8-600 consecutive changed elements
        starts = np.sort(rng.choice(n // 1024, 14, replace=False)) * 1024
        for s in starts:
            length = int(rng.integers(8, 600))
            target[s : s + length] ^= _masks(rng, dtype, length)
        return base, target
    assert isinstance(change, float)
    pos = rng.choice(n, int(n * change), replace=False)
    target[pos] ^= _masks(rng, dtype, len(pos))
    for i, (b, t) in enumerate(PLANTED.get(dtype, [])):
        base[n - 1 - i], target[n - 1 - i] = b, t
    return base, target


@dataclass(frozen=True)
class Scenario:
    base: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    base_bits: dict[str, np.ndarray]
    target_bits: dict[str, np.ndarray]
    changed: dict[str, int]  # true count of elements whose bits differ


@pytest.fixture(scope="module")
def scenario(module_builders) -> Scenario:
    rng = np.random.default_rng(20240611)
    from_bits = module_builders["tensor_from_bits"]
    base, target, base_bits, target_bits, changed = {}, {}, {}, {}, {}
    for name, dtype, shape, change in SPEC:
        numel = int(np.prod(shape)) if shape else 1
        b, t = _make_target(rng, dtype, _random_bits(rng, dtype, numel), change)
        base[name], target[name] = from_bits(dtype, b, shape), from_bits(dtype, t, shape)
        base_bits[name], target_bits[name] = b, t
        changed[name] = int(np.count_nonzero(b != t))
    # The scenario is what the docstring promises.
    frac = {n: changed[n] / max(1, base_bits[n].size) for n in changed}
    assert frac["lm_head.weight"] == 1.0
    assert changed["model.layers.0.input_layernorm.weight"] == 0
    scattered = [name for name, _, _, change in SPEC if isinstance(change, float)]
    assert all(0.005 < frac[n] <= 0.06 for n in scattered), frac
    assert 0.005 < frac["model.layers.0.mlp.up_proj.weight"] <= 0.06
    assert {d for _, d, _, _ in SPEC} == set(ITEMSIZE)
    return Scenario(base, target, base_bits, target_bits, changed)


# --- running the CLI -------------------------------------------------------------------


def dcr(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dcr", *map(str, args)],
        capture_output=True, text=True, timeout=120, cwd=cwd, check=False,
    )


def dcr_json(*args: object) -> dict:
    r = dcr(*args, "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    return json.loads(lines[0])


def read_manifest(path: Path) -> dict:
    """A stored manifest's JSON document, as a dict to tamper with."""
    return json.loads(open_document(path.read_bytes(), str(path)))


def write_manifest(path: Path, doc: dict) -> None:
    """Seal a tampered document in a valid container, so that the check a test is about
    is the one that refuses it."""
    path.write_bytes(seal_document(json.dumps(doc).encode()))


def assert_refused(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("dcr: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


@dataclass(frozen=True)
class Refit:
    layout: str
    mode: str
    base: Path
    target: Path
    store: Path
    summary: dict
    version: int
    base_version: int

    def copy_base(self, dest: Path) -> Path:
        """A writable copy of the base checkpoint at ``dest`` (the path to patch)."""
        if self.base.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.base, dest / self.base.name)
            return dest / self.base.name
        shutil.copytree(self.base, dest)
        return dest

    def copy_store(self, dest: Path) -> Path:
        shutil.copytree(self.store, dest)
        return dest


def _write(root: Path, tensors: dict[str, torch.Tensor], layout: str, builders) -> Path:
    if layout == "file":
        return builders["write_checkpoint"](root / "model.safetensors", tensors, "file")
    return builders["write_checkpoint"](root, tensors, "sharded", shards=SHARDS)


@pytest.fixture(scope="module")
def refits(tmp_path_factory, scenario, module_builders):
    """``refits(layout, mode)``: base and target written, diffed once, cached."""
    cache: dict[tuple[str, str], Refit] = {}

    def get(layout: str, mode: str) -> Refit:
        if (layout, mode) not in cache:
            root = tmp_path_factory.mktemp(f"refit-{layout}-{mode}")
            base = _write(root / "base", scenario.base, layout, module_builders)
            target = _write(root / "target", scenario.target, layout, module_builders)
            store = root / "store"
            summary = dcr_json(
                "diff", base, target, "--store", store.as_uri(), *MODES[mode],
                "--mode", mode, "--bucket-mib", "1",
            )
            cache[layout, mode] = Refit(
                layout=layout, mode=mode, base=base, target=target, store=store,
                summary=summary, version=VERSION[mode], base_version=BASE_VERSION[mode],
            )
        return cache[layout, mode]

    return get


@pytest.fixture(
    scope="module",
    params=[("file", "mixed"), ("file", "overwrite"), ("sharded", "mixed"),
            ("sharded", "overwrite")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def refit(request, refits) -> Refit:
    return refits(*request.param)


@pytest.fixture
def sharded_refit(refits) -> Refit:
    return refits("sharded", "mixed")


def _shard_of(ckpt: Path, tensor: str) -> Path:
    if ckpt.is_file():
        return ckpt
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return ckpt / index["weight_map"][tensor]


def _flip_bit(file: Path, tensor: str, element: int, bit: int = 0) -> None:
    """Flip one stored bit of one element, locating it from the raw safetensors header."""
    raw = bytearray(file.read_bytes())
    (hlen,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8 : 8 + hlen])[tensor]
    size = ITEMSIZE[entry["dtype"]]
    raw[8 + hlen + entry["data_offsets"][0] + element * size + bit // 8] ^= 1 << (bit % 8)
    file.write_bytes(bytes(raw))


def _assert_bits_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _payload_objects(store: Path) -> list[Path]:
    return sorted(store.rglob("*.dcrp"))


# --- diff and patch --------------------------------------------------------------------


def test_patch_brings_a_base_copy_to_the_target_bit_for_bit(
    tmp_path, refit, scenario, read_bits, file_hashes
):
    ckpt = refit.copy_base(tmp_path / "ckpt")
    _assert_bits_equal(read_bits(ckpt), scenario.base_bits)
    result = dcr_json("patch", ckpt, "--store", refit.store.as_uri(), "--version", refit.version)
    _assert_bits_equal(read_bits(ckpt), scenario.target_bits)
    nfiles = 1 if refit.layout == "file" else len(SHARDS)
    assert result["files_patched"] == nfiles
    assert result["files_already_at_target"] == 0
    assert result["records_applied"] == sum(scenario.changed.values())
    assert (result["version"], result["base_version"]) == (refit.version, refit.base_version)
    # Same header layout on both sides, so every file now equals the target's byte for
    # byte, and no temporary file is left behind.
    assert file_hashes(ckpt) == file_hashes(refit.target)


def test_diff_json_summary_matches_the_truth_and_the_store(refit, scenario):
    s = refit.summary
    assert set(s) >= REQUIRED_KEYS
    assert s["tensors"] == len(SPEC)
    assert s["changed_elements"] == sum(scenario.changed.values())
    assert s["total_elements"] == sum(b.size for b in scenario.base_bits.values())
    assert s["total_elements"] == sum(t.numel() for t in scenario.base.values())
    assert s["dense_bytes"] == sum(t.numel() * t.element_size() for t in scenario.base.values())
    objects = _payload_objects(refit.store)
    assert s["payload_bytes"] == sum(p.stat().st_size for p in objects)
    assert s["payload_bytes"] < s["dense_bytes"] / 5
    assert isinstance(s["seconds"], float | int)
    assert s["seconds"] >= 0
    # --bucket-mib 1 on a ~3 MiB checkpoint: several payloads, all in the store.
    assert s["payloads"] == len(objects) >= 3
    assert (s["version"], s["base_version"], s["mode"]) == (
        refit.version, refit.base_version, refit.mode,
    )
    assert s["store"] == refit.store.as_uri()
    manifest = refit.store / f"v{refit.version:010d}" / "manifest.dcrm"
    assert read_manifest(manifest)["stats"] == {k: s[k] for k in
                                                          ("tensors", "changed_elements",
                                                           "total_elements", "dense_bytes",
                                                           "payload_bytes")}


def test_patch_rerun_after_success_is_a_no_op(tmp_path, refit, scenario, read_bits, file_hashes):
    ckpt = refit.copy_base(tmp_path / "ckpt")
    args = ("patch", ckpt, "--store", refit.store.as_uri(), "--version", refit.version)
    dcr_json(*args)
    after_first = file_hashes(ckpt)
    inodes = {p: p.stat().st_ino for p in (ckpt.parent if ckpt.is_file() else ckpt).iterdir()}
    again = dcr_json(*args)
    nfiles = 1 if refit.layout == "file" else len(SHARDS)
    assert again["files_patched"] == 0
    assert again["files_already_at_target"] == nfiles
    assert again["records_applied"] == 0
    assert file_hashes(ckpt) == after_first
    assert inodes == {p: p.stat().st_ino for p in inodes}, "a no-op must not replace files"
    _assert_bits_equal(read_bits(ckpt), scenario.target_bits)


def test_patch_applies_to_a_differently_laid_out_copy_of_the_base(
    tmp_path, refits, scenario, module_builders, read_bits
):
    """Deltas address tensors by name: a diff of single files patches a sharded copy."""
    r = refits("file", "mixed")
    ckpt = module_builders["write_checkpoint"](
        tmp_path / "resharded", scenario.base, "sharded", shards=2
    )
    result = dcr_json("patch", ckpt, "--store", r.store.as_uri(), "--version", r.version)
    assert result["files_patched"] == 2
    _assert_bits_equal(read_bits(ckpt), scenario.target_bits)


def test_plain_diff_and_patch_print_one_line_summaries(tmp_path, refits):
    r = refits("file", "mixed")
    store = tmp_path / "store"
    d = dcr("diff", r.base, r.target, "--store", store, "--version", 5, "--base-version", 1)
    assert d.returncode == 0, d.stderr
    assert "version 1 -> 5" in d.stdout
    assert f"{r.summary['changed_elements']:,} of {r.summary['total_elements']:,}" in d.stdout
    ckpt = r.copy_base(tmp_path / "ckpt")
    p = dcr("patch", ckpt, "--store", store, "--version", 5)
    assert p.returncode == 0, p.stderr
    assert "version 1 -> 5" in p.stdout
    assert "1 files (0 already at target); verified" in p.stdout


# --- refusals leave the checkpoint untouched -------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"],
    ids=["changed-tensor", "unchanged-tensor"],
)
@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_patch_refuses_a_checkpoint_at_neither_base_nor_target(
    tmp_path, refits, layout, tensor, file_hashes
):
    r = refits(layout, "mixed")
    ckpt = r.copy_base(tmp_path / "ckpt")
    victim = _shard_of(ckpt, tensor)
    _flip_bit(victim, tensor, element=5, bit=3)
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", r.store.as_uri(), "--version", r.version)
    assert_refused(result, repr(tensor), victim.name, "not at base version")
    assert file_hashes(ckpt) == before


def test_patch_refuses_a_file_mixing_base_and_target_tensors(tmp_path, refits, file_hashes):
    """A shard with one tensor already at the target and another still at the base."""
    r = refits("sharded", "mixed")
    ckpt = r.copy_base(tmp_path / "ckpt")
    tensor = "model.embed_tokens.weight"
    shard = _shard_of(ckpt, tensor)
    raw_target = _shard_of(r.target, tensor).read_bytes()
    (hlen,) = struct.unpack("<Q", raw_target[:8])
    lo, hi = json.loads(raw_target[8 : 8 + hlen])[tensor]["data_offsets"]
    raw = bytearray(shard.read_bytes())
    raw[8 + hlen + lo : 8 + hlen + hi] = raw_target[8 + hlen + lo : 8 + hlen + hi]
    shard.write_bytes(bytes(raw))
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", r.store.as_uri(), "--version", r.version)
    assert_refused(result, shard.name, repr(tensor), "target-version bits")
    assert file_hashes(ckpt) == before


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_patch_refuses_a_corrupted_payload(tmp_path, refits, where, file_hashes):
    r = refits("sharded", "mixed")
    store = r.copy_store(tmp_path / "store")
    victim = _payload_objects(store)[1]
    raw = bytearray(victim.read_bytes())
    raw[{"first": 0, "middle": len(raw) // 2, "last": len(raw) - 1}[where]] ^= 0x10
    victim.write_bytes(bytes(raw))
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", store.as_uri(), "--version", r.version)
    assert_refused(result, "digest mismatch", victim.name)
    assert file_hashes(ckpt) == before


def test_patch_refuses_a_corrupted_payload_even_when_the_manifest_agrees(
    tmp_path, refits, file_hashes
):
    """The payload's own BLAKE2b digest catches a flip the manifest was re-sealed over."""
    r = refits("sharded", "mixed")
    store = r.copy_store(tmp_path / "store")
    victim = _payload_objects(store)[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x01
    victim.write_bytes(bytes(raw))
    manifest_path = store / f"v{r.version:010d}" / "manifest.dcrm"
    manifest = read_manifest(manifest_path)
    entry = next(p for p in manifest["payloads"] if p["key"].endswith(victim.name))
    entry["digest"] = hashlib.blake2b(bytes(raw), digest_size=16).hexdigest()
    write_manifest(manifest_path, manifest)
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", store.as_uri(), "--version", r.version)
    assert_refused(result, "digest mismatch")
    assert file_hashes(ckpt) == before


def test_patch_refuses_a_payload_of_another_attempt(tmp_path, refits, file_hashes):
    """A manifest entry pointing at a valid payload of an earlier attempt is rejected."""
    r = refits("file", "mixed")
    store = r.copy_store(tmp_path / "store")
    key = f"v{r.version:010d}/manifest.dcrm"
    first = read_manifest(store / key)
    retry = dcr_json("diff", r.base, r.target, "--store", store.as_uri(), "--version", r.version,
                     "--bucket-mib", 1, "--replace")
    assert retry["attempt"] != first["attempt"]
    second = read_manifest(store / key)
    assert second["attempt"] == retry["attempt"]
    second["payloads"][0] = first["payloads"][0]  # same owner and seq, other attempt
    write_manifest(store / key, second)
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", store.as_uri(), "--version", r.version)
    assert_refused(result, first["payloads"][0]["key"], "the manifest expects")
    assert file_hashes(ckpt) == before


@pytest.mark.parametrize(("n", "error", "needle"), [
    (1 << 27, LimitExceeded, "over the limits (524288 elements"),  # the largest tensor's
    (500_000, TargetMismatch, "does not match the manifest's tensors"),
])
def test_patch_refuses_a_decompression_bomb_before_decompressing_it(
        tmp_path, refits, file_hashes, n, error, needle):
    """The 2**27 case fails on 5b0b0ae: every payload was decoded before its items were
    compared with the manifest's tensors, so a few KiB that the manifest vouches for (store
    write access is all it takes) decompressed to 256 MiB first (1.4 GiB peak). Now it is
    read under limits derived from the manifest's tensors; an item within them that names
    no tensor is refused before its streams are decoded. Peak traced memory stays under
    64 MiB."""
    from dcr.files.patch import patch_checkpoint
    from dcr.format.payload import ItemHeader, pack_payload
    from dcr.transport.store import open_store

    r = refits("file", "mixed")
    store = r.copy_store(tmp_path / "store")
    key = f"v{r.version:010d}/manifest.dcrm"
    manifest = read_manifest(store / key)
    entry = manifest["payloads"][0]
    item = ItemHeader(name="model.layers.7.mlp.absent.weight", dtype="U8", shape=(n,),
                      start=0, stop=n, entry="overwrite", loc="gaps", count=n, runs=0,
                      escapes=0, loc_width=0, len_width=0)
    zeros = bytes(n)
    bomb = pack_payload(base_version=manifest["base_version"],
                        target_version=manifest["target_version"],
                        attempt=manifest["attempt"], owner=entry["owner"], seq=entry["seq"],
                        mode=manifest["mode"], items=(item,),
                        streams={"loc.0": zeros, "val.overwrite.U8.0": zeros})
    del zeros
    assert len(bomb) < 64 << 10
    (store / entry["key"]).write_bytes(bomb)
    entry["size"] = len(bomb)
    entry["digest"] = hashlib.blake2b(bomb, digest_size=16).hexdigest()
    write_manifest(store / key, manifest)
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = file_hashes(ckpt)
    tracemalloc.start()
    try:
        with pytest.raises(error, match=r"absent\.weight") as e:
            patch_checkpoint(ckpt, open_store(store.as_uri()), r.version)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert needle in str(e.value)
    assert peak < 64 << 20, f"peak {peak >> 20} MiB"
    assert file_hashes(ckpt) == before


def test_patch_refuses_a_truncated_payload(tmp_path, refits, file_hashes):
    r = refits("file", "mixed")
    store = r.copy_store(tmp_path / "store")
    victim = _payload_objects(store)[-1]
    victim.write_bytes(victim.read_bytes()[:-7])
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", store.as_uri(), "--version", r.version)
    assert_refused(result, victim.name, "bytes")
    assert file_hashes(ckpt) == before


def test_patch_refuses_when_a_payload_object_is_missing(tmp_path, refits, file_hashes):
    r = refits("sharded", "mixed")
    store = r.copy_store(tmp_path / "store")
    victim = _payload_objects(store)[-1]
    victim.unlink()
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", store.as_uri(), "--version", r.version)
    assert_refused(result, victim.name)
    assert file_hashes(ckpt) == before


@pytest.mark.parametrize(("damage", "needle"), [
    ("truncated", "is truncated or padded"),
    ("flipped", "digest mismatch (expected "),
    ("bomb", "declares 268435457 bytes of JSON, over the limit of"),
    ("json", "(a version 1 manifest, plain JSON)"),
])
def test_patch_refuses_a_hostile_manifest_and_writes_nothing(tmp_path, refits, file_hashes,
                                                             damage, needle):
    """Every payload intact, the manifest that vouches for them truncated, corrupted,
    declaring a decompression bomb, or in version 1's encoding: refused naming the value,
    before any file is touched."""
    r = refits("file", "mixed")
    store = r.copy_store(tmp_path / "store")
    path = store / f"v{r.version:010d}" / "manifest.dcrm"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        del data[-3:]
    elif damage == "flipped":
        data[50] ^= 0x10
    elif damage == "bomb":  # the declared JSON size over the limit, the digest made good
        data[16:20] = ((256 << 20) + 1).to_bytes(4, "little")
        data[24:40] = hashlib.blake2b(bytes(data[:24] + data[40:]), digest_size=16,
                                      person=b"dcr-manifest-v2").digest()
    else:
        data = bytearray(json.dumps(read_manifest(path), indent=1).encode())
    path.write_bytes(bytes(data))
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", store.as_uri(), "--version", r.version)
    assert_refused(result, needle, "manifest.dcrm")
    assert file_hashes(ckpt) == before


def test_patch_and_inspect_reject_a_manifest_of_another_version(tmp_path, refits, file_hashes):
    r = refits("file", "mixed")
    store = r.copy_store(tmp_path / "store")
    (store / "v0000000003").mkdir()
    shutil.copy(store / "v0000000002" / "manifest.dcrm", store / "v0000000003" / "manifest.dcrm")
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", store.as_uri(), "--version", 3)
    assert_refused(result, "version 2, not 3")
    assert file_hashes(ckpt) == before
    assert_refused(dcr("inspect", "--store", store.as_uri(), "--version", 3), "version 2, not 3")
    # And a version with no manifest at all.
    assert_refused(dcr("patch", ckpt, "--store", store.as_uri(), "--version", 4),
                   "v0000000004/manifest.dcrm")
    assert file_hashes(ckpt) == before


def test_patch_refuses_a_checkpoint_with_other_tensors(tmp_path, refits, scenario,
                                                        module_builders, file_hashes):
    r = refits("file", "mixed")
    tensors = dict(scenario.base)
    del tensors["buffers.i16"]
    ckpt = module_builders["write_checkpoint"](tmp_path / "c.safetensors", tensors, "file")
    before = file_hashes(ckpt)
    result = dcr("patch", ckpt, "--store", r.store.as_uri(), "--version", r.version)
    assert_refused(result, "buffers.i16")
    assert file_hashes(ckpt) == before


def test_patch_replaces_each_file_wholly_or_not_at_all(tmp_path, refits, read_bits, scenario):
    """A manifest whose target fingerprint is wrong for one tensor: that shard stays old."""
    r = refits("sharded", "mixed")
    store = r.copy_store(tmp_path / "store")
    manifest_path = store / f"v{r.version:010d}" / "manifest.dcrm"
    manifest = read_manifest(manifest_path)
    tensor = "model.layers.0.self_attn.q_proj.weight"
    entry = next(t for t in manifest["tensors"] if t["name"] == tensor)
    entry["target"] = "xxh3-128:" + "0" * 32
    write_manifest(manifest_path, manifest)
    ckpt = r.copy_base(tmp_path / "ckpt")
    victim = _shard_of(ckpt, tensor)
    before = victim.read_bytes()
    result = dcr("patch", ckpt, "--store", store.as_uri(), "--version", r.version)
    assert_refused(result, repr(tensor), "target fingerprints")
    assert victim.read_bytes() == before
    assert not list(ckpt.glob(".*dcr-patch"))
    got = read_bits(ckpt)
    for group in SHARDS:
        states = {
            "base" if np.array_equal(got[n], scenario.base_bits[n]) else
            "target" if np.array_equal(got[n], scenario.target_bits[n]) else "other"
            for n in group if scenario.changed[n]
        }
        assert states in ({"base"}, {"target"}), (group, states)


# --- crash recovery --------------------------------------------------------------------


def test_patch_resumes_after_a_crash_left_some_shards_patched(
    tmp_path, sharded_refit, scenario, read_bits
):
    r = sharded_refit
    ckpt = r.copy_base(tmp_path / "ckpt")
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert len(shards) == 3
    # The crash: shards 1 and 3 were renamed into place; shard 2's temporary file was
    # half written.
    for name in (shards[0], shards[2]):
        shutil.copyfile(r.target / name, ckpt / name)
    stale = ckpt / f".{shards[1]}.dcr-patch"
    stale.write_bytes((r.target / shards[1]).read_bytes()[:1000])
    result = dcr_json("patch", ckpt, "--store", r.store.as_uri(), "--version", r.version)
    assert result["files_patched"] == 1
    assert result["files_already_at_target"] == 2
    _assert_bits_equal(read_bits(ckpt), scenario.target_bits)
    assert not list(ckpt.glob(".*dcr-patch")), "temporary files must not be left behind"
    for name in shards:
        assert (ckpt / name).read_bytes() == (r.target / name).read_bytes(), name


def test_patch_never_writes_through_a_link_planted_at_a_temporary_name(
    tmp_path, refits, scenario, read_bits
):
    """Fails on 5b0b0ae: the copy went to the fixed name ``.<file>.dcr-patch``, following a
    link planted there (the checkpoint's bytes landed in the link's target) and then
    renaming the link over the checkpoint file."""
    r = refits("file", "mixed")
    ckpt = r.copy_base(tmp_path / "ckpt")
    victim = tmp_path / "victim"
    victim.write_bytes(b"not the checkpoint's to write")
    (ckpt.parent / f".{ckpt.name}.dcr-patch").symlink_to(victim)
    dcr_json("patch", ckpt, "--store", r.store.as_uri(), "--version", r.version)
    assert victim.read_bytes() == b"not the checkpoint's to write"
    assert stat.S_ISREG(ckpt.lstat().st_mode)
    _assert_bits_equal(read_bits(ckpt), scenario.target_bits)
    assert not list(ckpt.parent.glob(".*dcr-patch"))  # the planted link is gone, unfollowed


def test_patch_removes_the_temporary_file_a_killed_run_left(tmp_path, refits):
    """Fails on 5b0b0ae: only the fixed temporary name was ever cleaned up."""
    r = refits("file", "mixed")
    ckpt = r.copy_base(tmp_path / "ckpt")
    (ckpt.parent / f".{ckpt.name}.q8x2_k1p.dcr-patch").write_bytes(b"half a copy")
    dcr_json("patch", ckpt, "--store", r.store.as_uri(), "--version", r.version)
    assert not list(ckpt.parent.glob(".*dcr-patch"))


def test_patch_that_cannot_write_its_copy_leaves_no_temporary_file(tmp_path, refits):
    """Fails on 5b0b0ae: the copy was made outside the cleanup, so a full disk (here a
    file-size limit) left a partial temporary file beside the checkpoint, and the error
    was a traceback."""
    r = refits("file", "mixed")
    ckpt = r.copy_base(tmp_path / "ckpt")
    before = ckpt.read_bytes()
    limit = len(before) // 2

    def disk_fills_up() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(
        [sys.executable, "-m", "dcr", "patch", str(ckpt), "--store", r.store.as_uri(),
         "--version", str(r.version)],
        capture_output=True, text=True, timeout=120, check=False, preexec_fn=disk_fills_up,
    )
    assert_refused(result, str(ckpt), "cannot make the patched copy")
    assert ckpt.read_bytes() == before
    assert not list(ckpt.parent.glob(".*dcr-patch"))


def test_patch_rerun_is_a_no_op_when_a_shard_has_no_changes(tmp_path, module_builders):
    write = module_builders["write_checkpoint"]
    groups = [["a"], ["frozen"]]
    base = {"a": torch.zeros(64), "frozen": torch.ones(64)}
    target = {"a": torch.arange(64.0), "frozen": torch.ones(64)}
    b = write(tmp_path / "base", base, "sharded", shards=groups)
    t = write(tmp_path / "target", target, "sharded", shards=groups)
    store = (tmp_path / "store").as_uri()
    dcr_json("diff", b, t, "--store", store, "--version", 1, "--base-version", 0)
    dcr_json("patch", b, "--store", store, "--version", 1)
    frozen = b / "model-00002-of-00002.safetensors"
    inode = frozen.stat().st_ino
    again = dcr_json("patch", b, "--store", store, "--version", 1)
    assert (again["files_patched"], again["files_already_at_target"]) == (0, 2)
    assert frozen.stat().st_ino == inode


def test_patch_keeps_the_permission_bits_of_replaced_files(tmp_path, refits):
    r = refits("file", "mixed")
    ckpt = r.copy_base(tmp_path / "ckpt")
    os.chmod(ckpt, 0o600)
    result = subprocess.run(
        [sys.executable, "-m", "dcr", "patch", str(ckpt), "--store", r.store.as_uri(),
         "--version", str(r.version)],
        capture_output=True, text=True, timeout=120, check=False, umask=0o022,
    )
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o600


# --- more refits ----------------------------------------------------------------------


def test_versions_chain_and_an_out_of_order_patch_is_refused(
    tmp_path, module_builders, read_bits, bits_of, file_hashes
):
    write = module_builders["write_checkpoint"]
    v1 = {"w": torch.zeros(256), "b": torch.arange(16, dtype=torch.int32)}
    v2 = {"w": torch.zeros(256).index_fill(0, torch.tensor([3, 200]), 1.0), "b": v1["b"] + 1}
    v3 = {"w": v2["w"].clone().index_fill(0, torch.tensor([7]), -0.0), "b": v2["b"]}
    paths = {v: write(tmp_path / f"v{v}.safetensors", t, "file")
             for v, t in ((1, v1), (2, v2), (3, v3))}
    store = (tmp_path / "store").as_uri()
    d2 = dcr_json("diff", paths[1], paths[2], "--store", store, "--version", 2)
    d3 = dcr_json("diff", paths[2], paths[3], "--store", store, "--version", 3)
    assert (d2["changed_elements"], d3["changed_elements"]) == (2 + 16, 1)
    ckpt = tmp_path / "rollout" / "model.safetensors"
    ckpt.parent.mkdir()
    shutil.copyfile(paths[1], ckpt)
    before = file_hashes(ckpt)
    assert_refused(dcr("patch", ckpt, "--store", store, "--version", 3), "not at base version 2")
    assert file_hashes(ckpt) == before
    dcr_json("patch", ckpt, "--store", store, "--version", 2)
    dcr_json("patch", ckpt, "--store", store, "--version", 3)
    got = read_bits(ckpt)
    for name, t in v3.items():
        np.testing.assert_array_equal(got[name], bits_of(t), err_msg=name)
    # Going back is refused too: the file holds v3 bits, neither v1 nor v2.
    assert_refused(dcr("patch", ckpt, "--store", store, "--version", 2), "'w'")


def test_overwrite_regex_sends_matching_tensors_as_overwrites(
    tmp_path, refits, scenario, read_bits
):
    r = refits("sharded", "mixed")
    store = (tmp_path / "store").as_uri()
    summary = dcr_json("diff", r.base, r.target, "--store", store, "--version", 2,
                       "--overwrite", r"buffers\..*", "--overwrite", "step")
    assert summary["changed_elements"] == sum(scenario.changed.values())
    report = dcr_json("inspect", "--store", store, "--version", 2)
    for row in report["tensor_rows"]:
        if not scenario.changed[row["name"]]:
            continue
        overwrite = row["name"].startswith("buffers.") or row["name"] == "step"
        assert row["encoding"].startswith("overwrite/" if overwrite else "xor/"), row
    ckpt = r.copy_base(tmp_path / "ckpt")
    dcr_json("patch", ckpt, "--store", store, "--version", 2)
    _assert_bits_equal(read_bits(ckpt), scenario.target_bits)
    bad = dcr("diff", r.base, r.target, "--store", store, "--version", 3, "--overwrite", "(")
    assert_refused(bad, "'('")


def test_tensor_larger_than_one_item_is_split_and_patched(tmp_path, module_builders, read_bits):
    """2**24 elements is the largest item: changes on both sides of the cut survive."""
    n = (1 << 24) + 4096
    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, n, dtype=np.uint8)
    target = base.copy()
    cut = 1 << 24
    changed = np.unique(np.r_[0, cut - 5 : cut + 5, n - 1, rng.choice(n, 500, replace=False)])
    target[changed] ^= 0xA5
    write = module_builders["write_checkpoint"]
    b = write(tmp_path / "b.safetensors", {"big": torch.from_numpy(base)}, "file")
    t = write(tmp_path / "t.safetensors", {"big": torch.from_numpy(target)}, "file")
    store = (tmp_path / "store").as_uri()
    summary = dcr_json("diff", b, t, "--store", store, "--version", 2, "--bucket-mib", 1)
    assert summary["changed_elements"] == len(changed)
    assert summary["payloads"] == 2  # one item per bucket
    report = dcr_json("inspect", "--store", store, "--version", 2)
    assert report["tensor_rows"][0]["changed"] == len(changed)
    ckpt = tmp_path / "c" / "model.safetensors"
    ckpt.parent.mkdir()
    shutil.copyfile(b, ckpt)
    result = dcr_json("patch", ckpt, "--store", store, "--version", 2)
    assert result["records_applied"] == len(changed)
    np.testing.assert_array_equal(read_bits(ckpt)["big"], target)


def test_store_given_as_a_plain_path_with_spaces(tmp_path, refits, scenario, read_bits):
    r = refits("file", "mixed")
    store = tmp_path / "delta store"
    summary = dcr_json("diff", r.base, r.target, "--store", store, "--version", 2)
    assert _payload_objects(store), "payloads go to the directory named"
    ckpt = r.copy_base(tmp_path / "ckpt")
    dcr_json("patch", ckpt, "--store", store, "--version", 2)
    _assert_bits_equal(read_bits(ckpt), scenario.target_bits)
    assert summary["store"] == store.as_uri()


def test_store_file_uri_with_a_percent_encoded_space(tmp_path, refits):
    r = refits("file", "mixed")
    store = tmp_path / "delta store"
    summary = dcr_json("diff", r.base, r.target, "--store", store.as_uri(), "--version", 2)
    assert summary["store"] == store.as_uri()
    assert _payload_objects(store)
    assert not (tmp_path / "delta%20store").exists()


@pytest.mark.parametrize("name", ["a\nb", "x" * 1100, ""], ids=["newline", "too-long", "empty"])
def test_diff_fails_cleanly_on_a_tensor_name_the_format_cannot_carry(
    tmp_path, module_builders, name
):
    write = module_builders["write_checkpoint"]
    b = write(tmp_path / "b.safetensors", {name: torch.zeros(4), "ok": torch.zeros(2)}, "file")
    t = write(tmp_path / "t.safetensors", {name: torch.ones(4), "ok": torch.zeros(2)}, "file")
    result = dcr("diff", b, t, "--store", tmp_path / "store", "--version", 2)
    assert_refused(result)


# --- inspect ---------------------------------------------------------------------------


def test_inspect_json_lists_every_tensor_with_true_changed_counts(refit, scenario):
    report = dcr_json("inspect", "--store", refit.store.as_uri(), "--version", refit.version)
    rows = {row["name"]: row for row in report["tensor_rows"]}
    assert sorted(rows) == sorted(scenario.changed)
    for name, dtype, shape, _ in SPEC:
        row = rows[name]
        numel = int(np.prod(shape)) if shape else 1
        assert row["dtype"] == dtype, name
        assert row["elements"] == numel, name
        assert row["changed"] == scenario.changed[name], name
        assert row["changed_pct"] == pytest.approx(100 * scenario.changed[name] / max(1, numel))
        assert row["dense_bytes"] == numel * ITEMSIZE[dtype], name
        if scenario.changed[name]:
            entry = "overwrite" if refit.mode == "overwrite" else "xor"
            assert row["encoding"].startswith(f"{entry}/"), (name, row["encoding"])
        else:
            assert row["encoding"] == "-", name
            assert row["bytes"] == 0, name
    # Per-tensor wire bytes are shares of the payloads' streams (headers excluded).
    wire = sum(row["bytes"] for row in rows.values())
    assert 0.5 * refit.summary["payload_bytes"] < wire <= refit.summary["payload_bytes"] + len(rows)
    assert rows["model.layers.0.mlp.up_proj.weight"]["encoding"].endswith("/runs")
    assert rows["lm_head.weight"]["encoding"].endswith("/runs")
    for key in ("tensors", "changed_elements", "total_elements", "dense_bytes",
                "payload_bytes", "payloads"):
        assert report[key] == refit.summary[key], key
    assert (report["version"], report["base_version"], report["mode"]) == (
        refit.version, refit.base_version, refit.mode,
    )


def test_plain_inspect_prints_a_table(sharded_refit, scenario):
    r = dcr("inspect", "--store", sharded_refit.store, "--version", sharded_refit.version)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("version 1 -> 2")
    assert lines[1].split()[:3] == ["tensor", "dtype", "changed"]
    body = {line.split()[0]: line.split() for line in lines[2:-1]}
    assert sorted(body) == sorted(scenario.changed)
    for name, count in scenario.changed.items():
        assert body[name][2] == f"{count:,}", name
    total = sum(scenario.changed.values())
    assert lines[-1].startswith(f"total: {total:,} of ")


# --- diff refusals, help and usage ----------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ("extra", "'extra.weight'"),
        ("missing", "'buffers.i32'"),
        ("shape", "'buffers.i64'"),
        ("dtype", "'buffers.u8'"),
    ],
)
def test_diff_of_mismatched_checkpoints_fails_naming_the_tensor(
    tmp_path, scenario, module_builders, edit, needle
):
    target = dict(scenario.target)
    if edit == "extra":
        target["extra.weight"] = torch.ones(3)
    elif edit == "missing":
        del target["buffers.i32"]
    elif edit == "shape":
        target["buffers.i64"] = target["buffers.i64"].reshape(64, 128)
    else:
        target["buffers.u8"] = target["buffers.u8"].view(torch.int8)
    write = module_builders["write_checkpoint"]
    base = write(tmp_path / "base.safetensors", scenario.base, "file")
    tgt = write(tmp_path / "target.safetensors", target, "file")
    store = tmp_path / "store"
    result = dcr("diff", base, tgt, "--store", store.as_uri(), "--version", 2, "--json")
    assert_refused(result, needle)
    assert result.stdout == ""
    assert not store.exists() or not list(store.rglob("manifest.dcrm"))


def test_diff_rejects_bad_settings_with_exit_1(tmp_path, refits):
    r = refits("file", "mixed")
    store = (tmp_path / "s").as_uri()
    assert_refused(dcr("diff", r.base, r.target, "--store", store, "--version", 2,
                       "--base-version", 2), "--base-version 2")
    assert_refused(dcr("diff", r.base, r.target, "--store", store, "--version", 0), ">= 0")
    assert_refused(dcr("diff", r.base, r.target, "--store", store, "--version", 2,
                       "--bucket-mib", 0), "under 1 MiB")
    assert_refused(dcr("diff", r.base, tmp_path / "nope", "--store", store, "--version", 2),
                   "nope")
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*"))


def test_a_second_diff_of_a_version_is_refused_unless_it_replaces_it(
        tmp_path, refits, scenario, read_bits, file_hashes):
    """Fails on edd87f2, where a second dcr diff of a version silently wrote over the
    manifest that patches read. Now it is refused, the store unchanged; --replace writes
    the new one, names the attempt it replaced, and patches follow the new one."""
    r = refits("file", "mixed")
    store = tmp_path / "store"
    args = ("diff", r.base, r.target, "--store", store.as_uri(), "--version", 2,
            "--bucket-mib", 1)
    first = dcr_json(*args)
    before = file_hashes(store)
    refused = dcr(*args)
    assert_refused(refused, f"already holds version 2 (attempt {first['attempt']})",
                   "--replace")
    assert file_hashes(store) == before
    second = dcr_json(*args, "--replace")
    assert second["replaced_attempt"] == first["attempt"] != second["attempt"]
    manifest = read_manifest(store / "v0000000002" / "manifest.dcrm")
    assert manifest["attempt"] == second["attempt"]
    ckpt = r.copy_base(tmp_path / "ckpt")
    dcr_json("patch", ckpt, "--store", store.as_uri(), "--version", 2)
    _assert_bits_equal(read_bits(ckpt), scenario.target_bits)


def test_every_option_of_the_file_commands_says_what_it_is():
    """Fails on edd87f2: patch and inspect listed --store, --version and --json bare, and
    diff's and encode's --store named neither s3:// nor relay+http://."""
    from dcr.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("diff", "encode", "patch", "inspect", "materialize", "mirror",
                    "snapshot"):
        for action in sub.choices[command]._actions:
            assert action.help, f"dcr {command} {action.option_strings or action.dest}"
    for command in ("diff", "encode"):
        store = next(a for a in sub.choices[command]._actions if "--store" in a.option_strings)
        assert "s3://" in store.help
        assert "relay+http" in store.help
    encode = sub.choices["encode"].format_help()
    assert "random" not in encode  # the attempt id is required, never made up


def test_help_exits_0_and_mentions_the_commands_and_options():
    top = dcr("--help")
    assert top.returncode == 0
    for word in ("diff", "patch", "inspect", "--store", "--version"):
        assert word in top.stdout, word
    sub = dcr("diff", "--help")
    assert sub.returncode == 0
    for option in ("--store", "--version", "--base-version", "--mode", "mixed", "overwrite",
                   "--bucket-mib", "--json", "BASE", "TARGET"):
        assert option in sub.stdout, option
    for command in ("patch", "inspect"):
        h = dcr(command, "--help")
        assert h.returncode == 0
        assert "--store" in h.stdout
        assert "--version" in h.stdout
        assert "--json" in h.stdout


def test_console_script_runs():
    script = Path(sys.executable).with_name("dcr")
    assert script.exists()
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0
    assert "diff" in r.stdout


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["diff"],
        ["diff", "a", "b", "--version", "2"],
        ["diff", "a", "b", "--store", "s", "--version", "two"],
        ["diff", "a", "b", "--store", "s", "--version", "2", "--mode", "xor"],
        ["patch", "c", "--store", "s"],
        ["frobnicate"],
        ["patch", "c", "--store", "s", "--version", "-1"],
        ["inspect", "--store", "s", "--version", "-1"],
        ["materialize", "--store", "s", "--out", "o", "--held", "-3"],
        ["diff", "a", "b", "--store", "s", "--version", "2", "--base-version", "-1"],
    ],
    ids=["no-command", "diff-no-args", "no-store", "bad-int", "bad-mode", "no-version",
         "unknown-command", "patch-negative-version", "inspect-negative-version",
         "materialize-negative-held", "diff-negative-base"],
)
def test_usage_errors_exit_2(tmp_path, args):
    """A negative version is a usage error (before, ``patch --version -1`` looked for an
    object ``v-000000001/...`` and said it was missing)."""
    r = dcr(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "usage:" in r.stderr
    if "-1" in args or "-3" in args:
        assert "versions start at 0" in r.stderr
    assert list(tmp_path.iterdir()) == []
