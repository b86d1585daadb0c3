"""The agent's HTTP control API, declared once: one table of calls, bodies and a client.

:class:`AgentApi` is the table; the aiohttp routes, :class:`AgentClient` and the operator's
``TrackedReceiver`` are built from it (docs/agent-api.md, "One table"). A new call
is one row here and one ``AgentService`` method. A test keeps this list equal to
:meth:`AgentApi.describe`::

    GET  /v1/status      -            -> AgentStatus    the weights' version, the attempt, the gate
    POST /v1/prepare     AttemptSpec  -> AgentStatus    learn the attempt, start staging
    POST /v1/gate/close  -            -> AgentStatus    returns once in-flight requests end
    POST /v1/gate/open   -            -> AgentStatus    refused on dirty or unknown weights
    POST /v1/apply       AttemptRef   -> AgentStatus    open_apply: apply in declared order
    POST /v1/staged      AttemptRef   -> AgentStatus    wait until every payload is staged
    POST /v1/flush       AttemptRef   -> FlushAck       wait until all applied and checked
    POST /v1/commit      CommitRef    -> AgentStatus    the record names the attempt
    POST /v1/stop        AttemptRef   -> AgentStatus    obsolete; returns once no write can
    POST /v1/dense       DenseRequest -> AgentStatus    restore a version by a dense load
    GET  /v1/profile     -            -> dict[str, Any] the loader's classes (ReceiverProfile)
    GET  /v1/fingerprint -            -> dict[str, str] {tensor: xxh3-128 of its integer view}
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, Literal, ParamSpec, Protocol, TypeVar, overload

import urllib3
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from dcr.errors import HttpError, Invalid, first_validation_error
from dcr.format.names import ATTEMPT_PATTERN, DIGEST_PATTERN, Mode
from dcr.http.deadline import POOL_CLASSES, deadline
from dcr.http.direct import check_url, read_bounded, unreachable_reason
from dcr.http.tls import check_peer_url, pooled_request
from dcr.protocol.records import Attempt
from dcr.versions import AGENT_API, release_of

_ATTEMPT = ATTEMPT_PATTERN
# A record's history digest, left out of the JSON when absent (so agents that predate it
# read the call).
_Digest = Annotated[str | None, Field(pattern=DIGEST_PATTERN)]
_OMITTED_WHEN_NONE: Any = Field(default=None, exclude_if=lambda d: d is None)
DRAIN_S = 60.0  # how long closing the gate waits for generation requests in flight
DENSE_S = 600.0  # how long a client waits for a dense load beyond its own timeout
_MAX_ANSWER = 256 << 20  # bytes of an open-ended answer (fingerprints of a large model: MiBs)
_SMALL_ANSWER = 64 << 10  # bytes of a fixed-shape answer (AgentStatus, FlushAck: < 1 KiB)

P = ParamSpec("P")
Q = TypeVar("Q")  # a call's request body (None without one)
R = TypeVar("R")  # a call's response


class AgentError(HttpError):
    """An agent refused a call or could not be reached; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int | None = None, kind: str = "") -> None:
        super().__init__(message, status)
        self.kind = kind


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class AttemptKey(Protocol):
    """What the calls after ``prepare`` read of an attempt; an :class:`Attempt` is one."""

    @property
    def id(self) -> str: ...

    @property
    def deadline(self) -> float: ...  # time.time() seconds bounding the call's waits


@dataclass(frozen=True, kw_only=True)
class AttemptDeadline:
    """An :class:`AttemptKey` as a request names it (the deadline from ``timeout_s``).

    ``cancel``, when the server sets it, ends a wait on this key early: its client left.
    """

    id: str
    deadline: float
    cancel: threading.Event | None = field(default=None, compare=False)


def seconds_left(attempt: AttemptKey) -> float:
    """Seconds until the attempt's deadline, at least 0.1 (a wait always looks once)."""
    return max(0.1, attempt.deadline - time.time())


class AttemptSpec(_Body):
    attempt: Annotated[str, Field(pattern=_ATTEMPT)]
    base_version: Annotated[int, Field(ge=0)]
    target_version: Annotated[int, Field(ge=1)]
    mode: Mode
    owners: Annotated[int, Field(ge=1, le=4096)] = 1
    deadline: float  # time.time() seconds
    # The base record's history digest: the only store history the agent reads from now on.
    history_digest: _Digest = _OMITTED_WHEN_NONE

    @classmethod
    def of(cls, attempt: Attempt | AttemptSpec) -> AttemptSpec:
        if isinstance(attempt, AttemptSpec):
            return attempt
        t = attempt.transition
        return cls(attempt=attempt.id, base_version=t.base_version,
                   target_version=t.target_version, mode=attempt.mode, owners=attempt.owners,
                   deadline=attempt.deadline, history_digest=attempt.history_digest or None)


class AttemptRef(_Body):
    attempt: Annotated[str, Field(pattern=_ATTEMPT)]
    timeout_s: Annotated[float, Field(gt=0, le=86400)] = 600.0

    def key(self) -> AttemptDeadline:
        return AttemptDeadline(id=self.attempt, deadline=time.time() + self.timeout_s)


class CommitRef(AttemptRef):
    # The new record's history digest: the history that names the committed version, which
    # later dense loads of it are checked against.
    history_digest: _Digest = _OMITTED_WHEN_NONE


class DenseRequest(_Body):
    version: Annotated[int, Field(ge=0)]
    # The version's safetensors, under the agent's checkpoint root (a relative path is
    # taken from there); checked against the version's fingerprints where the agent has them.
    # None: the agent builds the version from its store's history, checked throughout.
    checkpoint: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # The committed record's history digest: a build from the store reads only that one.
    history_digest: _Digest = _OMITTED_WHEN_NONE


class AgentStatus(_Body):
    name: str
    version: int | None  # the version its weights hold; None when unknown
    dirty: tuple[int, int] | None  # (base, target) whose writes may be partly applied
    unknown: str | None  # why the version is unknown (e.g. restarted mid-attempt)
    attempt: str | None
    state: str | None  # an AttemptState value
    error: str | None  # why the current attempt failed, if it did
    gate_open: bool
    payloads_staged: int
    payloads_applied: int
    bytes_staged: int


class FlushAck(_Body):
    attempt: str
    payloads: int
    bytes: int
    apply_s: float  # seconds spent inside the applier
    wait_s: float  # seconds the flush call waited


class BadRequest(Invalid, ValueError):
    """A request body failed validation (the message names the field)."""


def parse_body(model: type[_Body], data: bytes) -> Any:
    """Validate a JSON request body strictly; :class:`BadRequest` names the bad field."""
    try:
        return model.model_validate_json(data or b"{}")
    except ValidationError as e:
        raise BadRequest(f"{model.__name__}: {first_validation_error(e, 'body')}") from e


# --- the columns: handle arguments <-> bodies, and client timeouts ---------------------

def _no_body() -> None:
    return None


def _spec(attempt: Attempt) -> AttemptSpec:
    return AttemptSpec.of(attempt)


def _ref(attempt: Attempt) -> AttemptRef:
    return AttemptRef(attempt=attempt.id, timeout_s=seconds_left(attempt))


def _ref_by_id(attempt: str) -> AttemptRef:
    return AttemptRef(attempt=attempt)


def _commit(attempt: str, history_digest: str | None = None) -> CommitRef:
    return CommitRef(attempt=attempt, history_digest=history_digest)


def _dense(version: int, checkpoint: str | None = None,
           history_digest: str | None = None) -> DenseRequest:
    return DenseRequest(version=version, checkpoint=checkpoint, history_digest=history_digest)


def _as_is(body: Any) -> tuple[Any, ...]:
    return (body,)


def _as_key(body: AttemptRef) -> tuple[AttemptDeadline]:
    return (body.key(),)


def _as_id(body: AttemptRef) -> tuple[str]:
    return (body.attempt,)


def _with_digest(args: tuple[Any, ...], digest: str | None) -> tuple[Any, ...]:
    """A call's arguments, the history digest last where one came (without one, the call
    as services that predate the digest take it)."""
    return args if digest is None else (*args, digest)


def _as_commit(body: CommitRef) -> tuple[Any, ...]:
    return _with_digest((body.attempt,), body.history_digest)


def _as_dense(body: DenseRequest) -> tuple[Any, ...]:
    return _with_digest((body.version, body.checkpoint), body.history_digest)


# Timeout rules: the client's own timeout (seconds) and the body -> how long to wait.

def _own(timeout_s: float, body: object) -> float:
    return timeout_s


def _drain(timeout_s: float, body: object) -> float:  # the agent drains in-flight requests
    return timeout_s + DRAIN_S


def _until_deadline(timeout_s: float, body: AttemptRef) -> float:  # the agent waits as told
    return timeout_s + body.timeout_s


def _twice(timeout_s: float, body: object) -> float:  # an apply in progress ends its payload
    return 2 * timeout_s


def _dense_load(timeout_s: float, body: object) -> float:
    return timeout_s + DENSE_S


class Call(Generic[P, Q, R]):
    """One row of :class:`AgentApi`; read from an instance, the call itself (``P -> R``).

    ``encode`` turns the handle's arguments into the request body (None: no body);
    ``decode`` turns a validated body back into the service method's arguments;
    ``wait`` gives the client's deadline for the whole call (connect, headers and body)
    from its own timeout and the body; ``answer_bytes`` bounds the answer (default: small
    for a fixed-shape body such as :class:`AgentStatus`, large for the open-ended maps).
    """

    def __init__(self, method: Literal["GET", "POST"], path: str, request: type[Q] | None,
                 response: type[R], *, encode: Callable[P, Q],
                 decode: Callable[[Q], tuple[Any, ...]] = _as_is,
                 wait: Callable[[float, Q], float] = _own, doc: str,
                 answer_bytes: int | None = None) -> None:
        self.method, self.path, self.request, self.response = method, path, request, response
        self.encode, self.decode, self.wait, self.doc = encode, decode, wait, doc
        fixed = isinstance(response, type) and issubclass(response, _Body)
        self.answer_bytes = answer_bytes or (_SMALL_ANSWER if fixed else _MAX_ANSWER)
        self.adapter: TypeAdapter[R] = TypeAdapter(response)
        self.name = ""  # the attribute name in the table: the handle's and service's method

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Call({self.name}: {self.method} {self.path})"

    @overload
    def __get__(self, obj: None, owner: type) -> Call[P, Q, R]: ...

    @overload
    def __get__(self, obj: AgentApi, owner: type) -> Callable[P, R]: ...

    def __get__(self, obj: AgentApi | None, owner: type) -> Call[P, Q, R] | Callable[P, R]:
        if obj is None:
            return self

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return obj._invoke(self, *args, **kwargs)

        call.__name__ = self.name
        return call

    def line(self) -> str:
        """The row as the module docstring lists it."""
        request = self.request.__name__ if self.request is not None else "-"
        response = (self.response.__name__ if isinstance(self.response, type)
                    else repr(self.response).replace("typing.", ""))  # dict[str, str]
        return f"{self.method:<4} {self.path:<15} {request:<12} -> {response:<14} {self.doc}"


class AgentApi:
    """The agent's calls, one row each; subclasses say how a call is carried out.

    Rows are named after the ``ReceiverHandle`` method they implement (and the
    ``AgentService`` method that serves them).
    """

    status = Call("GET", "/v1/status", None, AgentStatus, encode=_no_body,
                  doc="the weights' version, the attempt, the gate")
    prepare = Call("POST", "/v1/prepare", AttemptSpec, AgentStatus, encode=_spec,
                   doc="learn the attempt, start staging")
    close_gate = Call("POST", "/v1/gate/close", None, AgentStatus, encode=_no_body,
                      wait=_drain, doc="returns once in-flight requests end")
    open_gate = Call("POST", "/v1/gate/open", None, AgentStatus, encode=_no_body,
                     doc="refused on dirty or unknown weights")
    open_apply = Call("POST", "/v1/apply", AttemptRef, AgentStatus, encode=_ref,
                      decode=_as_key, doc="open_apply: apply in declared order")
    wait_staged = Call("POST", "/v1/staged", AttemptRef, AgentStatus, encode=_ref,
                       decode=_as_key, wait=_until_deadline,
                       doc="wait until every payload is staged")
    flush = Call("POST", "/v1/flush", AttemptRef, FlushAck, encode=_ref, decode=_as_key,
                 wait=_until_deadline, doc="wait until all applied and checked")
    committed = Call("POST", "/v1/commit", CommitRef, AgentStatus, encode=_commit,
                     decode=_as_commit, doc="the record names the attempt")
    stop_and_wait = Call("POST", "/v1/stop", AttemptRef, AgentStatus, encode=_ref_by_id,
                         decode=_as_id, wait=_twice, doc="obsolete; returns once no write can")
    rejoin = Call("POST", "/v1/dense", DenseRequest, AgentStatus, encode=_dense,
                  decode=_as_dense, wait=_dense_load, doc="restore a version by a dense load")
    profile = Call("GET", "/v1/profile", None, dict[str, Any], encode=_no_body,
                   doc="the loader's classes (ReceiverProfile)")
    fingerprint = Call("GET", "/v1/fingerprint", None, dict[str, str], encode=_no_body,
                       doc="{tensor: xxh3-128 of its integer view}")

    @staticmethod
    def calls() -> list[Call[..., Any, Any]]:
        """The rows, in declaration order."""
        return [v for v in vars(AgentApi).values() if isinstance(v, Call)]

    @classmethod
    def describe(cls) -> str:
        """The table as text, one line per call (the module docstring lists it)."""
        return "\n".join(c.line() for c in cls.calls())

    def _invoke(self, call: Call[P, Any, R], *args: P.args, **kwargs: P.kwargs) -> R:
        raise NotImplementedError(f"{type(self).__name__} does not carry out {call!r}.")


# The client keeps its connections open between calls (a refit makes ~7 calls per agent,
# the fleet poll one every interval), through urllib3's pools, one per agent address, the
# least recently used closed beyond _POOLS. As direct.OPENER does for one-shot clients:
# no redirect is followed (the token is never sent to a second address), no proxy is used,
# nothing but http(s) is opened, and an idle connection the agent closed is noticed before
# it is reused. Nothing is retried here: a call that fails is the caller's to judge.
# Each call has one deadline for all of it (dcr.http.deadline): an agent that trickles its
# answer holds the caller's thread no longer than the call's wait.
_POOLS = 4096  # agent addresses with connections kept (a fleet's receivers, and more)
_PER_AGENT = 8  # idle connections kept per agent (its concurrent calls are at most ~3)
_MAX_ERROR = 64 << 10  # bytes of an error body read for its sentence
_POOL = urllib3.PoolManager(num_pools=_POOLS, maxsize=_PER_AGENT, block=False,
                            retries=False)
_POOL.pool_classes_by_scheme = dict(POOL_CLASSES)


class AgentClient(AgentApi):
    """A ``ReceiverHandle`` over one agent's HTTP API; every row of the table is a method."""

    def __init__(self, name: str, url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self.name = name
        self.url = check_peer_url(check_url(url, f"Agent {name}"), f"Agent {name}")
        self._token = token
        self.timeout_s = timeout_s
        self.release = ""  # the DCR release the agent's last answer named ("": none yet)

    def __repr__(self) -> str:  # never the token
        return f"AgentClient({self.name!r}, {self.url!r})"

    def _invoke(self, call: Call[P, Any, R], *args: P.args, **kwargs: P.kwargs) -> R:
        body = call.encode(*args, **kwargs)
        wait_s = call.wait(self.timeout_s, body)
        where = f"({call.method} {call.path})"
        with deadline(wait_s) as limit:
            try:
                raw = self._send(call, body, limit.left)
            except AgentError as e:
                if not limit.expired or e.status is not None:
                    raise
                raise self._late(where, wait_s) from e
            if limit.expired:  # an answer without a length just ends when cut
                raise self._late(where, wait_s)
        return call.adapter.validate_json(raw)

    def _late(self, where: str, wait_s: float) -> AgentError:
        return AgentError(f"Agent {self.name} {where} did not answer within {wait_s:g} s "
                          "(a call's deadline covers its whole answer).")

    def _send(self, call: Call[..., Any, Any], body: BaseModel | None,
              left: Callable[[], float]) -> bytes:
        method, path = call.method, call.path
        where = f"({method} {path})"
        try:
            wait_s = left()
            resp = pooled_request(
                _POOL, method, self.url + path,
                body=body.model_dump_json().encode() if body is not None else None,
                headers={"Authorization": f"Bearer {self._token}",
                         "Content-Type": "application/json", **AGENT_API.headers()},
                timeout=urllib3.Timeout(connect=wait_s, read=wait_s),
                preload_content=False, redirect=False, retries=False)
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as e:
            raise self._unreachable(where, e) from e
        whole = False  # the answer read to its end: its connection may serve the next call
        try:
            self.release = release_of(resp.headers)
            AGENT_API.check_headers(resp.headers, f"Agent {self.name}'s answer {where}",
                                    lambda m: AgentError(m, None, "VersionSkew"))
            if 300 <= resp.status < 400:  # never followed: the token stays with this agent
                raise AgentError(f"Agent {self.name} {where} answered HTTP {resp.status}, a "
                                 "redirect; agent calls follow none.", resp.status)
            raw = read_bounded(resp, _MAX_ERROR if resp.status >= 400 else call.answer_bytes)
            whole = raw is not None
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as e:
            # Our side's words only: an exception about a malformed answer (a bad status
            # line, say) would quote the peer's bytes, so those show by their class name.
            raise self._unreachable(where, e) from e
        finally:
            if not whole:
                resp.close()  # unread bytes: the connection is not used again
            resp.release_conn()
        if resp.status >= 400:
            try:
                err = json.loads(raw or b"")
                msg, kind = str(err["error"]), str(err.get("kind", ""))
            except (ValueError, KeyError, TypeError):
                msg, kind = f"HTTP {resp.status}", ""
            raise AgentError(f"Agent {self.name} {where}: {msg}", resp.status, kind)
        if raw is None:
            raise AgentError(f"Agent {self.name} {where} answered more than "
                             f"{call.answer_bytes} bytes.")
        return raw

    def _unreachable(self, where: str, e: BaseException) -> AgentError:
        return AgentError(f"Agent {self.name} at {self.url} is unreachable {where}: "
                          f"{unreachable_reason(e)}.")
