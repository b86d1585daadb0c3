"""What a client may ask of the engine, shared by every place that admits clients: the
agent's client door (:mod:`dcr.http.gateway`), the guard inside ``vllm serve``
(:mod:`dcr.http.engine_guard`) and ``dcr serve`` (:mod:`dcr.serve.server`).

Pure: no HTTP framework, so the guard imports it with only vLLM's own dependencies. It holds
the client routes, the staleness headers and their rules (docs/client-door.md, "Staleness a
trainer can bound"), the answers the three give, and the counters they keep.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dcr.errors import Invalid, StateConflict
from dcr.http.prometheus import Family

CLIENT_ROUTES: tuple[str, ...] = (
    "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
    "GET /metrics")
"""What rollout clients call by default (the door's ``--client-route``, the guard's
``DCR_ENGINE_CLIENT_ROUTES``); ``/metrics`` is the engine's, for Prometheus to scrape."""

MIN_VERSION = "X-DCR-Min-Version"  # the oldest committed version the request accepts
MAX_SPAN = "X-DCR-Max-Version-Span"  # the most versions its answer may span under keep
OURS = frozenset({MIN_VERSION.lower(), MAX_SPAN.lower()})  # never passed to the engine
Version = Callable[[], int | None]  # the engine's committed version now (None: unknown)
Header = Callable[[str], str | None]  # a request header's (first) value by name

OUTCOMES = {
    "forwarded": "the engine's answer passed to the client, whatever its status",
    "not_served": "404: not a client route",
    "bad_request": "400: a malformed X-DCR header",
    "stale": "409: the committed version is older than X-DCR-Min-Version",
    "span_exceeded": "ended: a refit took the version past X-DCR-Max-Version-Span",
    "unreachable": "502: the engine did not answer",
    "client_gone": "the client left before the answer ended",
}


def parse_routes(routes: Iterable[str]) -> frozenset[tuple[str, str]]:
    """``"METHOD /path"`` entries as (method, path) pairs; ValueError naming a bad one."""
    out = set()
    for route in routes:
        method, _, path = route.partition(" ")
        if not method.isalpha() or not method.isupper() or not path.startswith("/") or (
                " " in path or "?" in path or "#" in path):
            raise ValueError(f"client route {route!r} is not 'METHOD /path' (an exact path)")
        out.add((method, path))
    return frozenset(out)


def not_served(method: str, path: str) -> tuple[int, dict[str, str]]:
    """The 404 every client guard answers for a request that is not a client route."""
    return 404, {"error": f"{method} {path} is not served to clients here",
                 "kind": "NotServed"}


class BadVersionHeader(Invalid):
    """A staleness header is not a version number (400)."""

    kind, outcome = "BadRequest", "bad_request"


class StaleVersion(StateConflict):
    """The engine's committed version is older than the request accepts (409)."""

    kind, outcome = "StaleVersion", "stale"


def _header_int(header: Header, name: str) -> int | None:
    text = header(name)
    if text is None:
        return None
    if not text.strip().isdigit():
        raise BadVersionHeader(f"{name} {text[:40]!r} is not a version number (0 or more).")
    return int(text)


@dataclass(frozen=True)
class Bound:
    """A request's staleness bound: the version it started on and how far it may span."""

    start: int | None
    span: int | None

    def exceeded(self, now: int | None) -> str | None:
        """Why the answer must end now that the committed version is ``now``; None: it
        may go on."""
        if self.span is None or self.start is None or now is None or (
                now - self.start <= self.span):
            return None
        return (f"a refit under keep took the committed version from {self.start} to {now}, "
                f"more than the {self.span} versions X-DCR-Max-Version-Span allows; the "
                "answer would mix them")


def admit(header: Header, version: Version | None, keep: bool) -> Bound:
    """The request's bound. Raises :class:`BadVersionHeader` if its headers are malformed,
    :class:`StaleVersion` if the committed version is older than it accepts."""
    least, span = _header_int(header, MIN_VERSION), _header_int(header, MAX_SPAN)
    now = version() if version is not None else None
    if least is not None and (now is None or now < least):
        raise StaleVersion(f"The engine's committed version is "
                           f"{'unknown' if now is None else now}; the request accepts "
                           f"{least} or newer ({MIN_VERSION}).")
    return Bound(now, span if keep else None)


def ended_message(reason: str) -> str:
    return f"The request was ended: {reason}."


def span_event(reason: str) -> bytes:
    """The last event of a stream ended by its bound (no ``[DONE]`` follows it)."""
    error = {"error": {"message": ended_message(reason), "type": "VersionSpanExceeded",
                       "code": 409}}
    return f"data: {json.dumps(error)}\n\n".encode()


def label_version(label: str | None) -> int | None:
    """The committed version a weight-version label names (DCR sets ``str(version)``);
    None for any other label."""
    text = (label or "").strip()
    return int(text) if text.isdigit() else None


@dataclass
class ClientCounters:
    """What a client guard has done since it started; ``prefix`` names its series
    (``dcr_door`` on the agent's ``/metrics``, ``dcr_guard`` on the engine's)."""

    prefix: str = "dcr_door"
    requests: dict[str, int] = field(default_factory=dict)  # by outcome (OUTCOMES)
    in_flight: int = 0
    bytes_in: int = 0  # request body bytes passed to the engine
    bytes_out: int = 0  # answer body bytes passed to clients

    def ended(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def families(self) -> list[Family]:
        p = self.prefix
        return [
            Family(f"{p}_requests_total", "counter", "Client requests ended, by outcome: "
                   + ", ".join(f"{k} ({v})" for k, v in OUTCOMES.items()) + ".",
                   [({"outcome": k}, self.requests.get(k, 0)) for k in OUTCOMES]),
            Family(f"{p}_requests_in_flight", "gauge", "Client requests under way now.",
                   [({}, self.in_flight)]),
            Family(f"{p}_errors_total", "counter", "Client requests answered with an error "
                   "of DCR's own (every outcome but forwarded).",
                   [({}, sum(v for k, v in self.requests.items() if k != "forwarded"))]),
            Family(f"{p}_bytes_total", "counter", "Body bytes passed, by direction (in: to "
                   "the engine, out: to clients).",
                   [({"direction": "in"}, self.bytes_in),
                    ({"direction": "out"}, self.bytes_out)]),
        ]


__all__ = ["CLIENT_ROUTES", "MAX_SPAN", "MIN_VERSION", "OURS", "OUTCOMES", "BadVersionHeader",
           "Bound", "ClientCounters", "Header", "StaleVersion", "Version", "admit",
           "ended_message", "label_version", "not_served", "parse_routes", "span_event"]
