"""The main job's log lines, kept out of its step table.

Records logged while a step runs (the coordinator's warning that an attempt failed, on a
kill step) would print between the table's rows; :class:`StepLog` holds them and
:meth:`StepLog.print_held` prints them indented under the step's row. Every record also goes
to the run's log file, ``refit.log``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

FORMAT = "%(levelname)s %(name)s: %(message)s"


class StepLog(logging.Handler):
    """A handler that holds formatted records until :meth:`print_held`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter(FORMAT))
        self.held: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.held.append(self.format(record))

    def print_held(self, to: TextIO | None = None, indent: str = "       ") -> None:
        """Print what is held (to stdout by default), one indented line per record, and
        forget it."""
        to = to or sys.stdout
        self.acquire()
        try:
            held, self.held = self.held, []
        finally:
            self.release()
        for text in held:
            for line in text.splitlines():
                print(f"{indent}{line}", file=to)
        to.flush()


def install(log_file: Path) -> StepLog:
    """Route the process's WARNING records to a :class:`StepLog` and to ``log_file``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    held = StepLog()
    to_file = logging.FileHandler(log_file)
    to_file.setFormatter(logging.Formatter("%(asctime)s " + FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [held, to_file]
    root.setLevel(logging.WARNING)
    return held
