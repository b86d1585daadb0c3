"""The agent's HTTP control API: request and response bodies, and a client.

The agent (``dcr agent``, one per rollout rank) serves these; the local coordinator
and the Kubernetes operator call them through :class:`AgentClient`, which is a
``ReceiverHandle``. Torch-free, so the operator can import it.

Every control call carries ``Authorization: Bearer <token>``. Errors come back as
``{"error": sentence, "kind": class name}`` with 400 (bad body), 401 (token), 409
(wrong attempt, state or version), 422 (the attempt failed on this agent) or 500, and
the client raises
:class:`AgentError` with the sentence. ``/healthz``, ``/readyz`` and ``/metrics`` need
no token.

::

    POST /v1/prepare      AttemptSpec          -> AgentStatus   learn the attempt, start staging
    POST /v1/gate/close   {}                   -> AgentStatus   returns once in-flight requests end
    POST /v1/gate/open    {}                   -> AgentStatus
    POST /v1/apply        AttemptRef           -> AgentStatus   open_apply: apply in declared order
    POST /v1/staged       AttemptRef+timeout   -> AgentStatus   wait until every payload is staged
    POST /v1/flush        AttemptRef+timeout   -> FlushAck      wait until all applied and checked
    POST /v1/commit       AttemptRef           -> AgentStatus   the record names the attempt
    POST /v1/stop         AttemptRef           -> AgentStatus   obsolete; returns once no write can
    POST /v1/dense        DenseRequest         -> AgentStatus   restore a version by a dense load
    GET  /v1/status                            -> AgentStatus
    GET  /v1/profile                           -> ReceiverProfile JSON (the loader's classes)
    GET  /v1/fingerprint                       -> {tensor: xxh3-128 of its integer view}
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr.errors import DcrError
from dcr.format.payload import Mode
from dcr.protocol.records import Attempt

_ATTEMPT = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class AgentError(DcrError):
    """An agent refused a call or could not be reached; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class AttemptSpec(_Body):
    attempt: Annotated[str, Field(pattern=_ATTEMPT)]
    base_version: Annotated[int, Field(ge=0)]
    target_version: Annotated[int, Field(ge=1)]
    mode: Mode
    owners: Annotated[int, Field(ge=1, le=4096)] = 1
    deadline: float  # time.time() seconds

    @classmethod
    def of(cls, a: Attempt) -> AttemptSpec:
        t = a.transition
        return cls(attempt=a.id, base_version=t.base_version, target_version=t.target_version,
                   mode=a.mode, owners=a.owners, deadline=a.deadline)


class AttemptRef(_Body):
    attempt: Annotated[str, Field(pattern=_ATTEMPT)]
    timeout_s: Annotated[float, Field(gt=0, le=86400)] = 600.0


class DenseRequest(_Body):
    version: Annotated[int, Field(ge=0)]
    checkpoint: Annotated[str, Field(min_length=1)]  # a directory of the version's safetensors


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
    apply_s: float  # seconds spent inside the apply engine
    wait_s: float  # seconds the flush call waited


class BadRequest(ValueError):
    """A request body failed validation (the message names the field)."""


def parse_body(model: type[_Body], data: bytes) -> Any:
    """Validate a JSON request body strictly; :class:`BadRequest` names the bad field."""
    try:
        return model.model_validate_json(data or b"{}")
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        raise BadRequest(f"{model.__name__}: {loc}: {err['msg']}") from e


class AgentClient:
    """A ``ReceiverHandle`` over one agent's HTTP API."""

    def __init__(self, name: str, url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def __repr__(self) -> str:  # never the token
        return f"AgentClient({self.name!r}, {self.url!r})"

    def _call(self, method: str, path: str, body: _Body | None = None,
              *, timeout_s: float | None = None) -> Any:
        return json.loads(self._raw(method, path, body, timeout_s=timeout_s))

    def _raw(self, method: str, path: str, body: _Body | None = None,
             *, timeout_s: float | None = None) -> bytes:
        data = body.model_dump_json().encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self._token}",
                     "Content-Type": "application/json"},
        )
        wait = (timeout_s or 0) + self.timeout_s
        try:
            with urllib.request.urlopen(req, timeout=wait) as resp:
                return bytes(resp.read())
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read())
                msg, kind = str(err["error"]), str(err.get("kind", ""))
            except (ValueError, KeyError, TypeError):
                msg, kind = f"HTTP {e.code}", ""
            raise AgentError(f"Agent {self.name} ({method} {path}): {msg}", e.code, kind) from e
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise AgentError(f"Agent {self.name} at {self.url} is unreachable ({method} "
                             f"{path}): {reason}.") from e

    def _status(self, method: str, path: str, body: _Body | None = None,
                *, timeout_s: float | None = None) -> AgentStatus:
        return AgentStatus.model_validate_json(self._raw(method, path, body, timeout_s=timeout_s))

    # --- ReceiverHandle ------------------------------------------------------------

    def status(self) -> AgentStatus:
        return self._status("GET", "/v1/status")

    def prepare(self, attempt: Attempt) -> None:
        self._status("POST", "/v1/prepare", AttemptSpec.of(attempt))

    def close_gate(self) -> None:
        # The agent waits up to 60 s for generation requests in flight to end.
        self._status("POST", "/v1/gate/close", timeout_s=60.0)

    def open_gate(self) -> None:
        self._status("POST", "/v1/gate/open")

    def open_apply(self, attempt: Attempt) -> None:
        self._status("POST", "/v1/apply", AttemptRef(attempt=attempt.id))

    def wait_staged(self, attempt: Attempt) -> None:
        timeout = max(0.1, attempt.deadline - time.time())
        self._status("POST", "/v1/staged", AttemptRef(attempt=attempt.id, timeout_s=timeout),
                     timeout_s=timeout)

    def flush(self, attempt: Attempt) -> FlushAck:
        timeout = max(0.1, attempt.deadline - time.time())
        raw = self._raw("POST", "/v1/flush", AttemptRef(attempt=attempt.id, timeout_s=timeout),
                        timeout_s=timeout)
        return FlushAck.model_validate_json(raw)

    def committed(self, attempt: str) -> None:
        self._status("POST", "/v1/commit", AttemptRef(attempt=attempt))

    def stop_and_wait(self, attempt: str) -> None:
        self._status("POST", "/v1/stop", AttemptRef(attempt=attempt), timeout_s=self.timeout_s)

    def rejoin(self, version: int, checkpoint: str) -> None:
        self._status("POST", "/v1/dense", DenseRequest(version=version, checkpoint=checkpoint),
                     timeout_s=600.0)

    # --- inspection ----------------------------------------------------------------

    def profile(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/profile"))

    def fingerprint(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._call("GET", "/v1/fingerprint").items()}
