"""The image recipes agree with each other: every role tools/image/build.sh builds is a stage
of images/Containerfile on the base its lock is made for, and the GPU rollout image (role
``vllm``) holds the vLLM the engine tier runs on a GPU, resolved with every requirement.

What these tests cannot do here: build the images (mmdebstrap, gigabytes of wheels, podman);
docs/images.md, "The GPU rollout image" says what was run of the vllm image and what was not.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = (REPO / "tools" / "image" / "build.sh").read_text()
CONTAINERFILE = (REPO / "images" / "Containerfile").read_text()


def _lock(*args: str) -> str:
    return subprocess.run([sys.executable, str(REPO / "tools" / "image" / "lock.py"), *args],
                          capture_output=True, text=True, check=True, timeout=60).stdout


def _bash_map(name: str) -> dict[str, str]:
    """A ``declare -rA NAME=([k]=v ...)`` of build.sh (it may span lines)."""
    m = re.search(rf"declare -rA {name}=\((.*?)\)\n", BUILD, re.S)
    assert m is not None, name
    return dict(re.findall(r"\[([\w-]+)\]=(\S+?)(?=\s|$)", m.group(1)))


def _stages() -> dict[str, str]:
    """Stage name -> what it is FROM."""
    return {m[2]: m[1] for m in re.finditer(r"^FROM (\S+) AS ([\w-]+)$", CONTAINERFILE, re.M)}


def test_every_image_role_is_a_stage_on_its_locks_base() -> None:
    stages, bases = _stages(), _bash_map("LOCK_BASE")
    for role in _bash_map("IMAGE_REPO"):
        assert role in stages, f"build.sh builds {role}, which images/Containerfile lacks"
    for role in ("vllm-cpu", "vllm"):  # the engine images install their lock in their stage
        assert stages[role] == "${VLLM_BASE}"
        assert bases[role] == "vllm"
        assert f"COPY images/requirements/{role}.txt" in CONTAINERFILE


def test_the_gpu_image_holds_the_vllm_the_engine_tier_runs_with_its_requirements() -> None:
    setup = (REPO / "tools" / "engines" / "setup.sh").read_text()
    m = re.search(r'cuda\)\s+DIST=vllm;\s+VLLM_VERSION="\$\{DCR_VLLM_VERSION:-([\d.]+)\}"', setup)
    assert m is not None
    reqs = _lock("requirements", "vllm").split()
    assert f"vllm=={m[1]}" in reqs
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert set(project["dependencies"]) <= set(reqs)
    assert _lock("no-deps", "vllm").strip() == ""  # resolved as vLLM declares it
    assert _lock("constraints", "vllm").strip().endswith("constraints-vllm.in")


@pytest.mark.parametrize("role", ["vllm", "vllm-cpu"])
def test_a_missing_lock_is_reported_so_the_build_makes_it(role: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "tools" / "image" / "lock.py"), "check",
                           role, "no-such-base-key"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 1
    assert f"images/requirements/{role}.txt" in done.stderr
