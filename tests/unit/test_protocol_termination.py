"""The termination message a failed ``dcr`` leaves for Kubernetes: one bounded sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcr.cli import main
from dcr.errors import CheckpointError, StoreError
from dcr.protocol.termination import MAX_BYTES, PATH_ENV, sanitize, sentence, write


def test_sanitize_keeps_one_line_of_printable_ascii_within_the_bound() -> None:
    hostile = "line one\nline two\r\n\x1b[31mred\x00 caf\u00e9 " + "x" * 5000
    out = sanitize(hostile)
    assert len(out.encode()) <= MAX_BYTES
    assert out.endswith("...")
    assert out.startswith("line one line two ?[31mred? caf? x")
    assert all(0x20 <= ord(ch) <= 0x7E for ch in out)


def test_sanitize_drops_url_queries_a_presigned_url_carries() -> None:
    text = ("GET https://b.s3.example/k?X-Amz-Credential=AKIA123&X-Amz-Signature=abc "
            "failed")
    assert sanitize(text) == "GET https://b.s3.example/k?... failed"


def test_the_sentence_names_dcrs_error_and_never_quotes_a_foreign_one() -> None:
    assert sentence(CheckpointError("Checkpoint /c does not exist.")) == (
        "CheckpointError: Checkpoint /c does not exist.")
    body = RuntimeError("<Error><Code>AccessDenied</Code><Key>secret-token</Key></Error>")
    said = sentence(body)
    assert said.startswith("RuntimeError: ")
    assert "secret-token" not in said


def test_write_goes_to_the_named_file_and_nowhere_without_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PATH_ENV, raising=False)
    assert not write(StoreError("down"))
    target = tmp_path / "termination-log"
    assert write(StoreError("Store s3://b/p is\nunreachable."), str(target))
    assert target.read_text() == "StoreError: Store s3://b/p is unreachable."
    assert not write(StoreError("x"), str(tmp_path / "no" / "such" / "dir"))


def test_a_failed_dcr_encode_writes_why_to_the_termination_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv(PATH_ENV, str(log))
    missing = tmp_path / "nope"
    assert main(["encode", str(missing), str(missing), "--store", str(tmp_path / "s"),
                 "--version", "1", "--mode", "mixed", "--attempt", "a-1", "--owner", "0",
                 "--owners", "1"]) == 1
    assert log.read_text() == f"CheckpointError: Checkpoint {missing} does not exist."
