"""The docs stay true to what they are made from: the security doc's tables name tests
that exist (a defence never loses its test silently when a test is renamed or moved), and
the generated references and number tables match their sources."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REF = re.compile(r"(tests/[\w/]+\.py)?::(test_\w+)")


def named_tests(doc: Path) -> list[tuple[str, str]]:
    """(file, test) for every ``tests/...py::test_name`` reference in ``doc``; a bare
    ``::test_name`` refers to the last file named before it on the same row."""
    found = []
    for line in doc.read_text().splitlines():
        if not line.startswith("| "):
            continue
        last = None
        for m in REF.finditer(line):
            last = m[1] or last
            assert last is not None, f"{doc.name}: {m[0]} names no file: {line[:80]}"
            found.append((last, m[2]))
    return found


def test_every_test_the_security_doc_names_exists() -> None:
    refs = named_tests(ROOT / "docs" / "security.md")
    assert len(refs) >= 40  # the tables are there and parsed
    missing = [f"{f}::{t}" for f, t in refs
               if not (ROOT / f).is_file()
               or not re.search(rf"^\s*(async )?def {t}\(", (ROOT / f).read_text(), re.M)]
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"


def test_the_cli_reference_is_what_the_parser_prints() -> None:
    """docs/cli.md's option reference is generated (``make cli-doc``); a changed option or
    default that was not regenerated fails here."""
    from dcr.cli import REFERENCE_MARK, reference

    text = (ROOT / "docs" / "cli.md").read_text()
    assert REFERENCE_MARK in text
    assert text[text.index(REFERENCE_MARK):] == reference(), "run `make cli-doc`"


def test_the_number_tables_are_what_the_benchmark_results_say() -> None:
    """The tables of docs/benchmarks.md and docs/apply.md are written from
    bench/results/*.json (``make tables``); a hand edit or a new result that was not
    written into the doc fails here."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "doctables.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
