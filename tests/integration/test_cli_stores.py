"""``dcr`` against stores it cannot use as asked: the real reason, never a wrong one.

A ``dcr diff`` that cannot reach its S3 store (no credentials, no endpoint) said the
version was already there and suggested ``--replace``; ``dcr materialize`` and ``dcr
history`` on a store only ``dcr diff`` wrote say that only a coordinator writes a history.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from stubs import free_port_on

from dcr.cli import main


@pytest.fixture
def ckpts(tmp_path: Path) -> tuple[Path, Path]:
    state = {"w": torch.randn(64, 32, generator=torch.Generator().manual_seed(0))}
    base, target = tmp_path / "v1", tmp_path / "v2"
    for root in (base, target):
        root.mkdir()
    save_file(state, str(base / "model.safetensors"))
    state = {n: t.clone() for n, t in state.items()}
    state["w"][0, :3] += 1
    save_file(state, str(target / "model.safetensors"))
    return base, target


def _diff(ckpts: tuple[Path, Path], store: str, env: dict[str, str]
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcr", "diff", str(ckpts[0]), str(ckpts[1]),
                           "--store", store, "--version", "2"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_diff_to_an_s3_store_it_may_not_read_says_so_not_that_the_version_exists(
        ckpts: tuple[Path, Path], s3_env: Any) -> None:
    env = dict(s3_env.env)
    env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    done = _diff(ckpts, s3_env.uri, env)
    assert done.returncode == 1
    assert f"Cannot tell whether {s3_env.uri} holds version 2" in done.stderr
    assert "--replace" not in done.stderr
    assert "already holds" not in done.stderr


def test_diff_to_an_unreachable_s3_endpoint_says_so(
        ckpts: tuple[Path, Path], s3_env: Any) -> None:
    env = dict(s3_env.env)
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port_on('127.0.0.1')}"
    done = _diff(ckpts, s3_env.uri, env)
    assert done.returncode == 1
    assert "Cannot tell whether" in done.stderr
    assert "--replace" not in done.stderr


def test_materialize_and_history_on_a_diff_store_say_only_a_coordinator_writes_one(
        ckpts: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = (tmp_path / "deltas").as_uri()
    assert main(["diff", str(ckpts[0]), str(ckpts[1]), "--store", store, "--version", "2",
                 "--json"]) == 0
    capsys.readouterr()
    for argv in (["materialize", "--store", store, "--out", str(tmp_path / "out")],
                 ["history", "--store", store]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "holds no history: only a coordinator" in err, err
    assert not (tmp_path / "out").exists()
