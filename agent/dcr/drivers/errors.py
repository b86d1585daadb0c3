"""The errors of the engine adapters, in one place.

Hierarchy (both are :class:`~dcr.errors.HttpError`, so a caller that only cares whether
a peer refused or failed catches that)::

    EngineError       a serving engine refused a call, failed it or could not be
    │                 reached; ``call`` names the call ("apply"), ``status`` is the
    │                 HTTP status or None without an answer
    └── BadAnswer     the engine answered 2xx, but not what the contract says
                      (a rank missing or twice, a field of the wrong type)

Messages are sentences that name the engine, the call and the endpoint; what the engine
said is quoted only as a bounded, printable excerpt (:func:`dcr.http.direct.excerpt`),
never as a whole body.
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
