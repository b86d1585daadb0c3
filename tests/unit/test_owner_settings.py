"""Owner settings and state: the encode command line round-trips, and one baseline rule.

``EncodeSettings.argv`` (what ``ProcessOwner`` and the operator's encoder Jobs run) parses
back through ``dcr encode`` to the same settings; ``dcr diff`` keeps its defaults; the
settings module stays importable without numpy or torch (the operator imports it). The
shared ``OwnerState`` offers a candidate only after the baseline, publishes only the
transition baseline -> candidate, and advances only for a record naming the candidate
and an attempt it published.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dcr.cli import build_parser, encode_settings
from dcr.errors import BaselineError, ConfigError
from dcr.owner.settings import EncodeSettings
from dcr.owner.state import OwnerState
from dcr.protocol.records import Attempt, CommitRecord, Transition
from dcr.settings import MiB


def test_encode_argv_parses_back_to_the_same_settings() -> None:
    s = EncodeSettings(target_version=7, base_version=5, mode="overwrite", bucket_bytes=64 * MiB,
                       level=3, threads=4, overwrite=("lm_head.*", "x"), owner=1, owners=3,
                       attempt="a-0123456789ab", profile_path=Path("/p/profile.json"))
    argv = s.argv("/ckpt/v5", "/ckpt/v7", store="file:///tmp/s")
    args = build_parser().parse_args(argv)
    assert (args.command, args.base, args.target, args.store, args.json) == (
        "encode", "/ckpt/v5", "/ckpt/v7", "file:///tmp/s", True)
    assert encode_settings(args) == replace(s, attempt_manifest=True)


def test_encode_argv_names_a_launcher_owner_and_needs_an_attempt() -> None:
    s = EncodeSettings(target_version=3, base_version=2, attempt="a-1", owners=2)
    argv = s.argv("b", "t", store="s3://b/p", owner="$(DCR_OWNER)")
    assert argv[argv.index("--owner") + 1] == "$(DCR_OWNER)"
    with pytest.raises(ConfigError, match="version 3 needs an attempt id"):
        replace(s, attempt=None).argv("b", "t", store="s3://b/p")


def test_diff_defaults_to_the_previous_version_and_the_settings_defaults() -> None:
    args = build_parser().parse_args(["diff", "b", "t", "--store", "s", "--version", "4"])
    assert encode_settings(args) == EncodeSettings(target_version=4, base_version=3)
    assert EncodeSettings(target_version=4, base_version=3).bucket_bytes == 256 * MiB


def test_encode_settings_import_neither_numpy_nor_torch() -> None:
    code = ("import sys, dcr.owner.settings; "
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def _attempt(base: int, target: int) -> Attempt:
    return Attempt(transition=Transition(base_version=base, target_version=target),
                   mode="mixed", receivers=("r",), deadline=time.time() + 60)


def test_owner_state_publishes_and_advances_only_baseline_to_candidate() -> None:
    state: OwnerState[str] = OwnerState(baseline="bits-0", version=0, owner=2)
    with pytest.raises(ConfigError, match="candidate version 0 is not after the baseline 0"):
        state.set_candidate("bits-0", 0)
    with pytest.raises(BaselineError, match="candidate None"):
        state.check_publish(_attempt(0, 1))
    state.set_candidate("bits-1", 1)
    with pytest.raises(BaselineError, match=r"attempt .* is 1 -> 2; the committed baseline is 0"):
        state.check_publish(_attempt(1, 2))
    published = _attempt(0, 1)
    assert state.check_publish(published) == "bits-1"
    for record in (CommitRecord(committed_version=1, baseline_id="b", attempt="a-other"),
                   CommitRecord(committed_version=2, baseline_id="b", attempt=published.id),
                   CommitRecord(committed_version=0, baseline_id="b", attempt="")):
        with pytest.raises(BaselineError, match=r"Owner 2: .*The baseline stays"):
            state.advance_baseline(record)
        assert (state.baseline, state.version) == ("bits-0", 0)
    good = CommitRecord(committed_version=1, baseline_id="b", attempt=published.id)
    state.advance_baseline(good)
    assert (state.baseline, state.version, state.candidate) == ("bits-1", 1, None)
    state.advance_baseline(good)  # again, as a coordinator finishing after failover does
    assert state.version == 1
