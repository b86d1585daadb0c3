"""One JSON-over-HTTP conversation with a serving engine, for both engine adapters.

:class:`JsonHttp` sends a call's body with the engine's API key through
:data:`dcr.http.direct.OPENER` and returns the parsed answer. Every failure is an
:class:`~dcr.drivers.errors.EngineError` sentence quoting the engine's own message (vLLM's,
FastAPI's or SGLang's shape) as a bounded excerpt, never its body.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from dcr.drivers.errors import BadAnswer, EngineError
from dcr.errors import ConfigError
from dcr.http.direct import OPENER, check_url, excerpt, read_bounded, unreachable_reason
from dcr.versions import Wire

MAX_ANSWER = 256 << 20  # bytes of one answer (every rank's fingerprints of a large model)
MAX_ERROR = 64 << 10  # bytes of an error body read for its message


def _message(raw: bytes) -> str:
    """The message an engine's error body carries, as an excerpt; '' without one."""
    try:
        body = json.loads(raw)
    except ValueError:
        return excerpt(raw) if raw.strip() else ""
    if not isinstance(body, dict):
        return excerpt(str(body))
    for key in ("error", "detail", "message"):
        value = body.get(key)
        if isinstance(value, dict):
            value = value.get("message", value)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            value = value[0].get("msg", value[0])  # FastAPI's validation list
        if value:
            return excerpt(str(value))
    return ""


class JsonHttp:
    """Calls to one engine at ``url``; ``what`` names it in sentences ("vLLM engine").
    With ``wire`` (a DCR API, not an engine's), requests carry its version headers and an
    answer of a version this build does not read is refused by name."""

    def __init__(self, what: str, url: str, api_key: str | None = None, *,
                 wire: Wire | None = None) -> None:
        self.what, self.wire = what, wire
        self.url = check_url(url, what)
        if api_key is not None and not (api_key and all("!" <= c <= "~" for c in api_key)):
            raise ConfigError(f"{what}: the API key must be printable ASCII without spaces "
                              "(it travels in an Authorization header).")
        self._api_key = api_key

    def __repr__(self) -> str:  # never the key
        return f"JsonHttp({self.what!r}, {self.url!r})"

    def call(self, call: str, method: str, path: str, body: Any = None, *,
             timeout_s: float, query: dict[str, str] | None = None) -> Any:
        """The parsed JSON answer of ``method path`` (None for an empty answer).

        ``call`` names the operation in errors ("pause", "apply").
        """
        raw, where = self._send(call, method, path, body, timeout_s=timeout_s, query=query)
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise BadAnswer(f"{where} answered something that is not JSON: "
                            f"{excerpt(raw, 80)}", call=call) from None

    def ok(self, path: str, *, timeout_s: float) -> bool:
        """Whether ``GET path`` answers 2xx (False for an error status or no answer)."""
        try:
            self._send("health", "GET", path, None, timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    def _send(self, call: str, method: str, path: str, body: Any, *, timeout_s: float,
              query: dict[str, str] | None = None) -> tuple[bytes, str]:
        """The answer's bytes and the phrase naming the call, or :class:`EngineError`."""
        endpoint = path + ("?" + urllib.parse.urlencode(query) if query else "")
        where = f"{self.what} at {self.url}: {call} ({method} {endpoint})"
        headers = {"Content-Type": "application/json", "Accept": "application/json",
                   **(self.wire.headers() if self.wire else {})}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + endpoint, data=data, method=method,
                                     headers=headers)
        try:
            with OPENER.open(req, timeout=timeout_s) as resp:
                self._check_version(dict(resp.headers.items()), where, call)
                raw = read_bounded(resp, MAX_ANSWER)
        except urllib.error.HTTPError as e:
            with e:  # closes the connection
                self._check_version(dict(e.headers.items()), where, call)
                if 300 <= e.code < 400:
                    raise EngineError(f"{where} answered HTTP {e.code}, a redirect; engine "
                                      "calls follow none.", e.code, call=call) from None
                try:
                    said = _message(e.read(MAX_ERROR))
                except OSError:
                    said = ""
            raise EngineError(f"{where} answered HTTP {e.code}" + (f": {said}" if said else
                              "."), e.code, call=call) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            raise EngineError(f"{where}: no answer ({unreachable_reason(e)}).",
                              call=call) from e
        if raw is None:
            raise BadAnswer(f"{where} answered more than {MAX_ANSWER} bytes.", call=call)
        return raw, where

    def _check_version(self, headers: dict[str, str], where: str, call: str) -> None:
        if self.wire is not None:
            self.wire.check_headers(headers, f"The answer of {where}",
                                    lambda m: EngineError(m, call=call))


__all__ = ["MAX_ANSWER", "JsonHttp"]
