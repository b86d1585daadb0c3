"""Every error the operator raises, under one root::

    OperatorError             root (a dcr.errors.DcrError)
    ├── ApiError              the API server answered an error status (a dcr.errors.HttpError;
    │   │                     ``status`` is the HTTP status, ``reason`` its Reason)
    │   ├── NotFound          404
    │   └── Conflict          409: resourceVersion precondition or AlreadyExists
    ├── ApiUnreachable        no answer from the API server (connection, timeout)
    ├── InvalidResource       a RolloutFleet or WeightRefit cannot be acted on as written
    ├── EncoderJobFailed      an encoder Job failed or vanished during an attempt
    ├── EncoderEndpointFailed a warm encoder refused, failed or did not answer a publish
    │                         (a dcr.protocol.owner_endpoints.OwnerEndpointFailed)
    └── NotYet                a refit cannot proceed now: look again later

How the handlers map them to kopf's errors: docs/operator.md, "Inside the operator".
"""

from __future__ import annotations

from dcr.errors import DcrError, HttpError
from dcr.protocol.owner_endpoints import OwnerEndpointFailed


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


class EncoderEndpointFailed(OperatorError, OwnerEndpointFailed):
    """A warm encoder (``dcr encoder``) refused or failed a publish, did not answer by the
    attempt's deadline, or wrote to another store than the fleet's."""


class NotYet(OperatorError):
    """The refit cannot proceed now; the handler looks again later."""
