"""The docs stay true to what they are made from: the security and failure tables name
tests that exist (a defence never loses its test silently when a test is renamed or
moved), and the generated references and number tables match their sources."""

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


# The pages whose tables name, row by row, the test that keeps each defence or recovery.
TABLES_OF_TESTS = ["security-kubernetes.md", "security-receivers.md", "security-wire.md",
                   "failures.md"]


def test_every_test_the_security_and_failure_tables_name_exists() -> None:
    missing = []
    for name in TABLES_OF_TESTS:
        refs = named_tests(ROOT / "docs" / name)
        assert len(refs) >= 10, f"docs/{name}: its table is gone or no longer parsed"
        missing += [f"docs/{name}: {f}::{t}" for f, t in refs
                    if not (ROOT / f).is_file()
                    or not re.search(rf"^\s*(async )?def {t}\(", (ROOT / f).read_text(), re.M)]
    assert not missing, "tests named in the docs that do not exist:\n" + "\n".join(missing)


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


# --- One home per fact: the docs state the project, not the history of its runs. ---

DOCS = sorted((ROOT / "docs").glob("*.md"))
# Where measured runs live, dated: the component benchmarks and the evaluation's pages.
MEASUREMENT_DOCS = {"benchmarks.md"} | {d.name for d in DOCS if d.name.startswith("evaluation")}
LIMIT_BYTES = 25_000  # a topic read in one sitting (docs/relay.md is 8.7 KB)
# The one exception: cli.md is looked up, not read through. Below its hand-written overview
# it is every command's --help, generated from the parser (`make cli-doc`), so its size is
# the CLI's and shrinks only when the options do.
GENERATED = {"cli.md"}

# A commit hash: a word of 7 to 40 lowercase hex digits holding at least one digit and one
# letter, standing alone (not inside a longer word, an identifier joined by - or _, a path
# or a `sha256:`-style digest), in prose. Fenced code blocks are samples of real output
# (image ids, attempt ids) and are skipped; so are inline code spans.
HASH = re.compile(r"(?<![\w/:.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/.-])")
# A run log: prose reporting what a particular run, session or CI pass did or measured.
RUN_LOG = re.compile("|".join([
    r"\b(an?|the|that) (earlier|later|previous) (run|session|commit)\b",
    r"\bthis (commit|session)\b",
    r"\bthis run\b",
    r"\bearlier (run|session|commit)\b",
    r"\b(first|last) run (found|showed|took|measured)\b",
    r"\bCI ran\b",
    r"\blast ran on\b",
    r"\b\d+ passed\b",
    r"\bpassed in [\d.]+ ?(s|min)\b",
    r"\bprobed\b",
]), re.IGNORECASE)
# A date: measurements carry theirs in bench/results/*.json; only the docs that report
# measurements (MEASUREMENT_DOCS) may say when a run was made.
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def prose(doc: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((n, re.sub(r"`[^`]*`", "``", line)))
    return lines


def findings(pattern: re.Pattern[str], docs: list[Path]) -> list[str]:
    return [f"docs/{d.name}:{n}: {m[0]!r} in {line.strip()[:90]!r}"
            for d in docs for n, line in prose(d) for m in pattern.finditer(line)]


def test_the_docs_name_no_commit_hashes() -> None:
    """A doc states what the code does; which commit did it is git's business."""
    found = findings(HASH, DOCS)
    assert not found, "commit hashes in the docs:\n" + "\n".join(found)


def test_the_docs_hold_no_run_logs() -> None:
    """What a run measured belongs in bench/results and the evaluation pages or
    docs/benchmarks.md, with the command that made it; a topic doc says what is true of
    the project, not what happened in one run ("an earlier run", "CI ran", "76 passed")."""
    found = findings(RUN_LOG, DOCS)
    found += findings(DATE, [d for d in DOCS if d.name not in MEASUREMENT_DOCS])
    assert not found, "run logs in the docs:\n" + "\n".join(found)


def test_each_doc_is_short_enough_to_read_in_one_sitting() -> None:
    sizes = {d.name: len(d.read_bytes()) for d in DOCS if d.name not in GENERATED}
    over = {n: s for n, s in sizes.items() if s > LIMIT_BYTES}
    assert not over, f"split these docs by topic (bytes): {over}"


CITING = ["agent", "operator", "tests", "charts", "crds", "bench", "tools", "images", "docs",
          "README.md", "DEVELOPMENT.md", "Makefile"]
# A doc under docs/ and, when a quoted section follows (docs/<doc>.md, "<Section>"), that
# section; a citation may wrap across lines of a comment, docstring or string literal.
CITATION = re.compile(r'docs/([\w-]+\.md)(?:`?(?:,\s*|\s*\(\s*)\\?"([A-Z`][^"\\]*)\\?")?')


def cited_files() -> list[Path]:
    found = []
    for name in CITING:
        path = ROOT / name
        found += [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()
                                                 and p.suffix in {".py", ".md", ".yaml", ".tpl",
                                                                  ".txt", ".sh", ".json", ""}]
    return [p for p in found if "__pycache__" not in p.parts and "results" not in p.parts]


def headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip().replace("`", "") for _, line in prose(doc)
            if line.startswith("#")] + [
        line.lstrip("#").strip().replace("`", "")
        for line in doc.read_text().splitlines() if line.startswith("#")]


def test_every_doc_citation_names_a_doc_and_a_section_it_has() -> None:
    """Code, charts, tests and docs cite doc sections by name, as in the uninstall
    section of the operations doc; moving a section without its citations fails here."""
    broken = []
    for path in cited_files():
        text = re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", path.read_text(errors="replace"))
        for m in CITATION.finditer(text):
            doc = ROOT / "docs" / m[1]
            if not doc.is_file():
                broken.append(f"{path.relative_to(ROOT)}: {m[0]} (no such doc)")
            elif m[2] and not any(h.startswith(m[2].replace("`", "").strip())
                                  for h in headings(doc)):
                broken.append(f"{path.relative_to(ROOT)}: {m[0]} (no such section)")
    assert not broken, "\n".join(broken)
