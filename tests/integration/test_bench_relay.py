"""The relay's side-by-side benchmarks keep working at a tiny size: the refit through the
tree by several owner counts (``bench/transport.py --compare-owners``) and the catch-up of
a store fleet's and a relay fleet's pods (``bench/catchup.py``), real processes over
loopback, every run bit-exact. Functional only: no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(script: str, out: Path, *args: str) -> dict[str, object]:
    subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--out", str(out)],
                   check=True, cwd=ROOT, timeout=900, stdout=subprocess.DEVNULL)
    doc: dict[str, object] = json.loads(out.read_text())
    return doc


def test_the_owner_counts_are_refit_through_the_tree_interleaved_and_bit_exact(
        tmp_path: Path) -> None:
    doc = _bench("transport.py", tmp_path / "owners.json", "--compare-owners", "1,2",
                 "--rounds", "2", "--gib", "0.01", "--nodes", "2", "--pct", "1",
                 "--mbit", "800", "--rtt-ms", "2", "--bucket-mib", "2",
                 "--cache", str(tmp_path / "checkpoints"))
    runs = doc["runs"]
    assert isinstance(runs, list)
    assert [r["owners"] for r in runs] == [1, 2, 2, 1]  # each round starts where one ended
    assert all(r["exact"] and len(r["load_before"]) == 3 for r in runs)
    assert doc["all_exact"] is True
    median = doc["median"]
    assert isinstance(median, dict)
    assert median["1"]["total_over_first"] == 1.0
    assert median["2"]["boundary_bytes"] > median["1"]["boundary_bytes"]  # two manifest parts
    assert "--compare-owners 1,2" in str(doc["command"])


def test_a_relay_fleets_pod_catches_up_beside_a_store_fleets_bit_exactly(
        tmp_path: Path) -> None:
    doc = _bench("catchup.py", tmp_path / "catchup.json", "--gib", "0.01", "--versions", "3",
                 "--missed", "1,3", "--snapshot-every", "2", "--mbit", "800", "--rtt-ms", "2")
    rows = doc["results"]
    assert isinstance(rows, list)
    ways = {"replay", "snapshot", "mirror", "full", "rejoin", "peer", "relay", "relay-peer"}
    for m in (1, 3):
        assert {r["way"] for r in rows if r["missed"] == m} == ways
    assert all(r["bit_exact"] for r in rows)
    by = {(r["missed"], r["way"]): r for r in rows}
    for m in (1, 3):
        relay, peer, rejoin = by[m, "relay"], by[m, "relay-peer"], by[m, "rejoin"]
        assert relay["fleet"] == peer["fleet"] == "relay"
        # what the relay fleet's agent does: its fleet's deltas from the seed it holds, as
        # a store fleet's agent does from its store
        assert (relay["route"], relay["from"], relay["deltas"]) == ("replay", 3 - m, m)
        assert (rejoin["route"], rejoin["from"], rejoin["deltas"]) == ("replay", 3 - m, m)
        assert peer["route"] == "peer"
        assert peer["peer_bytes"] > 0
        assert peer["boundary_bytes"] < relay["boundary_bytes"]
    setup = doc["setup"]
    assert isinstance(setup, dict)
    assert setup["relay_payload_bytes_received"] > 0  # every refit came through the tree
    assert all(b > 0 for b in setup["relay_staged_bytes_after_commits"])
    assert len(setup["load_avg_start"]) == 3
