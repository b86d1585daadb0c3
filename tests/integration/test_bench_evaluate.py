"""``make evaluate``'s parts keep working: a tiny transport benchmark runs every way (full
checkpoint, object store, relay tree) through real processes, ends bit-exact on every
node, and the evaluation report renders from its JSON. Functional only: no timing is
asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_transport_benchmark_is_bit_exact_and_the_evaluation_renders(tmp_path: Path) -> None:
    out = tmp_path / "dcr-0.25g-3pct-4n.json"  # a sweep run's name: the report's main table
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "transport.py"), "--gib", "0.01", "--nodes", "2",
         "--pct", "3", "--mbit", "800", "--rtt-ms", "2", "--bucket-mib", "2",
         "--cache", str(tmp_path / "checkpoints"), "--out", str(out)],
        check=True, cwd=ROOT, timeout=600, stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    assert doc["all_exact"] is True
    assert len(doc["results"]["dcr-s3"]["nodes"]) == len(doc["results"]["dcr-relay"]["nodes"]) == 2
    full = doc["results"]["full"]["boundary_bytes"]
    assert full >= 2 * doc["setup"]["checkpoint_bytes"]  # each node downloaded all of it
    for way in ("dcr-s3", "dcr-relay"):
        assert 0 < doc["results"][way]["boundary_bytes"] < full / 10
    lim = doc["limit"]
    assert lim["limit_s"] == max(lim["encode_s"], lim["link_s"], lim["apply_s"]) + lim["rtt_s"]
    alone = doc["stages_alone"]
    assert 2.5 < alone["changed_pct"] < 3.5
    assert alone["owner_peak_anon_bytes"] > 0
    assert alone["payload_bytes"] > 0

    spec = importlib.util.spec_from_file_location("evaluate", ROOT / "bench" / "evaluate.py")
    assert spec is not None
    assert spec.loader is not None
    evaluate = importlib.util.module_from_spec(spec)
    sys.modules["evaluate"] = evaluate  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(evaluate)
        text = evaluate.report({out.stem: doc})
    finally:
        del sys.modules["evaluate"]
    row = next(line for line in text.splitlines() if line.startswith("| 0.01 | 2 | 3% |"))
    assert f"{doc['results']['dcr-s3']['total_s']:.2f}" in row
    assert "Every DCR row ended bit-exact on every node: **True**" in text
