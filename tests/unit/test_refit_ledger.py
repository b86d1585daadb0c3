"""The main job's summary and step log (``dcr.refit.ledger``, ``dcr.refit.steplog``):
bytes across the boundary counted apart per pod (DCR refits, rejoins, full refits), and
log records of a step printed under its row, not inside the table."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from dcr.refit.ledger import crossed_lines, split_down
from dcr.refit.steplog import install


def test_link_bytes_are_split_into_dcr_rejoin_and_full_per_pod() -> None:
    before = {"pod-0": 100, "pod-1": 100}
    refit = {"pod-0": 1_100, "pod-1": 8_100}
    full = {"pod-0": 50_000_000, "pod-1": 50_000_000}
    split = split_down(before, refit, full, {"pod-1": 7_000})
    assert split == {"pod-0": {"dcr": 1_000, "rejoin": 0, "full": 49_998_900},
                     "pod-1": {"dcr": 1_000, "rejoin": 7_000, "full": 49_991_900}}
    rows = [{"link_down_bytes": split}, {"link_down_bytes": split}]
    lines = crossed_lines(rows, {"pod-0": {"up": 1, "down": 2}, "pod-1": {"up": 1, "down": 2}})
    assert lines[0].startswith("bytes across the boundary")
    assert "  pod-1: DCR refits 0.0 MB, rejoins 0.0 MB, full-checkpoint refits 100 MB" in lines
    assert not any("together" in line for line in lines)  # no line mixes them
    assert crossed_lines(rows, {}) == []  # no links, no lines


def test_a_steps_warnings_print_under_its_row_and_stay_in_the_log_file(
        tmp_path: Path) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        held = install(tmp_path / "refit.log")
        out = io.StringIO()
        print("   2  row", file=out)
        logging.getLogger("dcr.protocol.coordinator").warning("attempt %s failed", "a-1")
        assert out.getvalue() == "   2  row\n"  # nothing printed inside the table
        held.print_held(out)
        assert out.getvalue() == ("   2  row\n       WARNING dcr.protocol.coordinator: "
                                  "attempt a-1 failed\n")
        held.print_held(out)  # printed once
        assert out.getvalue().count("a-1") == 1
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    assert "attempt a-1 failed" in (tmp_path / "refit.log").read_text()
