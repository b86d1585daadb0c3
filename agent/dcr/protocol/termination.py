"""Why a ``dcr`` process failed, in one sentence Kubernetes can show without its logs.

A failed encoder Job says only ``BackoffLimitExceeded``; the reason sits in the pod's log,
often in another cluster. So ``dcr`` writes one sentence in its own words (the error's
class and message) to the container's termination message file when a command fails, and
the operator copies it, sanitized again, into the WeightRefit's condition and an Event
(docs/operator.md, "What happens, and when things go wrong").

Both ends go through :func:`sanitize`: printable ASCII only, whitespace folded to single
spaces (no newlines), URL query strings dropped (a presigned URL's signature), and at most
:data:`MAX_BYTES` (Kubernetes keeps 4096 bytes per container; a condition message needs no
more than this). Only the error's own sentence is written, never a body a peer answered:
an error DCR did not raise is named by its class alone.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Final

from dcr.errors import DcrError

PATH_ENV: Final = "DCR_TERMINATION_LOG"  # the file to write; unset: nothing is written
KUBERNETES_PATH: Final = "/dev/termination-log"  # the kubelet's default terminationMessagePath
MAX_BYTES: Final = 1024
_QUERY = re.compile(r"(\w+://[^\s?#]*)[?#]\S*")
_SPACE = re.compile(r"\s+")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")
_CUT = "..."


def sanitize(text: str, limit: int = MAX_BYTES) -> str:
    """``text`` as one line of printable ASCII of at most ``limit`` bytes, URL queries
    dropped; safe to put in a status, an Event or a log line whatever ``text`` held."""
    text = _QUERY.sub(r"\1?...", text)
    text = _UNPRINTABLE.sub("?", _SPACE.sub(" ", text)).strip()
    if len(text) > limit:
        text = text[: max(0, limit - len(_CUT))].rstrip() + _CUT
    return text


def sentence(error: BaseException) -> str:
    """What to say about ``error``: its class and, for DCR's own errors, its message."""
    name = type(error).__name__
    if not isinstance(error, DcrError):  # a library's message may quote what a peer sent
        return sanitize(f"{name}: an unexpected error; the pod's log has the traceback.")
    return sanitize(f"{name}: {error}")


def write(error: BaseException, path: str | None = None) -> bool:
    """Write :func:`sentence` of ``error`` to ``path`` (default: ``$DCR_TERMINATION_LOG``);
    False if there is nowhere to write or the write failed (the error itself matters more)."""
    target = path if path is not None else os.environ.get(PATH_ENV)
    if not target:
        return False
    with contextlib.suppress(OSError):
        Path(target).write_bytes(sentence(error).encode("ascii"))
        return True
    return False
