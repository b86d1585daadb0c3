"""The main job (`make demo`) runs end to end and every refit it makes is bit-exact:
the file-level patch and the in-place receivers (transformers, vLLM-layout ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_refits_every_step_bit_exactly(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(  # a relative --out, as `make demo` passes by default
        [sys.executable, "-m", "dcr", "demo", "--out", "demo", "--steps", "2"],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["bit_exact"] for r in rows)
    assert all(0 < r["changed_pct"] < 20 for r in rows)
    assert all(r["payload_bytes"] > 0 for r in rows)
    assert "all 2 refits bit-exact on the checkpoint copy and on 3 receivers" in proc.stdout
    assert "coverage (share of weight bytes by path): xor" in proc.stdout
    assert all(r["in_place_payload_bytes"] > 0 for r in rows)
