"""The file-level path on a trainer's real exports: ``dcr diff`` writes each step's delta
and ``dcr patch`` brings a rollout copy of the first export along, bit for bit.

The main job (``dcr refit``, ``make demo``; ``test_refit_job.py``) refits agents in
place; this is what the earlier single-process demo also checked on checkpoint files,
with the same trainer: a sharded BF16 export per optimizer step, a small share of it
changed, every tensor of the patched copy equal to the export as raw bits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dcr.checkpoint import Checkpoint
from dcr.refit.trainer import Trainer, TrainerSettings


def dcr(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcr", *map(str, args)], capture_output=True,
                          text=True, timeout=300, check=False)


SMALL = TrainerSettings(hidden_size=256, intermediate_size=688, layers=4)  # 3M parameters


def bit_exact(a: Path, b: Path) -> bool:
    """Every tensor of ``a`` equals ``b`` as raw bits (and the tensor sets match)."""
    with Checkpoint(a) as x, Checkpoint(b) as y:
        if x.names() != y.names():
            return False
        return all(np.array_equal(x.bits(n), y.bits(n)) for n in x.names())


@pytest.mark.slow
def test_diff_and_patch_follow_the_trainers_exports_bit_exactly(tmp_path: Path) -> None:
    trainer = Trainer(SMALL)
    base = trainer.export(tmp_path / "trainer" / "v0")
    assert len(list(base.glob("*.safetensors"))) > 1  # a sharded checkpoint
    rollout, store = tmp_path / "rollout", tmp_path / "store"
    shutil.copytree(base, rollout)
    for v in (1, 2):
        trainer.step()
        target = trainer.export(tmp_path / "trainer" / f"v{v}")
        diff = dcr("diff", base, target, "--store", store, "--version", v, "--json")
        assert diff.returncode == 0, diff.stderr
        summary = json.loads(diff.stdout)
        assert 0 < 100 * summary["changed_elements"] / summary["total_elements"] < 20
        assert 0 < summary["payload_bytes"] < summary["dense_bytes"]
        assert not bit_exact(rollout, target)
        patch = dcr("patch", rollout, "--store", store, "--version", v)
        assert patch.returncode == 0, patch.stderr
        assert bit_exact(rollout, target)
        base = target
