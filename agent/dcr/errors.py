"""Every error DCR raises, under one root so callers can catch the package as a whole.

Hierarchy::

    DcrError
    ├── ConfigError            bad settings or arguments (names the value)
    ├── CheckpointError        a safetensors file or index is unreadable or inconsistent
    │   └── DenseRefused       (runtimes.weights) not this rank's model at that version, or
    │                          outside the checkpoint root; nothing was written
    ├── PayloadError           a payload failed validation; nothing was written
    │   ├── TruncatedPayload   fewer (or more) bytes than the preamble declares
    │   ├── DigestMismatch     the BLAKE2b digest does not match the bytes
    │   ├── LimitExceeded      a declared size is over a decode limit (bomb guard)
    │   └── MalformedPayload   a field is out of range or inconsistent
    ├── ManifestError          a manifest is missing, malformed, or disagrees with payloads
    │   └── ForeignPayload     (transport.receive) an object under an attempt's prefix is
    │                          not what its owner wrote (size or digest, or header ids)
    ├── TargetMismatch         a payload does not fit the tensors it would be applied to
    │   └── WrongBaseVersion   the target is not at the payload's base version
    ├── HttpError              a peer answered with an error status or not at all;
    │                          ``status`` is the HTTP status, or None without a response
    │                          (the base of RelayError, AgentError and the operator's ApiError)
    ├── StoreError             an object store read or write failed
    │   ├── ObjectNotFound     the key does not exist
    │   └── RelayError         a relay request failed (also an HttpError)
    │       └── RelayNotFound  no such payload or manifest at the relay (also ObjectNotFound)
    │
    │   Defined beside the code that raises them (all subclass DcrError directly):
    ├── LoaderPathError        (apply.intercept) the runtime's loader wrote storage in a
    │                          way DCR cannot honour exactly, or bypassed the hook
    ├── UnsupportedView        (apply.geometry) a copy's view cannot be inverted exactly
    ├── DuplicatePayload       (apply.applier) a payload id was applied before
    ├── PayloadConflict        (apply.applier) a payload id was seen with other bytes
    ├── IllegalTransition      (protocol.state) an attempt cannot move to that state
    ├── CommitStoreError       (protocol.commitstore) the commit record is unreadable
    ├── CommitConflict         (protocol.coordinator) the record moved under the coordinator
    ├── RefitFailed            (protocol.coordinator) every allowed attempt failed, or too
    │                          few receivers could take part
    ├── RefitAborted           (protocol.coordinator) an operator aborted between attempts
    ├── CommitUnknown          (protocol.coordinator) a commit's outcome could not be
    │                          learned; nothing was abandoned, the record decides later
    ├── EngineError            (drivers.errors) a serving engine refused or failed a call,
    │   │                      or is unreachable (an HttpError)
    │   └── BadAnswer          a 2xx answer that breaks the plugin contract
    ├── AgentError             (protocol.agent_api) an agent refused a call or is
    │                          unreachable (an HttpError)
    ├── EncoderError           (protocol.encoder_api) a warm encoder refused or failed a
    │                          publish or stop, or is unreachable (an HttpError)
    ├── BadRequest             (protocol.agent_api) an agent call's body failed validation
    │                          (also a ValueError; 400)
    ├── RelayRefused           (transport.relay.wire) a relay node refuses a request;
    │                          ``status`` is the HTTP status it answers
    ├── ReceiveStopped         (transport.receive) the receiver was told to stop
    ├── AgentConflict          (receiver.service) a call does not fit the agent's state
    ├── AttemptFailed          (receiver.attempt) the current attempt failed on this agent
    ├── JournalError           (receiver.journal) the agent's journal is unreadable
    ├── NotVouched             (receiver.fromstore) the store's history does not vouch for
    │                          a version, or it cannot be built from it
    ├── FingerprintMismatch    (receiver.attempt) after apply, a tensor's bits differ from
    │                          the target fingerprint its manifest lists
    ├── MemberError            (receiver.member_api) a group's member agent refused a call,
    │                          answered something else, or is unreachable
    ├── MemberConflict         (receiver.member) a member call names an attempt it does not
    │                          hold, or a dense load it cannot build
    ├── GroupError             (receiver.group) a member cannot stage, hold or build what
    │                          its leader needs: the attempt or dense load fails
    ├── BadPublish             (owner.server) a warm encoder refuses what a publish names (400)
    ├── PublishConflict        (owner.server) that owner of that attempt publishes already,
    │                          or the attempt was stopped (409)
    ├── Busy                   (owner.server) every publish slot is taken (503)
    ├── Stopped                (owner.server) a publish ended early: stopped, or its caller left
    ├── ServeRefused           (serve.server) dcr serve refuses a request body (400)
    ├── Unavailable            (serve.server) dcr serve cannot answer now (503)
    ├── BadCompletion          (serve.completions) a completion request it cannot serve (400)
    ├── UnknownMethod          (serve.workers) a collective_rpc method that is not the plugin's
    ├── Paused                 (serve.gate) the request gate is closed to new requests (503)
    ├── Aborted                (serve.gate) a request the gate aborted while it paused
    ├── WeightRefitError       (client) a WeightRefit could not be asked for or waited on
    │   ├── WeightRefitFailed  its Failed condition is True (``reason``, ``message``)
    │   │   └── WeightRefitSuperseded  the fleet committed past it
    │   └── WeightRefitTimeout neither committed nor failed in time
    │
    └── BaselineError          an owner cannot vouch for that baseline version (owner/)

Messages are sentences that carry the offending values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


def first_validation_error(e: ValidationError, root: str = "") -> str:
    """``field.path: message`` of a pydantic error's first problem, for sentences that
    name the field; ``root`` stands for the path when the whole value is wrong."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or root
    return f"{where}: {err['msg']}" if where else str(err["msg"])


class DcrError(Exception):
    """Root of every DCR error."""


class ConfigError(DcrError):
    """Settings or command-line arguments are invalid."""


class CheckpointError(DcrError):
    """A checkpoint file or index cannot be read or is inconsistent."""


class PayloadError(DcrError):
    """A payload failed validation. Nothing was decoded into or written to a target."""


class TruncatedPayload(PayloadError):
    """The payload is shorter or longer than its preamble declares."""


class DigestMismatch(PayloadError):
    """The payload's digest does not match its bytes."""


class LimitExceeded(PayloadError):
    """A declared size exceeds a decode limit."""


class MalformedPayload(PayloadError):
    """A field of the payload is out of range or inconsistent with another."""


class ManifestError(DcrError):
    """A manifest is missing, malformed, or disagrees with the payloads it lists."""


class TargetMismatch(DcrError):
    """A payload does not fit the tensors it would be applied to."""


class WrongBaseVersion(TargetMismatch):
    """The target holds bits that are neither the base nor the target version."""


class HttpError(DcrError):
    """A peer answered an HTTP call with an error status, or could not be reached.

    ``status`` is the HTTP status, or None when no response came. Callers that only care
    whether a peer refused (4xx) or failed (5xx, unreachable) catch this one class.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StoreError(DcrError):
    """An object store operation failed."""


class ObjectNotFound(StoreError):
    """The requested object does not exist in the store."""


class RelayError(StoreError, HttpError):
    """A relay request failed; ``status`` is the HTTP status, or None without a response."""


class RelayNotFound(RelayError, ObjectNotFound):
    """The relay holds no such payload or manifest."""


class BaselineError(DcrError):
    """An owner was asked to publish from, or advance to, a version it cannot vouch for."""
