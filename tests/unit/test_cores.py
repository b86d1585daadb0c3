"""The cores a process may use: its affinity mask, capped by its cgroup's CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dcr.cores import cgroup_cpu_limit, usable_cores
from dcr.owner.settings import EncodeSettings


def _cgroup(root: Path, v2: str | None = None, v1: tuple[str, str] | None = None) -> Path:
    if v2 is not None:
        (root / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (root / "cpu").mkdir()
        (root / "cpu" / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (root / "cpu" / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    return root


@pytest.mark.parametrize(("v2", "v1", "limit"), [
    ("max 100000", None, None), ("150000 100000", None, 1.5), ("400000 100000", None, 4.0),
    (None, ("-1", "100000"), None), (None, ("50000", "100000"), 0.5),
    (None, None, None), ("garbage", ("200000", "100000"), 2.0)])
def test_the_cgroup_cpu_limit_is_read_from_v2_else_v1(
        tmp_path: Path, v2: str | None, v1: tuple[str, str] | None, limit: float | None) -> None:
    assert cgroup_cpu_limit(_cgroup(tmp_path, v2, v1)) == limit


def test_usable_cores_are_the_affinity_capped_by_the_quota_rounded_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    roots = {name: tmp_path / name for name in ("none", "half-and-one", "tiny")}
    for root in roots.values():
        root.mkdir()
    _cgroup(roots["half-and-one"], "150000 100000")
    _cgroup(roots["tiny"], "1000 100000")
    assert usable_cores(roots["none"]) == 64  # no quota: the affinity mask
    assert usable_cores(roots["half-and-one"]) == 2
    assert usable_cores(roots["tiny"]) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert usable_cores(roots["half-and-one"]) == 1  # a CPU set of one


def test_an_encoders_threads_default_to_the_cores_it_may_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on edd87f2: the default was 2 threads on any machine."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    monkeypatch.setattr("dcr.cores.cgroup_cpu_limit", lambda root: None)
    assert EncodeSettings(target_version=1, base_version=0).thread_count == 12
    assert EncodeSettings(target_version=1, base_version=0, threads=3).thread_count == 3
