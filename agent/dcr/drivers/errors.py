"""The errors of the engine adapters; :mod:`dcr.errors` draws the tree.

Messages name the engine, the call and the endpoint, and quote the engine only as a bounded,
printable excerpt (:func:`dcr.http.direct.excerpt`).
"""

from __future__ import annotations

from dcr.errors import HttpError


class EngineError(HttpError):
    """A serving engine refused a call, failed it, or could not be reached."""

    def __init__(self, message: str, status: int | None = None, *, call: str = "") -> None:
        super().__init__(message, status)
        self.call = call


class BadAnswer(EngineError):
    """An engine answered a call with 2xx, but the answer breaks the contract."""


__all__ = ["BadAnswer", "EngineError"]
