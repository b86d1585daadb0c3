"""A small synchronous Kubernetes API client for the coordinator's thread.

kopf talks to the API server asynchronously from its event loop; the coordinator
(:class:`dcr.protocol.coordinator.Coordinator`) is synchronous and runs in a thread, and
its commit store, owner handles and progress recorder need plain blocking calls. This
client is that: JSON over HTTPS with ``urllib``, credentials from the same
``kopf.ConnectionInfo`` kopf logged in with (a kubeconfig or the pod's ServiceAccount),
re-read through ``login`` after a 401 (bound ServiceAccount tokens rotate).

Errors: a refused request raises :class:`ApiError` (``NotFound`` for 404, ``Conflict``
for 409) with the server's message; no answer at all raises :class:`ApiUnreachable`,
after which the fate of a write is unknown.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dcr_operator.errors import ApiError, ApiUnreachable, Conflict, InvalidResource, NotFound

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
JSON = "application/json"


@dataclass(frozen=True, kw_only=True)
class Credentials:
    """Where the API server is and how to authenticate (a subset of kopf.ConnectionInfo)."""

    server: str
    ca_path: str | None = None
    ca_data: str | None = None  # base64 PEM, as kubeconfigs carry it
    insecure: bool = False
    token: str | None = None
    certificate_path: str | None = None
    certificate_data: str | None = None  # base64 PEM
    private_key_path: str | None = None
    private_key_data: str | None = None  # base64 PEM
    default_namespace: str | None = None

    def __repr__(self) -> str:  # never the token or the key
        return f"Credentials(server={self.server!r})"

    @classmethod
    def of(cls, info: Any) -> Credentials:
        """From a ``kopf.ConnectionInfo`` (paths and data as kopf's login handlers leave them)."""
        def text(v: object) -> str | None:
            if v is None:
                return None
            if isinstance(v, bytes):
                return v.decode()
            return os.fspath(v) if isinstance(v, os.PathLike) else str(v)

        return cls(server=str(info.server).rstrip("/"), ca_path=text(info.ca_path),
                   ca_data=text(info.ca_data), insecure=bool(info.insecure),
                   token=text(info.token), certificate_path=text(info.certificate_path),
                   certificate_data=text(info.certificate_data),
                   private_key_path=text(info.private_key_path),
                   private_key_data=text(info.private_key_data),
                   default_namespace=text(info.default_namespace))


def _ssl_context(c: Credentials) -> ssl.SSLContext:
    if c.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif c.ca_data:
        ctx = ssl.create_default_context(cadata=base64.b64decode(c.ca_data).decode())
    else:
        ctx = ssl.create_default_context(cafile=c.ca_path)
    if not (c.certificate_data or c.private_key_data):
        if c.certificate_path:
            ctx.load_cert_chain(c.certificate_path, c.private_key_path)
        return ctx
    # ssl loads client certificates from files only: a private directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="dcr-operator-") as tmp:
        paths = []
        for name, data, path in (("cert.pem", c.certificate_data, c.certificate_path),
                                 ("key.pem", c.private_key_data, c.private_key_path)):
            if data:
                path = os.path.join(tmp, name)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(base64.b64decode(data))
            paths.append(path)
        ctx.load_cert_chain(paths[0] or "", paths[1])
    return ctx


class KubeClient:
    """Blocking JSON calls to the API server; thread-safe."""

    def __init__(self, login: Callable[[], Credentials], *, timeout_s: float = 30.0) -> None:
        self._login = login
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._creds: Credentials | None = None
        self._ctx: ssl.SSLContext | None = None

    def _session(self, refresh: bool = False) -> tuple[Credentials, ssl.SSLContext | None]:
        with self._lock:
            if self._creds is None or refresh:
                self._creds = self._login()
                self._ctx = (_ssl_context(self._creds)
                             if self._creds.server.startswith("https") else None)
            return self._creds, self._ctx

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                query: Mapping[str, str] | None = None, content_type: str = JSON,
                timeout_s: float | None = None) -> Any:
        """One call; the decoded JSON answer. Retries once with fresh credentials on 401."""
        for attempt in (0, 1):
            creds, ctx = self._session(refresh=attempt == 1)
            try:
                return self._once(creds, ctx, method, path, body, query, content_type,
                                  timeout_s or self.timeout_s)
            except ApiError as e:
                if e.status != 401 or attempt == 1:
                    raise
                log.info("API server answered 401 for %s %s: logging in again", method, path)
        raise AssertionError("unreachable")

    def _once(self, creds: Credentials, ctx: ssl.SSLContext | None, method: str, path: str,
              body: Mapping[str, Any] | None, query: Mapping[str, str] | None,
              content_type: str, timeout_s: float) -> Any:
        url = creds.server + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"Accept": JSON}
        if creds.token:
            headers["Authorization"] = f"Bearer {creds.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise _api_error(method, path, e) from None
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise ApiUnreachable(f"{method} {path}: no answer from {creds.server}: "
                                 f"{reason}.") from e
        return json.loads(raw) if raw else {}

    # --- conveniences ----------------------------------------------------------------

    def get(self, path: str, **query: str) -> Any:
        return self.request("GET", path, query=query or None)

    def create(self, path: str, body: Mapping[str, Any]) -> Any:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Mapping[str, Any]) -> Any:
        return self.request("PATCH", path, body, content_type=MERGE_PATCH)

    def delete(self, path: str, *, propagation: str = "Background") -> Any:
        return self.request("DELETE", path, {"apiVersion": "v1", "kind": "DeleteOptions",
                                             "propagationPolicy": propagation})


def _api_error(method: str, path: str, e: urllib.error.HTTPError) -> ApiError:
    try:
        status = json.loads(e.read())
        message, reason = str(status.get("message", "")), str(status.get("reason", ""))
    except (ValueError, AttributeError, OSError):
        message, reason = f"HTTP {e.code}", ""
    text = f"{method} {path}: HTTP {e.code} {reason}: {message}"
    cls = {404: NotFound, 409: Conflict}.get(e.code, ApiError)
    return cls(text, e.code, reason)


def api_path(group: str, version: str, plural: str, namespace: str, name: str = "",
             sub: str = "") -> str:
    """The REST path of a namespaced resource (core group when ``group`` is empty).

    Namespace, name and subresource are quoted as single path segments: a name read from
    a spec cannot add segments (``/``), a query (``?``) or a fragment (``#``, which urllib
    drops, so ``fleet#x/status`` would reach the fleet itself instead of its status).
    """
    def seg(text: str) -> str:
        if text in (".", ".."):
            raise InvalidResource(f"{text!r} is not an object name.")
        return urllib.parse.quote(text, safe="")

    root = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    path = f"{root}/namespaces/{seg(namespace)}/{plural}"
    if name:
        path += f"/{seg(name)}"
    if sub:
        path += f"/{seg(sub)}"
    return path
