"""Where the commit record lives, changed only by compare-and-set.

``CommitStore`` is the seam. ``SqliteCommitStore`` takes SQLite's write lock before it
compares (``BEGIN IMMEDIATE``), so coordinators in separate processes cannot both win, and
a crash leaves the old record or the new one.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Protocol

from dcr.errors import ExternalError
from dcr.protocol.records import CommitOutcome, CommitRecord


class CommitStoreError(ExternalError):
    """The commit record could not be read or written."""


class CommitStore(Protocol):
    def read(self) -> CommitRecord: ...

    def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS commit_record (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    committed_version INTEGER NOT NULL,
    baseline_id TEXT NOT NULL,
    attempt TEXT NOT NULL,
    history_digest TEXT NOT NULL DEFAULT ''
)
"""
# A record file made before the history digest was carried gains the column, empty.
_ADD_DIGEST = "ALTER TABLE commit_record ADD COLUMN history_digest TEXT NOT NULL DEFAULT ''"


class SqliteCommitStore:
    """The commit record in a SQLite file, created with ``initial`` if absent."""

    def __init__(self, path: Path, initial: CommitRecord, *, timeout_s: float = 10.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(commit_record)")}
            if "history_digest" not in columns:
                db.execute(_ADD_DIGEST)
            db.execute(
                "INSERT OR IGNORE INTO commit_record VALUES (1, ?, ?, ?, ?)",
                (initial.committed_version, initial.baseline_id, initial.attempt,
                 initial.history_digest),
            )
            db.execute("COMMIT")

    def _connect(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as e:
            raise CommitStoreError(f"Cannot open the commit record at {self.path}: {e}.") from e
        return db

    def read(self) -> CommitRecord:
        db = self._connect()
        try:
            row = db.execute(
                "SELECT committed_version, baseline_id, attempt, history_digest "
                "FROM commit_record"
            ).fetchone()
        except sqlite3.Error as e:
            raise CommitStoreError(f"Cannot read the commit record at {self.path}: {e}.") from e
        finally:
            db.close()
        if row is None:
            raise CommitStoreError(f"The commit record at {self.path} is missing.")
        return CommitRecord(committed_version=row[0], baseline_id=row[1], attempt=row[2],
                            history_digest=row[3])

    def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome:
        """Write ``new`` if the record is ``expected``; CONFLICT if it is not.

        UNKNOWN when the database could not be reached or the commit's fate is not known
        (the caller must ``read`` before deciding anything).
        """
        try:
            db = self._connect()
        except CommitStoreError:
            return CommitOutcome.UNKNOWN
        try:
            db.execute("BEGIN IMMEDIATE")
            cur = db.execute(
                "UPDATE commit_record SET committed_version = ?, baseline_id = ?, attempt = ?, "
                "history_digest = ? WHERE id = 1 AND committed_version = ? AND baseline_id = ? "
                "AND attempt = ? AND history_digest = ?",
                (new.committed_version, new.baseline_id, new.attempt, new.history_digest,
                 expected.committed_version, expected.baseline_id, expected.attempt,
                 expected.history_digest),
            )
            if cur.rowcount != 1:
                db.execute("ROLLBACK")
                return CommitOutcome.CONFLICT
            db.execute("COMMIT")
            return CommitOutcome.SUCCESS
        except sqlite3.OperationalError:
            return CommitOutcome.UNKNOWN  # locked past the timeout, or I/O: read to learn
        finally:
            db.close()
