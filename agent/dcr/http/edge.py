"""The HTTP edge every DCR server shares (aiohttp): the bearer guard, the status an error
answers, the JSON error body, the start and stop of a server, and ``host:port``.

Choices, and why:

- One 401 for every server: ``{"error": "Missing or wrong bearer token.", "kind":
  "Unauthorized"}`` with ``WWW-Authenticate: Bearer``, the token compared in constant time
  (:func:`~dcr.http.tokens.bearer_matches`), so no server tells a prober more than another.
- The status of a :class:`~dcr.errors.Refused` is data on its class; a server's
  :class:`Statuses` adds rows for the other errors it answers, so a test reads what each
  server answers without starting one. Anything else is a 500 whose stack goes to the log.
- Errors answer ``{"error": <sentence>, "kind": <class name>}`` (what the agent, encoder and
  member clients parse); ``dcr serve`` renders the same triple in vLLM's dialect instead.

docs/security.md, "Parties and credentials".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from dcr.errors import ConfigError, Refused
from dcr.http.tls import TlsSettings, server_context
from dcr.http.tokens import bearer_matches
from dcr.versions import VersionSkew, Wire

log = logging.getLogger(__name__)

Render = Callable[[int, str, str], web.Response]  # (status, message, kind) -> the answer
DEFAULT_HOST = "127.0.0.1"  # where a listen address without a host listens
UNAUTHORIZED = {"error": "Missing or wrong bearer token.", "kind": "Unauthorized"}


def json_error(status: int, message: str, kind: str) -> web.Response:
    """The error body every DCR client parses: ``{"error": message, "kind": kind}``."""
    return web.json_response({"error": message, "kind": kind}, status=status)


def unauthorized() -> web.Response:
    """The one 401 every DCR server answers."""
    return web.json_response(UNAUTHORIZED, status=401, headers={"WWW-Authenticate": "Bearer"})


@dataclass(frozen=True)
class Statuses:
    """What a server answers for an error its handlers raise.

    A :class:`~dcr.errors.Refused` answers its own ``status``; otherwise the first row
    whose class the error is an instance of; otherwise ``otherwise`` (None: the error
    propagates and aiohttp answers its own 500).
    """

    rows: tuple[tuple[type[BaseException], int], ...] = ()
    otherwise: int | None = 500

    def status(self, e: BaseException) -> int | None:
        if isinstance(e, Refused):
            return e.status
        return next((s for cls, s in self.rows if isinstance(e, cls)), self.otherwise)


async def answer_errors(request: web.Request, handler: Handler, statuses: Statuses,
                        render: Render = json_error) -> web.StreamResponse:
    """``handler``'s answer, or the answer for the error it raised: its sentence, or for a
    500 its class and sentence (the stack goes to the log)."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as e:
        status = statuses.status(e)
        if status is None:
            raise
        if status == 500:
            log.exception("%s %s failed", request.method, request.path)
            return render(500, f"{type(e).__name__}: {e}", type(e).__name__)
        return render(status, str(e), type(e).__name__)


def guard(token: str | None, statuses: Statuses, *, open_paths: Iterable[str] = (),
          render: Render = json_error, wire: Wire | None = None) -> Middleware:
    """A middleware: every path but ``open_paths`` needs ``Bearer <token>`` (None: no
    token is asked for), and errors answer as ``statuses`` says. With ``wire``, every
    authorized answer carries its version headers and a request of a version this build
    does not read is refused (:class:`~dcr.versions.VersionSkew`, 400) before its handler
    runs."""
    open_ = frozenset(open_paths)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        authorized = token is None or bearer_matches(request.headers.get("Authorization"),
                                                     token)  # total: never raises
        if request.path not in open_ and not authorized:
            return unauthorized()
        if wire is None:
            return await answer_errors(request, handler, statuses, render)
        return await _versioned(request, handler, statuses, render, wire)

    return middleware


async def _versioned(request: web.Request, handler: Handler, statuses: Statuses,
                     render: Render, wire: Wire) -> web.StreamResponse:
    async def checked(request: web.Request) -> web.StreamResponse:
        wire.check_headers(request.headers, "The request", VersionSkew)
        return await handler(request)

    try:
        answer = await answer_errors(request, checked, statuses, render)
    except web.HTTPException as e:
        e.headers.update(wire.headers())
        raise
    if not answer.prepared:  # a streamed answer sent its headers already
        answer.headers.update(wire.headers())
    return answer


def host_port(text: str, what: str, *, default_host: str | None = DEFAULT_HOST
              ) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; a missing host is ``default_host`` (None: an
    error). :class:`ConfigError` says ``what`` (e.g. "--listen") and the value otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host or (default_host or "")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT.")
    return host, int(port)


@dataclass(frozen=True)
class Listening:
    """A started server: its runner (``close`` stops it) and where it listens."""

    runner: web.AppRunner
    host: str  # as given, brackets and all: what a URL names
    port: int  # as bound (a port 0 asked for any)
    scheme: str = "http"  # https when it serves TLS

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def start(app: web.Application, listen: str, what: str, *,
                handler_cancellation: bool = True, shutdown_timeout: float = 60.0,
                reuse_address: bool | None = None, tls: TlsSettings | None = None
                ) -> Listening:
    """Serve ``app`` on ``listen`` (``host:port``; port 0 picks a free one), without an
    access log, over HTTPS only when ``tls`` (default: the environment's,
    :mod:`dcr.http.tls`) has a certificate. ``handler_cancellation``: a handler is cancelled
    when its client leaves. :class:`ConfigError` names ``what`` when the address is
    malformed or taken, or the certificate does not load."""
    host, port = host_port(listen, f"{what}: the listen address")
    tls = tls or TlsSettings.from_env()
    context = server_context(tls)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host.strip("[]"), port, reuse_address=reuse_address,
                          ssl_context=context).start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"{what} cannot listen on {listen}: {e}.") from e
    return Listening(runner, host, int(runner.addresses[0][1]), tls.scheme)


__all__ = ["DEFAULT_HOST", "UNAUTHORIZED", "Listening", "Render", "Statuses", "answer_errors",
           "guard", "host_port", "json_error", "start", "unauthorized"]
