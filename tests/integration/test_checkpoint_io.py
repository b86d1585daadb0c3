"""Integration tests of ``dcr.checkpoint.Checkpoint`` against real safetensors files.

Covers: the three layouts (a single ``.safetensors`` file, a directory holding
``model.safetensors``, a sharded directory with ``model.safetensors.index.json``, both
hand-written and written by transformers' ``save_pretrained(max_shard_size=...)`` for a
tiny randomly initialised Llama); every dtype DCR moves (BF16, F16, F32, F64, F8_E4M3,
F8_E5M2, I8, I16, I32, I64, U8, BOOL, and U16/U32/U64 via ``safetensors.numpy``), 0-d
and empty tensors, NaN payloads, signed zeros and infinities; ``bits(name)`` equal to
the torch tensor's integer view bit for bit; and corrupt or inconsistent files, which
must raise ``CheckpointError`` naming the offending file.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

from dcr.checkpoint import Checkpoint, fingerprint, read_header
from dcr.errors import CheckpointError, DcrError

DTYPE_NAMES = (
    "BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2",
    "I8", "I16", "I32", "I64", "U8", "BOOL",
)
ITEMSIZE = {
    "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
    "I8": 1, "I16": 2, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1,
}
# Bit patterns a float reader must not normalise: NaNs with payloads (quiet and
# signalling, both signs), -0.0, +0.0, +Inf, -Inf (where the format has them).
SPECIALS = {
    "F64": [0x7FF8000000000001, 0xFFF0000000000ABC, 1 << 63, 0, 0x7FF0 << 48, 0xFFF0 << 48],
    "F32": [0x7FC00001, 0xFF800123, 0x80000000, 0, 0x7F800000, 0xFF800000],
    "F16": [0x7E01, 0xFC01, 0x8000, 0, 0x7C00, 0xFC00],
    "BF16": [0x7FC1, 0xFF81, 0x8000, 0, 0x7F80, 0xFF80],
    "F8_E4M3": [0x7F, 0xFF, 0x80, 0],
    "F8_E5M2": [0x7D, 0xFE, 0x80, 0, 0x7C, 0xFC],
}


def _random_bits(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    if dtype == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8)
    u = np.dtype(f"<u{ITEMSIZE[dtype]}")
    bits = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)
    specials = np.array(SPECIALS.get(dtype, []), dtype=u)[:n]
    bits[: len(specials)] = specials
    return bits


@pytest.fixture
def all_dtype_tensors(tensor_from_bits) -> dict[str, torch.Tensor]:
    """One 2-D, one 0-d and one empty tensor of every dtype, random bits plus specials."""
    rng = np.random.default_rng(1234)
    out: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(DTYPE_NAMES):
        shape = (7 + i, 5)
        out[f"layer.{dt.lower()}.weight"] = tensor_from_bits(
            dt, _random_bits(rng, dt, 35 + 5 * i), shape
        )
        out[f"scalar.{dt.lower()}"] = tensor_from_bits(dt, _random_bits(rng, dt, 1), ())
        out[f"empty.{dt.lower()}"] = tensor_from_bits(dt, _random_bits(rng, dt, 0), (0, 3))
    return out


def _assert_bits_match(ckpt: Checkpoint, tensors: dict[str, torch.Tensor], bits_of) -> None:
    assert ckpt.names() == sorted(tensors)
    for name, t in tensors.items():
        info = ckpt.tensors[name]
        want = bits_of(t)
        got = ckpt.bits(name)
        assert info.shape == tuple(t.shape), name
        assert info.numel == t.numel(), name
        assert info.nbytes == t.numel() * t.element_size(), name
        assert got.dtype == np.dtype(f"<u{t.element_size()}"), name
        assert got.shape == (t.numel(),), name
        np.testing.assert_array_equal(got, want, err_msg=name)


# --- layouts and dtypes ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["file", "dir", "sharded"])
def test_every_dtype_reads_back_bit_for_bit_in_each_layout(
    tmp_path, layout, all_dtype_tensors, write_checkpoint, bits_of
):
    root = write_checkpoint(
        tmp_path / ("ckpt.safetensors" if layout == "file" else "ckpt"),
        all_dtype_tensors, layout, shards=4,
    )
    with Checkpoint(root) as ckpt:
        _assert_bits_match(ckpt, all_dtype_tensors, bits_of)
        assert {i.dtype.name for i in ckpt} == set(DTYPE_NAMES)
        expected_files = 4 if layout == "sharded" else 1
        assert len(ckpt.files) == expected_files
        assert all(f.is_file() for f in ckpt.files)


def test_dtype_names_map_to_safetensors_dtypes(tmp_path, all_dtype_tensors, write_checkpoint):
    root = write_checkpoint(tmp_path / "c.safetensors", all_dtype_tensors, "file")
    raw = root.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    with Checkpoint(root) as ckpt:
        for name in all_dtype_tensors:
            assert ckpt.tensors[name].dtype.name == header[name]["dtype"]
            assert ckpt.tensors[name].dtype.itemsize == ITEMSIZE[header[name]["dtype"]]


def test_special_float_bits_are_not_normalised(tmp_path, tensor_from_bits, write_checkpoint):
    """NaN payloads, -0.0 and infinities come back as stored, and differ from each other."""
    tensors = {
        dt: tensor_from_bits(dt, np.array(pats, dtype=f"<u{ITEMSIZE[dt]}"), (len(pats),))
        for dt, pats in SPECIALS.items()
    }
    root = write_checkpoint(tmp_path / "s.safetensors", tensors, "file")
    with Checkpoint(root) as ckpt:
        for dt, pats in SPECIALS.items():
            assert ckpt.bits(dt).tolist() == pats, dt
        f32 = ckpt.bits("F32")
        # -0.0 and +0.0 compare equal as floats but not as bits.
        assert f32.view(np.float32)[2] == f32.view(np.float32)[3]
        assert f32[2] != f32[3]
        assert fingerprint(f32[2:3]) != fingerprint(f32[3:4])


def test_tensor_info_offsets_address_the_tensor_bytes_in_the_file(
    tmp_path, all_dtype_tensors, write_checkpoint, bits_of
):
    root = write_checkpoint(tmp_path / "ckpt", all_dtype_tensors, "sharded", shards=3)
    with Checkpoint(root) as ckpt:
        for info in ckpt:
            raw = info.file.read_bytes()[info.offset : info.offset + info.nbytes]
            assert raw == bits_of(all_dtype_tensors[info.name]).tobytes(), info.name


def test_bits_is_a_read_only_view(tmp_path, write_checkpoint):
    root = write_checkpoint(tmp_path / "c.safetensors", {"w": torch.arange(8.0)}, "file")
    before = root.read_bytes()
    with Checkpoint(root) as ckpt:
        view = ckpt.bits("w")
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
    assert root.read_bytes() == before


def test_zero_d_and_empty_tensors(tmp_path, write_checkpoint, bits_of):
    tensors = {
        "scalar": torch.tensor(-0.0),
        "step": torch.tensor(41, dtype=torch.int64),
        "empty": torch.zeros(0),
        "empty2d": torch.zeros(4, 0, dtype=torch.bfloat16),
    }
    root = write_checkpoint(tmp_path / "c", tensors, "dir")
    with Checkpoint(root) as ckpt:
        assert ckpt.tensors["scalar"].shape == ()
        assert ckpt.tensors["scalar"].numel == 1
        assert ckpt.bits("scalar").tolist() == [0x80000000]
        assert ckpt.bits("step").tolist() == [41]
        assert ckpt.tensors["empty2d"].shape == (4, 0)
        for name in ("empty", "empty2d"):
            assert ckpt.tensors[name].numel == 0
            assert ckpt.tensors[name].nbytes == 0
            assert ckpt.bits(name).size == 0
        _assert_bits_match(ckpt, tensors, bits_of)


def test_unsigned_wide_dtypes_written_by_safetensors_numpy(tmp_path):
    rng = np.random.default_rng(5)
    arrays = {
        f"u{w}": rng.integers(0, np.iinfo(f"<u{w}").max, 33, dtype=f"<u{w}", endpoint=True)
        for w in (2, 4, 8)
    }
    arrays["f16_np"] = rng.standard_normal(10).astype(np.float16)
    arrays["bool_np"] = rng.integers(0, 2, 9).astype(bool)
    path = tmp_path / "np.safetensors"
    save_numpy(arrays, str(path))
    with Checkpoint(path) as ckpt:
        assert ckpt.tensors["u2"].dtype.name == "U16"
        assert ckpt.tensors["u4"].dtype.name == "U32"
        assert ckpt.tensors["u8"].dtype.name == "U64"
        assert ckpt.tensors["f16_np"].dtype.name == "F16"
        assert ckpt.tensors["bool_np"].dtype.name == "BOOL"
        for w in (2, 4, 8):
            np.testing.assert_array_equal(ckpt.bits(f"u{w}"), arrays[f"u{w}"])
        np.testing.assert_array_equal(ckpt.bits("f16_np"), arrays["f16_np"].view("<u2"))
        np.testing.assert_array_equal(ckpt.bits("bool_np"), arrays["bool_np"].view(np.uint8))


def test_metadata_entry_is_not_a_tensor(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(3)}, str(path), metadata={"format": "pt", "step": "7"})
    with Checkpoint(path) as ckpt:
        assert ckpt.names() == ["w"]


def test_directory_with_one_other_named_file_is_accepted(tmp_path, bits_of):
    (tmp_path / "c").mkdir()
    w = torch.arange(5, dtype=torch.int32)
    save_file({"w": w}, str(tmp_path / "c" / "weights.safetensors"))
    (tmp_path / "c" / "config.json").write_text("{}")
    with Checkpoint(tmp_path / "c") as ckpt:
        assert [f.name for f in ckpt.files] == ["weights.safetensors"]
        assert ckpt.bits("w").tolist() == [0, 1, 2, 3, 4]


def test_model_safetensors_wins_over_other_files_in_a_directory(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    save_file({"w": torch.ones(2)}, str(root / "model.safetensors"))
    save_file({"other": torch.ones(2)}, str(root / "extra.safetensors"))
    with Checkpoint(root) as ckpt:
        assert ckpt.names() == ["w"]
        assert [f.name for f in ckpt.files] == ["model.safetensors"]


@pytest.mark.parametrize("torch_dtype", [torch.float32, torch.bfloat16])
def test_transformers_save_pretrained_sharded_llama_reads_bit_for_bit(
    tmp_path, torch_dtype, bits_of
):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch_dtype)
    out = tmp_path / "llama"
    model.save_pretrained(out, max_shard_size="16KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 2, "max_shard_size should force several shards"

    # The oracle: what safetensors itself reads from the shards transformers wrote.
    on_disk: dict[str, torch.Tensor] = {}
    for f in shard_files:
        on_disk.update(load_file(str(out / f)))
    state = model.state_dict()
    with Checkpoint(out) as ckpt:
        assert [f.name for f in ckpt.files] == shard_files
        assert ckpt.names() == sorted(index["weight_map"]) == sorted(on_disk)
        assert set(ckpt.names()) <= set(state)
        for name in ckpt.names():
            assert ckpt.tensors[name].file.name == index["weight_map"][name]
            np.testing.assert_array_equal(ckpt.bits(name), bits_of(on_disk[name]), err_msg=name)
            np.testing.assert_array_equal(ckpt.bits(name), bits_of(state[name]), err_msg=name)
        assert {i.dtype.name for i in ckpt} == {"F32" if torch_dtype == torch.float32 else "BF16"}


def test_fingerprint_depends_on_every_bit(tmp_path, write_checkpoint):
    a = torch.arange(64, dtype=torch.float32)
    b = a.clone()
    b.view(torch.int32)[17] ^= 1
    root = write_checkpoint(tmp_path / "c.safetensors", {"a": a, "a2": a.clone(), "b": b}, "file")
    with Checkpoint(root) as ckpt:
        assert ckpt.fingerprint("a") == ckpt.fingerprint("a2")
        assert ckpt.fingerprint("a") != ckpt.fingerprint("b")
        assert ckpt.fingerprint("a").startswith("xxh3-128:")


# --- corrupt files ---------------------------------------------------------------------


def _write_raw(path: Path, header: object, data: bytes = b"", hlen: int | None = None) -> Path:
    """A safetensors file with an arbitrary header (and optionally a lying length field)."""
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(h) if hlen is None else hlen) + h + data)
    return path


def _good_file(path: Path) -> Path:
    save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int16)},
              str(path))
    return path


def _assert_names_file(exc: pytest.ExceptionInfo[CheckpointError], path: Path) -> None:
    assert isinstance(exc.value, DcrError)
    assert str(path) in str(exc.value) or path.name in str(exc.value), str(exc.value)


def test_file_shorter_than_length_field_is_rejected(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x10\x00\x00")
    with pytest.raises(CheckpointError, match="too short") as exc:
        Checkpoint(path)
    _assert_names_file(exc, path)


def test_file_truncated_inside_the_header_is_rejected(tmp_path):
    path = _good_file(tmp_path / "t.safetensors")
    (hlen,) = struct.unpack("<Q", path.read_bytes()[:8])
    path.write_bytes(path.read_bytes()[: 8 + hlen // 2])
    with pytest.raises(CheckpointError, match="header length") as exc:
        Checkpoint(path)
    _assert_names_file(exc, path)


@pytest.mark.parametrize("hlen", [1 << 20, 1 << 40, (1 << 64) - 1])
def test_header_length_past_end_of_file_is_rejected(tmp_path, hlen):
    path = _write_raw(tmp_path / "h.safetensors", {}, hlen=hlen)
    with pytest.raises(CheckpointError, match=f"header length {hlen}") as exc:
        read_header(path)
    _assert_names_file(exc, path)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe\x00", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        ({"a": [1, 2]}, "not a safetensors tensor entry"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}},
         "not a safetensors tensor entry"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, "invalid data_offsets"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, "data_offsets"),
    ],
    ids=["bad-json", "bad-utf8", "not-object", "entry-not-dict", "extra-key",
         "negative-dim", "float-dim", "one-offset", "reversed-offsets", "negative-offset"],
)
def test_malformed_header_is_rejected(tmp_path, header, match):
    path = _write_raw(tmp_path / "bad.safetensors", header, b"\x00" * 8)
    with pytest.raises(CheckpointError, match=match) as exc:
        Checkpoint(path)
    _assert_names_file(exc, path)


@pytest.mark.parametrize("dtype", ["C64", "F4", "F8_E8M0", "f32", ""])
def test_unknown_dtype_is_rejected(tmp_path, dtype):
    path = _write_raw(
        tmp_path / "dt.safetensors",
        {"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 8,
    )
    with pytest.raises(CheckpointError, match="unsupported dtype") as exc:
        Checkpoint(path)
    _assert_names_file(exc, path)
    assert repr(dtype) in str(exc.value)


def test_overlapping_offsets_are_rejected(tmp_path):
    path = _write_raw(
        tmp_path / "ov.safetensors",
        {
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            "c": {"dtype": "U8", "shape": [8], "data_offsets": [16, 24]},
        },
        b"\x00" * 24,
    )
    with pytest.raises(CheckpointError, match="overlap") as exc:
        Checkpoint(path)
    _assert_names_file(exc, path)
    assert "'a'" in str(exc.value)
    assert "'b'" in str(exc.value)


def test_overlap_hidden_behind_a_later_tensor_is_rejected(tmp_path):
    """A large tensor that covers two later ones: the overlap is not only with its neighbour."""
    path = _write_raw(
        tmp_path / "ov2.safetensors",
        {
            "big": {"dtype": "U8", "shape": [32], "data_offsets": [0, 32]},
            "x": {"dtype": "U8", "shape": [4], "data_offsets": [20, 24]},
            "y": {"dtype": "U8", "shape": [4], "data_offsets": [24, 28]},
        },
        b"\x00" * 32,
    )
    with pytest.raises(CheckpointError, match="overlap"):
        Checkpoint(path)


@pytest.mark.parametrize(("shape", "offsets"), [([4], [0, 12]), ([4], [0, 20]), ([2, 3], [0, 8])])
def test_byte_count_that_disagrees_with_shape_is_rejected(tmp_path, shape, offsets):
    path = _write_raw(
        tmp_path / "n.safetensors",
        {"w": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}, b"\x00" * 32,
    )
    with pytest.raises(CheckpointError, match="do not match its size") as exc:
        Checkpoint(path)
    _assert_names_file(exc, path)
    assert "'w'" in str(exc.value)


def test_data_past_end_of_file_is_rejected(tmp_path):
    path = _good_file(tmp_path / "cut.safetensors")
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(CheckpointError, match="do not match") as exc:
        Checkpoint(path)
    _assert_names_file(exc, path)


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**62, 4]])
def test_shape_whose_element_count_overflows_is_rejected(tmp_path, shape):
    path = _write_raw(
        tmp_path / "huge.safetensors",
        {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}},
    )
    with pytest.raises(CheckpointError) as exc, Checkpoint(path) as ckpt:
        ckpt.bits("w")
    _assert_names_file(exc, path)


def test_missing_checkpoint_and_ambiguous_directory_are_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    root = tmp_path / "two"
    root.mkdir()
    _good_file(root / "a.safetensors")
    _good_file(root / "b.safetensors")
    with pytest.raises(CheckpointError, match=re.escape("2 .safetensors files")) as exc:
        Checkpoint(root)
    _assert_names_file(exc, root)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=re.escape("0 .safetensors files")):
        Checkpoint(tmp_path / "empty")


# --- sharded directories and their index ----------------------------------------------


@pytest.fixture
def sharded(tmp_path, write_checkpoint) -> Path:
    tensors = {f"t{i}": torch.full((4,), float(i)) for i in range(6)}
    return write_checkpoint(tmp_path / "sharded", tensors, "sharded", shards=3)


def _index(root: Path) -> dict:
    return json.loads((root / "model.safetensors.index.json").read_text())


def _write_index(root: Path, index: dict) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_index_is_followed(sharded):
    with Checkpoint(sharded) as ckpt:
        assert [f.name for f in ckpt.files] == sorted(set(_index(sharded)["weight_map"].values()))
        assert ckpt.names() == [f"t{i}" for i in range(6)]
        for name, file in _index(sharded)["weight_map"].items():
            assert ckpt.tensors[name].file.name == file
            assert ckpt.bits(name).view(np.float32).tolist() == [float(name[1:])] * 4


def test_index_naming_a_missing_shard_is_rejected(sharded):
    missing = sorted(set(_index(sharded)["weight_map"].values()))[1]
    (sharded / missing).unlink()
    with pytest.raises(CheckpointError, match=re.escape(missing)) as exc:
        Checkpoint(sharded)
    assert "model.safetensors.index.json" in str(exc.value)


@pytest.mark.parametrize("shard", ["../escape.safetensors", ".hidden.safetensors"])
def test_index_naming_a_shard_outside_the_directory_is_rejected(sharded, shard):
    first = sharded / "model-00001-of-00003.safetensors"
    shutil.copy(first, sharded.parent / "escape.safetensors")
    shutil.copy(first, sharded / ".hidden.safetensors")
    index = _index(sharded)
    index["weight_map"]["t0"] = shard
    _write_index(sharded, index)
    with pytest.raises(CheckpointError, match=re.escape(repr(shard))):
        Checkpoint(sharded)


def test_index_placing_a_tensor_in_the_wrong_shard_is_rejected(sharded):
    index = _index(sharded)
    right = index["weight_map"]["t1"]
    wrong = next(f for f in set(index["weight_map"].values()) if f != right)
    index["weight_map"]["t1"] = wrong
    _write_index(sharded, index)
    with pytest.raises(CheckpointError, match="'t1'") as exc:
        Checkpoint(sharded)
    assert right in str(exc.value)
    assert wrong in str(exc.value)
    assert "model.safetensors.index.json" in str(exc.value)


def test_index_listing_a_tensor_no_shard_holds_is_rejected(sharded):
    index = _index(sharded)
    index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    _write_index(sharded, index)
    with pytest.raises(CheckpointError, match=re.escape("ghost.weight")) as exc:
        Checkpoint(sharded)
    assert "model.safetensors.index.json" in str(exc.value)


def test_shard_holding_a_tensor_the_index_omits_is_rejected(sharded):
    index = _index(sharded)
    del index["weight_map"]["t4"]
    _write_index(sharded, index)
    with pytest.raises(CheckpointError, match="'t4'"):
        Checkpoint(sharded)


def test_tensor_in_two_shards_is_rejected(tmp_path):
    root = tmp_path / "dup"
    root.mkdir()
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, str(root / "s1.safetensors"))
    save_file({"b": torch.ones(2), "c": torch.ones(2)}, str(root / "s2.safetensors"))
    _write_index(root, {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors",
                                       "c": "s2.safetensors"}})
    message = "'b' appears in s1.safetensors and s2.safetensors"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        Checkpoint(root)


@pytest.mark.parametrize("text", ["{oops", "[]", '{"metadata": {}}', "\xff"])
def test_index_that_is_not_an_index_is_rejected(sharded, text):
    (sharded / "model.safetensors.index.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(CheckpointError, match="not a safetensors index") as exc:
        Checkpoint(sharded)
    assert "model.safetensors.index.json" in str(exc.value)


@pytest.mark.parametrize(
    "weight_map", [["model-00001-of-00003.safetensors"], {"t0": 1}, {"t0": None}, "x", 3],
    ids=["list", "int-shard", "null-shard", "string", "number"],
)
def test_index_whose_weight_map_is_malformed_is_rejected(sharded, weight_map):
    _write_index(sharded, {"weight_map": weight_map})
    with pytest.raises(CheckpointError) as exc:
        Checkpoint(sharded)
    assert "model.safetensors.index.json" in str(exc.value)


def test_corrupt_shard_is_named(sharded):
    victim = sharded / "model-00002-of-00003.safetensors"
    victim.write_bytes(victim.read_bytes()[:20])
    with pytest.raises(CheckpointError) as exc:
        Checkpoint(sharded)
    _assert_names_file(exc, victim)
