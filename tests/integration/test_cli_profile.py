"""`dcr diff --profile`: receivers' classes decide how each tensor travels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def dcr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcr", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_profile_classes_choose_xor_overwrite_or_the_whole_tensor(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    base = {n: torch.randn(64, 64, generator=gen).to(torch.bfloat16) for n in ("a", "b", "c")}
    target = {n: t.clone() for n, t in base.items()}
    for t in target.values():
        t.view(-1)[::50] += 1.0
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(target, str(tmp_path / "target.safetensors"))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"tensors": {"a": "xor", "b": "overwrite", "c": "dense"}}))
    store = str(tmp_path / "store")
    diff = dcr("diff", str(tmp_path / "base.safetensors"), str(tmp_path / "target.safetensors"),
               "--store", store, "--version", "1", "--profile", str(profile), "--json")
    assert diff.returncode == 0, diff.stderr
    rows = {r["name"]: r for r in
            json.loads(dcr("inspect", "--store", store, "--version", "1", "--json").stdout)
            ["tensor_rows"]}
    changed = int((base["a"] != target["a"]).sum())
    assert (rows["a"]["changed"], rows["a"]["encoding"]) == (changed, "xor/gaps")
    assert (rows["b"]["changed"], rows["b"]["encoding"]) == (changed, "overwrite/gaps")
    assert (rows["c"]["changed"], rows["c"]["encoding"]) == (64 * 64, "overwrite/runs")
    ckpt = tmp_path / "rollout.safetensors"
    ckpt.write_bytes((tmp_path / "base.safetensors").read_bytes())
    assert dcr("patch", str(ckpt), "--store", store, "--version", "1").returncode == 0
    got = load_file(str(ckpt))
    assert all(torch.equal(got[n].view(torch.int16), target[n].view(torch.int16)) for n in got)


def test_an_invalid_profile_is_refused_naming_the_file(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4)}, str(tmp_path / "x.safetensors"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tensors": {"a": "sometimes"}}))
    r = dcr("diff", str(tmp_path / "x.safetensors"), str(tmp_path / "x.safetensors"),
            "--store", str(tmp_path / "s"), "--version", "1", "--profile", str(bad))
    assert r.returncode == 1
    assert "dcr: error: Receiver profile" in r.stderr
    assert str(bad) in r.stderr
