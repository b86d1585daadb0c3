"""Every error DCR raises, under one root, grouped by what a caller does about it.

Hierarchy (``(module)``: defined beside the code that raises it; the rest here)::

    DcrError
    ├── ConfigError              settings or arguments are wrong: fix them (names the value)
    │   └── NoHistory            (files.inspect) the store holds no history (a dcr diff store)
    │
    ├── Refused                  a server refuses a request as written; ``status`` (on the
    │   │                        class) is the HTTP status every DCR server answers for it
    │   ├── Invalid              400: malformed, or names what may not be asked: fix the request
    │   │   ├── BadRequest       (protocol.agent_api) an agent or member call's body (a ValueError)
    │   │   ├── BadPublish       (owner.server) what a publish names
    │   │   ├── ServeRefused     (serve.server) a dcr serve request (a ValueError)
    │   │   ├── BadCompletion    (serve.completions) a completion request (a ValueError)
    │   │   ├── BadVersionHeader (http.admission) a staleness header is not a version number
    │   │   ├── VersionSkew      (versions) a request speaks an API version the server does
    │   │   │                    not read (docs/upgrades.md)
    │   │   └── UnknownMethod    (serve.workers) a collective_rpc method not the plugin's
    │   ├── StateConflict        409: does not fit the state it meets: read the state again
    │   │   ├── AgentConflict    (receiver.attempt) a call the agent's state does not allow
    │   │   ├── MemberConflict   (receiver.member) an attempt the member does not hold
    │   │   ├── PublishConflict  (owner.server) that owner of that attempt publishes already,
    │   │   │                    or the attempt was stopped
    │   │   ├── Stopped          (owner.server) a publish ended early: stopped, or its caller left
    │   │   ├── BaselineError    an owner cannot vouch for that baseline version
    │   │   ├── NotVouched       (receiver.fromstore) the store's history does not vouch for a
    │   │   │                    version, or it cannot be built from it
    │   │   ├── NotLent          (receiver.donor) a donor lends no copy now: none held, a newer
    │   │   │                    one, an attempt or a rebuild in progress
    │   │   ├── IllegalTransition (protocol.state) an attempt cannot move to that state
    │   │   ├── StaleVersion     (http.admission) the engine's committed version is older than
    │   │   │                    the request accepts
    │   │   └── CommitConflict   (protocol.coordinator) the commit record moved under the
    │   │                        coordinator
    │   ├── TryLater             503: not now; the same request may succeed later
    │   │   ├── Busy             every slot of a bounded pool is taken (publishes, waits)
    │   │   ├── Unavailable      (serve.server) dcr serve cannot answer now
    │   │   └── Paused           (serve.gate) the request gate is closed to new requests
    │   └── RelayRefused         (transport.relay.wire) a relay node refuses a request;
    │                            ``status`` is set per refusal (400, 404, 408, 409, 413, 503...)
    │
    ├── AttemptError             an attempt failed on this party; nothing it wrote counts: the
    │   │                        coordinator fails the attempt and retries (overwrite mode)
    │   ├── PayloadError         a payload failed validation; nothing was written
    │   │   ├── TruncatedPayload fewer (or more) bytes than the preamble declares
    │   │   ├── DigestMismatch   the BLAKE2b digest does not match the bytes
    │   │   ├── LimitExceeded    a declared size is over a decode limit (bomb guard)
    │   │   └── MalformedPayload a field is out of range or inconsistent
    │   ├── ManifestError        a manifest is missing, malformed, or disagrees with payloads
    │   │   ├── ForeignPayload   (transport.receive) an object under an attempt's prefix is
    │   │   │                    not what its owner wrote (size or digest, or header ids)
    │   │   └── HistoryRefused   (files.history) the store's history is not the vouched one,
    │   │                        and no copy of that one is left
    │   ├── TargetMismatch       a payload does not fit the tensors it would be applied to
    │   │   └── WrongBaseVersion the target is not at the payload's base version
    │   ├── DuplicatePayload     (apply.applier) a payload id was applied before
    │   ├── PayloadConflict      (apply.applier) a payload id was seen with other bytes
    │   ├── LoaderPathError      (apply.intercept) the runtime's loader wrote storage in a
    │   │                        way DCR cannot honour exactly, or bypassed the hook
    │   ├── UnsupportedView      (apply.geometry) a copy's view cannot be inverted exactly
    │   ├── FingerprintMismatch  (receiver.attempt) after apply, a tensor's bits differ from
    │   │                        the target fingerprint its manifest lists
    │   ├── AttemptFailed        (receiver.attempt) the current attempt failed on this agent
    │   ├── StagingError         (receiver.staging) the staging directory cannot take a
    │   │                        payload (its volume full, or not writable): names the path
    │   └── GroupError           (receiver.group) a member cannot stage, hold or build what
    │                            its leader needs
    │
    ├── ExternalError            something outside this process failed or did not answer (a
    │   │                        peer, the store, a file): report it; a later call may succeed
    │   ├── HttpError            a peer answered an error status or not at all; ``status`` is
    │   │   │                    the HTTP status, or None without a response
    │   │   ├── AgentError       (protocol.agent_api) an agent refused a call or is unreachable
    │   │   ├── EncoderError     (protocol.encoder_api) a warm encoder refused or failed a
    │   │   │                    publish or stop, or is unreachable
    │   │   ├── EngineError      (drivers.errors) a serving engine refused or failed a call,
    │   │   │   │                or is unreachable
    │   │   │   └── BadAnswer    a 2xx answer that breaks the plugin contract
    │   │   ├── MemberError      (receiver.member_api) a member agent refused a call, answered
    │   │   │                    something else, or is unreachable
    │   │   └── (RelayError, and the operator's ApiError)
    │   ├── StoreError           an object store read or write failed
    │   │   ├── ObjectNotFound   the key does not exist
    │   │   └── RelayError       a relay request failed (also an HttpError)
    │   │       └── RelayNotFound no such payload or manifest at the relay (also ObjectNotFound)
    │   ├── CheckpointError      a safetensors file or index is unreadable or inconsistent
    │   │   └── DenseRefused     (runtimes.weights) not this rank's model at that version, or
    │   │                        outside the checkpoint root; nothing was written
    │   ├── OwnerEndpointFailed  (protocol.owner_endpoints) an owner endpoint refused, failed
    │   │                        or did not answer a publish, or wrote to another store
    │   ├── RolloutError         (integrations.trl) the fleet did not answer a completion, or
    │   │                        answered one without what a sample needs
    │   ├── PeerRefused          (receiver.peers) a donor's copy is not taken: not lent, an
    │   │                        offer no checkpoint of the version can be, or unreachable
    │   ├── CommitStoreError     (protocol.commitstore) the commit record is unreadable
    │   └── JournalError         (receiver.journal) the agent's journal is unreadable
    │
    ├── Interrupted              work stopped on purpose; nothing failed: end quietly
    │   ├── ReceiveStopped       (transport.receive) the receiver was told to stop
    │   └── Aborted              (serve.gate) a request the gate aborted while it paused
    │
    └── RefitError               a refit as a whole did not reach its target; the commit
        │                        record (or the WeightRefit) says where it stands
        ├── RefitFailed          (protocol.coordinator) every allowed attempt failed, or too
        │                        few receivers could take part
        ├── RefitAborted         (protocol.coordinator) an operator aborted between attempts
        ├── CommitUnknown        (protocol.coordinator) a commit's outcome could not be
        │                        learned; nothing was abandoned, the record decides later
        └── WeightRefitError     (client) a WeightRefit could not be asked for or waited on
            ├── WeightRefitFailed  its Failed condition is True (``reason``, ``message``)
            │   └── WeightRefitSuperseded  the fleet committed past it
            ├── WeightRefitRefused the API server refused a call (``status``: 403, 422...)
            ├── WeightRefitUnreachable the API server did not answer until the deadline
            ├── SampleVersionError an answer's weight versions are missing or malformed, or
            │                    name no committed refit of the history read
            └── WeightRefitTimeout neither committed nor failed in time

A server answers a :class:`Refused` with its ``status`` and any other error by its own
table (:mod:`dcr.http.edge`). Messages are sentences that carry the offending values.
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


# --- the groups: what a caller does ------------------------------------------------------

class ConfigError(DcrError):
    """Settings or command-line arguments are invalid."""


class Refused(DcrError):
    """A server refuses a request as written; ``status`` is the HTTP status it answers."""

    status: int = 400


class Invalid(Refused):
    """The request is malformed or names what may not be asked (400)."""

    status = 400


class StateConflict(Refused):
    """The request does not fit the state it meets; read the state again (409)."""

    status = 409


class TryLater(Refused):
    """Not now; the same request may succeed later (503)."""

    status = 503


class AttemptError(DcrError):
    """An attempt failed on this party; the coordinator fails it and retries."""


class ExternalError(DcrError):
    """Something outside this process (a peer, the store, a file) failed or did not answer."""


class Interrupted(DcrError):
    """Work stopped on purpose (a stop, an abort); nothing failed."""


class RefitError(DcrError):
    """A refit as a whole did not reach its target."""


# --- the classes defined here -------------------------------------------------------------

class CheckpointError(ExternalError):
    """A checkpoint file or index cannot be read or is inconsistent."""


class PayloadError(AttemptError):
    """A payload failed validation. Nothing was decoded into or written to a target."""


class TruncatedPayload(PayloadError):
    """The payload is shorter or longer than its preamble declares."""


class DigestMismatch(PayloadError):
    """The payload's digest does not match its bytes."""


class LimitExceeded(PayloadError):
    """A declared size exceeds a decode limit."""


class MalformedPayload(PayloadError):
    """A field of the payload is out of range or inconsistent with another."""


class ManifestError(AttemptError):
    """A manifest is missing, malformed, or disagrees with the payloads it lists."""


class TargetMismatch(AttemptError):
    """A payload does not fit the tensors it would be applied to."""


class WrongBaseVersion(TargetMismatch):
    """The target holds bits that are neither the base nor the target version."""


class HttpError(ExternalError):
    """A peer answered an HTTP call with an error status, or could not be reached.

    ``status`` is the HTTP status, or None when no response came. Callers that only care
    whether a peer refused (4xx) or failed (5xx, unreachable) catch this one class.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StoreError(ExternalError):
    """An object store operation failed."""


class ObjectNotFound(StoreError):
    """The requested object does not exist in the store."""


class RelayError(StoreError, HttpError):
    """A relay request failed; ``status`` is the HTTP status, or None without a response."""


class RelayNotFound(RelayError, ObjectNotFound):
    """The relay holds no such payload or manifest."""


class BaselineError(StateConflict):
    """An owner was asked to publish from, or advance to, a version it cannot vouch for."""


class Busy(TryLater):
    """Every slot of a bounded pool is taken (publishes, waits); one ends soon (503)."""


GROUPS: tuple[type[DcrError], ...] = (ConfigError, Refused, AttemptError, ExternalError,
                                      Interrupted, RefitError)
"""The groups every DCR error sits under: what a caller does about it."""
