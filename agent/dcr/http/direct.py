"""HTTP(S) straight to one peer: the opener every DCR client that carries a credential uses.

A bearer token or API key must reach the peer it was given for and nothing else, and
what the peer answers must not flood a log or the caller's memory. :data:`OPENER` has
no redirect handler (a 3xx is an error: the credential is never sent to a second
address), no proxy handler (no environment variable reroutes calls that carry it) and
no ``file:``, ``ftp:`` or ``data:`` handlers (any other scheme reaches
``UnknownHandler``: "unknown url type"). :func:`check_url` refuses anything but an
``http://`` or ``https://`` URL with a host before a client is built;
:func:`read_bounded` reads at most a limit; :func:`excerpt` turns a peer's bytes into a
short printable string a sentence may quote; :func:`unreachable_reason` says why a call
got no answer in our own words (an exception about a malformed answer would quote the
peer's bytes).

Torch-free and stdlib-only, at the bottom layer, so the engine adapters
(:mod:`dcr.drivers`) and the agent client (:class:`dcr.protocol.agent_api.AgentClient`)
use it.
"""

from __future__ import annotations

import re
import urllib.parse
import urllib.request
from typing import IO

from dcr.errors import ConfigError

OPENER = urllib.request.OpenerDirector()
for _handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
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


def read_bounded(resp: IO[bytes], limit: int) -> bytes | None:
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
    """Why a call got no answer, without the peer's bytes: an OS error's text or the
    exception's class name."""
    reason = getattr(e, "reason", e)
    if isinstance(reason, str):
        return excerpt(reason, 80)
    return str(getattr(reason, "strerror", None) or type(reason).__name__)


__all__ = ["EXCERPT_CHARS", "OPENER", "check_url", "excerpt", "read_bounded",
           "unreachable_reason"]
