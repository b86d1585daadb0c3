"""The warm encoder's HTTP API (``dcr encoder``), declared once: bodies and a client.

``POST /v1/publish`` has :mod:`dcr.owner.server` do what ``dcr encode`` does for those
arguments; ``POST /v1/stop`` ends an attempt's publishes; ``POST /v1/snapshot`` has a
trainer rank write its part of a committed version's snapshot from memory (an encoder of
checkpoints answers 400: ``dcr snapshot`` reads those); every call but ``GET /healthz``
needs the bearer token. Errors are ``{"error", "kind"}``; :class:`EncoderError` carries the
sentence. Torch-free, for the operator. A publish's socket timeout comes from the caller,
since it lasts as long as its attempt may. docs/publishing.md, "Warm encoder".
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dcr.errors import HttpError, first_validation_error
from dcr.format.history import RankPart
from dcr.format.names import ATTEMPT_PATTERN, Mode
from dcr.format.profile import ReceiverProfile
from dcr.http.direct import OPENER, check_url, read_bounded, unreachable_reason
from dcr.http.tls import check_peer_url
from dcr.versions import ENCODER_API

MAX_BODY_BYTES = 64 << 20  # a publish body: the merged profile names every tensor
MAX_PATH_CHARS = 4096
MAX_OWNERS = 256  # as a WeightRefit's spec.encoder.owners
_MAX_ANSWER = 1 << 20  # bytes of one answer (a summary is a few hundred)
_MAX_PART = 32 << 20  # a snapshot part lists each of a rank's regions (~100 B each)
_MAX_ERROR = 64 << 10  # bytes of an error body read for its sentence


class EncoderError(HttpError):
    """A warm encoder refused a call or could not be reached; ``status`` is the HTTP
    status (None without an answer)."""

    def __init__(self, message: str, status: int | None = None, kind: str = "") -> None:
        super().__init__(message, status)
        self.kind = kind


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


CheckpointPath = Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]


class PublishRequest(_Body):
    """One owner's part of one attempt: what ``dcr encode`` is told on its command line.

    ``base`` is the committed version's checkpoint (the baseline), ``target`` the
    candidate's; both absolute paths the server resolves under its checkpoint roots.
    ``profile`` is the receivers' merged profile (None: everything XOR where the mode
    allows). ``committed_attempt`` is the attempt the fleet's commit record names for
    ``base_version`` (None for the initial record): an owner that keeps its own baseline
    (a trainer rank) advances by it. No store: the server's is fixed.
    """

    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)]
    mode: Mode
    base_version: Annotated[int, Field(ge=0)]
    target_version: Annotated[int, Field(ge=1)]
    owner: Annotated[int, Field(ge=0)] = 0
    owners: Annotated[int, Field(ge=1, le=MAX_OWNERS)] = 1
    base: CheckpointPath
    target: CheckpointPath
    bucket_mib: Annotated[int, Field(ge=1, le=4096)] | None = None
    profile: ReceiverProfile | None = None
    committed_attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> PublishRequest:
        if self.owner >= self.owners:
            raise ValueError(f"owner {self.owner} is outside 0..{self.owners - 1}")
        if self.target_version <= self.base_version:
            raise ValueError(f"target_version {self.target_version} is not greater than "
                             f"base_version {self.base_version}")
        for field in ("base", "target"):
            path = getattr(self, field)
            if not path.startswith("/") or "\x00" in path:
                raise ValueError(f"{field} {path!r} is not an absolute path")
        return self


class SnapshotRequest(_Body):
    """Owner ``owner`` of ``owners``: write your part of ``version``'s snapshot, from the
    committed baseline (advancing first by ``committed_attempt``, the attempt the commit
    record names for ``version``)."""

    version: Annotated[int, Field(ge=0)]
    owner: Annotated[int, Field(ge=0)] = 0
    owners: Annotated[int, Field(ge=1, le=MAX_OWNERS)] = 1
    committed_attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)] | None = None

    @model_validator(mode="after")
    def _an_owner(self) -> SnapshotRequest:
        if self.owner >= self.owners:
            raise ValueError(f"owner {self.owner} is outside 0..{self.owners - 1}")
        return self


class StopRequest(_Body):
    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)]


class StopAnswer(_Body):
    attempt: str
    stopped: int  # publishes of the attempt that were running and have now ended
    running: int  # publishes of the attempt still running when the wait ran out


class EncoderClient:
    """One warm encoder endpoint, called with a bearer token; never follows a redirect."""

    def __init__(self, url: str, token: str, *, name: str = "encoder") -> None:
        self.name = name
        self.url = check_peer_url(check_url(url, f"Encoder endpoint {name}"),
                                  f"Encoder endpoint {name}")
        self._token = token

    def __repr__(self) -> str:  # never the token
        return f"EncoderClient({self.name!r}, {self.url!r})"

    def publish(self, request: PublishRequest, *, timeout_s: float) -> dict[str, Any]:
        """The summary ``dcr encode --json`` prints, once the payloads and the manifest
        part are written; waits at most ``timeout_s``."""
        raw = self._send("/v1/publish", request, timeout_s=timeout_s)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise EncoderError(f"Encoder endpoint {self.name} answered a publish with "
                               "something else than a JSON summary object.")
        return answer

    def snapshot(self, request: SnapshotRequest, *, timeout_s: float) -> RankPart:
        """The part of the snapshot this rank wrote; waits at most ``timeout_s``."""
        raw = self._send("/v1/snapshot", request, timeout_s=timeout_s, limit=_MAX_PART)
        try:
            part = RankPart.model_validate_json(raw, strict=True)
        except ValidationError as e:
            raise EncoderError(f"Encoder endpoint {self.name} answered a snapshot with "
                               f"something else than a rank's part "
                               f"({first_validation_error(e)}).") from e
        if part.rank != request.owner:
            raise EncoderError(f"Encoder endpoint {self.name} answered a snapshot for owner "
                               f"{request.owner} with rank {part.rank}'s part.")
        return part

    def stop(self, attempt: str, *, timeout_s: float = 60.0) -> StopAnswer:
        raw = self._send("/v1/stop", StopRequest(attempt=attempt), timeout_s=timeout_s)
        try:
            return StopAnswer.model_validate_json(raw)
        except ValidationError as e:
            raise EncoderError(f"Encoder endpoint {self.name} answered a stop with something "
                               f"else than a stop answer ({first_validation_error(e)}).") from e

    def _send(self, path: str, body: BaseModel, *, timeout_s: float,
              limit: int = _MAX_ANSWER) -> bytes:
        req = urllib.request.Request(
            self.url + path, data=body.model_dump_json().encode(), method="POST",
            headers={"Authorization": f"Bearer {self._token}",
                     "Content-Type": "application/json", **ENCODER_API.headers()})
        where = f"Encoder endpoint {self.name} (POST {path})"
        try:
            with OPENER.open(req, timeout=timeout_s) as resp:
                self._check_version(dict(resp.headers.items()), where)
                raw = read_bounded(resp, limit)
        except urllib.error.HTTPError as e:
            with e:  # closes the connection
                self._check_version(dict(e.headers.items()), where)
                if 300 <= e.code < 400:  # never followed: the token stays with this peer
                    raise EncoderError(f"{where} answered HTTP {e.code}, a redirect; encoder "
                                       "calls follow none.", e.code) from None
                try:
                    err = json.loads(e.read(_MAX_ERROR))
                    msg, kind = str(err["error"]), str(err.get("kind", ""))
                except (ValueError, KeyError, TypeError, OSError):
                    msg, kind = f"HTTP {e.code}", ""
            raise EncoderError(f"{where}: {msg}", e.code, kind) from e
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            raise EncoderError(f"{where} at {self.url} got no answer: "
                               f"{unreachable_reason(e)}.") from e
        if raw is None:
            raise EncoderError(f"{where} answered more than {limit} bytes.")
        return raw

    @staticmethod
    def _check_version(headers: Mapping[str, str], where: str) -> None:
        """Refuse an answer in an encoder-API version this build does not read; our own
        sentence (status None), as status shows it (the version only when a number)."""
        ENCODER_API.check_headers(headers, f"The answer of {where}",
                                  lambda m: EncoderError(m, None, "VersionSkew"))


__all__ = ["MAX_BODY_BYTES", "EncoderClient", "EncoderError", "PublishRequest",
           "SnapshotRequest", "StopAnswer", "StopRequest"]
