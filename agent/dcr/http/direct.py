"""HTTP(S) straight to one peer: the opener every DCR client that carries a credential uses.

:data:`OPENER` follows no redirect (a credential never reaches a second address), uses no
proxy and has no ``file:``, ``ftp:`` or ``data:`` handler; :func:`check_url` admits only
``http(s)://host``; HTTPS verifies peers as :mod:`dcr.http.tls` says. A peer's answer is
read bounded and quoted only as a short printable :func:`excerpt`. Stdlib-only, at the
bottom layer.
"""

from __future__ import annotations

import http.client
import re
import urllib.parse
import urllib.request
from typing import Protocol

from dcr.errors import ConfigError
from dcr.http.tls import VerifiedHTTPSConnection, refusal


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(VerifiedHTTPSConnection, req)


OPENER = urllib.request.OpenerDirector()
for _handler in (urllib.request.HTTPHandler(), _HTTPSHandler(),
                 urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor(),
                 urllib.request.UnknownHandler()):
    OPENER.add_handler(_handler)

EXCERPT_CHARS = 240  # characters of a peer's message a sentence quotes
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]+")


def check_url(url: str, what: str) -> str:
    """``url`` without a trailing slash, if it is ``http(s)://`` with a host; else
    :class:`ConfigError` naming ``what`` ("vLLM engine", "agent r0")."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what}: {url!r} is not an http:// or https:// URL with a host; "
                          "it is reached over HTTP(S) only.")
    return url.rstrip("/")


class Readable(Protocol):
    def read(self, amt: int, /) -> bytes: ...


def read_bounded(resp: Readable, limit: int) -> bytes | None:
    """At most ``limit`` bytes of ``resp``; None when it holds more."""
    raw = bytes(resp.read(limit + 1))
    return None if len(raw) > limit else raw


def excerpt(text: str | bytes, limit: int = EXCERPT_CHARS) -> str:
    """A printable, single-line, bounded excerpt of what a peer said."""
    if isinstance(text, bytes):
        text = text[: 4 * limit].decode("utf-8", "replace")
    flat = _UNPRINTABLE.sub("?", " ".join(text[: 4 * limit].split()))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def unreachable_reason(e: BaseException) -> str:
    """Why a call got no answer, without the peer's bytes: a TLS refusal's sentence, or an
    OS error's text or the exception's class name, of the innermost error a client library
    wrapped."""
    while (said := refusal(e)) is None and (inner := e.__cause__ or next(
            (a for a in e.args if isinstance(a, BaseException)), None)) is not None:
        e = inner  # urllib's URLError(reason), urllib3's ProtocolError("...", error), ...
    if said is not None:
        return said
    reason = getattr(e, "reason", e)
    if isinstance(reason, str):
        return excerpt(reason, 80)
    return str(getattr(reason, "strerror", None) or type(reason).__name__)


__all__ = ["EXCERPT_CHARS", "OPENER", "check_url", "excerpt", "read_bounded",
           "unreachable_reason"]
