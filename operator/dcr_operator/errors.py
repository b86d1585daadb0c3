"""Every error the operator raises, under one root.

Hierarchy::

    OperatorError                 root (a DcrError, so callers may catch DCR as a whole)
    ├── ApiError                  the Kubernetes API answered with an error status (also
    │   │                         a dcr.errors.HttpError, like AgentError and RelayError);
    │   │                         ``status`` is the HTTP status, ``reason`` its Reason
    │   ├── NotFound              404
    │   └── Conflict              409: resourceVersion precondition or AlreadyExists
    ├── ApiUnreachable            no answer from the API server (connection, timeout)
    ├── InvalidResource           a RolloutFleet or WeightRefit cannot be acted on as
    │                             written (names the field and the value)
    ├── EncoderJobFailed          an encoder Job failed or vanished during an attempt
    ├── EncoderEndpointFailed     a warm encoder refused, failed or did not answer a publish
    └── NotYet                    a refit cannot proceed now (base version not committed,
                                  fleet busy, too few receivers): look again later

In kopf handlers (``handlers.py``):

* a RolloutFleet whose own spec fails validation is a ``kopf.PermanentError`` (and a
  Warning Event): nothing but an edit of that spec can cure it, and an edit re-runs the
  handler;
* ``NotYet``, ``ApiUnreachable`` and other ``ApiError`` are ``kopf.TemporaryError`` after
  the operator's retry delay;
* ``InvalidResource`` is a ``kopf.TemporaryError`` after three retry delays, not a
  permanent one: what it names is usually another object (the fleet a refit points at,
  the agent token's Secret, the store URI in the fleet) that its owner can fix without
  touching the WeightRefit, and the refit should then proceed by itself.
"""

from __future__ import annotations

from dcr.errors import DcrError, HttpError


class OperatorError(DcrError):
    """Root of every operator error."""


class ApiError(OperatorError, HttpError):
    """The API server refused a request; ``status`` is its HTTP status."""

    status: int

    def __init__(self, message: str, status: int, reason: str = "") -> None:
        super().__init__(message, status)
        self.reason = reason


class NotFound(ApiError):
    """The object does not exist (HTTP 404)."""


class Conflict(ApiError):
    """A precondition failed or the object already exists (HTTP 409)."""


class ApiUnreachable(OperatorError):
    """The API server did not answer: its fate (for writes) is unknown."""


class InvalidResource(OperatorError):
    """A custom resource cannot be acted on as written."""


class EncoderJobFailed(OperatorError):
    """An encoder Job failed, was deleted, or did not finish by the attempt's deadline."""


class EncoderEndpointFailed(OperatorError):
    """A warm encoder (``dcr encoder``) refused or failed a publish, did not answer by the
    attempt's deadline, or wrote to another store than the fleet's."""


class NotYet(OperatorError):
    """The refit cannot proceed now; the handler looks again later."""
