"""The member API: how a group's leader agent has its worker pods' agents stage payloads.

A replica spanning pods (a leader pod with the engine's HTTP server, worker pods with more
of its ranks) is one receiver, driven through the leader's agent. Every rank reads staged
payloads from its own pod's staging directory, so each worker pod runs an agent in the
``member`` role: told an attempt, it fetches, verifies and stages every payload of it from
the store, as the leader's agent does; the leader applies a payload once every member
has staged it, then releases it there. For a dense load each member builds the version
from the store's history under its own checkpoint root. docs/replica-groups.md, "Replicas
across pods".

    POST /v1/member/stage    AttemptSpec               -> MemberStatus
    GET  /v1/member/status   ?attempt=A                -> MemberStatus
    POST /v1/member/release  {attempt, names}          -> MemberStatus
    POST /v1/member/end      {attempt}                 -> MemberStatus
    POST /v1/member/dense    {version, history_digest} -> {"checkpoint": relative path}

The leader passes on what the coordinator gave it: the attempt's history digest with the
attempt, the committed record's with a dense load (``history_digest``, left out of the
JSON when it has none, so members that predate it take the call), so a member reads only
the history the commit record vouches for.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr.drivers.base import check_staged_name
from dcr.drivers.errors import EngineError
from dcr.drivers.http import JsonHttp
from dcr.errors import HttpError, first_validation_error
from dcr.format.names import ATTEMPT_PATTERN, DIGEST_PATTERN
from dcr.protocol.agent_api import AttemptSpec
from dcr.versions import MEMBER_API

MAX_NAMES = 1 << 16  # staged names in one answer or release


class MemberError(HttpError):
    """A member agent refused a call, answered something else, or did not answer."""


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class MemberStatus(_Body):
    """What a member holds of an attempt: the payload files staged and not yet released,
    whether every payload of it has arrived, and why it failed if it did."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)] | None = None
    staged: Annotated[list[str], Field(max_length=MAX_NAMES)] = []
    received: bool = False
    error: Annotated[str, Field(max_length=2048)] | None = None


class Release(_Body):
    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)]
    names: Annotated[list[str], Field(max_length=MAX_NAMES)]

    def checked(self) -> Release:
        for n in self.names:
            check_staged_name(n)
        return self


class End(_Body):
    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)]


class Dense(_Body):
    version: Annotated[int, Field(ge=0)]
    history_digest: Annotated[str | None, Field(pattern=DIGEST_PATTERN)] = Field(
        default=None, exclude_if=lambda d: d is None)


class Built(_Body):
    checkpoint: Annotated[str, Field(min_length=1, max_length=4096)]


def parse(model: type[Any], raw: bytes | dict[str, Any]) -> Any:
    """A body or an answer as ``model``, or :class:`MemberError` naming the field."""
    try:
        if isinstance(raw, dict):
            return model.model_validate(raw)
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise MemberError(f"Not a {model.__name__}: {first_validation_error(e)}.") from None


class MemberClient:
    """The leader's side of one member agent at ``url``."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self.http = JsonHttp("member agent", url, token, wire=MEMBER_API)
        self.url = self.http.url
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"MemberClient({self.url!r})"

    def _call(self, call: str, method: str, path: str, body: Any = None, *,
              query: dict[str, str] | None = None, timeout_s: float | None = None) -> Any:
        try:
            return self.http.call(call, method, path, body, query=query,
                                  timeout_s=timeout_s or self.timeout_s)
        except EngineError as e:
            raise MemberError(f"member {self.url}: {call}: {e}") from e

    def stage(self, spec: AttemptSpec) -> MemberStatus:
        answer = self._call("stage", "POST", "/v1/member/stage", spec.model_dump(mode="json"))
        return self._status("stage", answer)

    def status(self, attempt: str) -> MemberStatus:
        answer = self._call("status", "GET", "/v1/member/status", query={"attempt": attempt})
        return self._status("status", answer)

    def release(self, attempt: str, names: list[str]) -> MemberStatus:
        answer = self._call("release", "POST", "/v1/member/release",
                            {"attempt": attempt, "names": names})
        return self._status("release", answer)

    def end(self, attempt: str) -> MemberStatus:
        return self._status("end", self._call("end", "POST", "/v1/member/end",
                                              {"attempt": attempt}))

    def dense(self, version: int, timeout_s: float, history_digest: str | None = None
              ) -> str:
        body = Dense(version=version, history_digest=history_digest)
        answer = self._call("dense", "POST", "/v1/member/dense", body.model_dump(mode="json"),
                            timeout_s=timeout_s)
        built: Built = self._parse("dense", Built, answer)
        return built.checkpoint

    def _status(self, call: str, answer: Any) -> MemberStatus:
        status: MemberStatus = self._parse(call, MemberStatus, answer)
        return status

    def _parse(self, call: str, model: type[Any], answer: Any) -> Any:
        if not isinstance(answer, dict):
            raise MemberError(f"member {self.url}: {call} answered no JSON object.")
        try:
            return parse(model, answer)
        except MemberError as e:
            raise MemberError(f"member {self.url}: {call}: {e}") from None


__all__ = ["Built", "Dense", "End", "MemberClient", "MemberError", "MemberStatus", "Release",
           "parse"]
