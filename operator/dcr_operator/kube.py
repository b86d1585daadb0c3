"""A small synchronous Kubernetes API client for the coordinator's thread.

:class:`KubeClient`: JSON on the paths :func:`api_path` builds, on the official
``kubernetes`` package, with the operator's error tree and no redirects. The token lives in
the library's ``Configuration`` only, never in a log line, message or ``repr``. Why:
docs/operator.md, "Inside the operator"; docs/security.md.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException, load_kube_config
from kubernetes.config.incluster_config import (
    SERVICE_CERT_FILENAME,
    SERVICE_TOKEN_FILENAME,
    InClusterConfigLoader,
)
from urllib3.exceptions import HTTPError
from urllib3.util.retry import Retry

from dcr_operator.errors import ApiError, ApiUnreachable, Conflict, InvalidResource, NotFound

MERGE_PATCH = "application/merge-patch+json"
JSON = "application/json"
_ERRORS: dict[int, type[ApiError]] = {404: NotFound, 409: Conflict}


def in_cluster(*, token_path: str = SERVICE_TOKEN_FILENAME,
               ca_path: str = SERVICE_CERT_FILENAME,
               environ: Mapping[str, str] = os.environ) -> Configuration:
    """The pod's ServiceAccount, as the library loads it (it re-reads ``token_path`` once a
    minute, so a rotated bound token is picked up); raises ``ConfigException`` outside a pod."""
    config = Configuration()
    InClusterConfigLoader(token_filename=token_path, cert_filename=ca_path,
                          environ=environ).load_and_set(config)  # type: ignore[no-untyped-call]
    return config


def from_kubeconfig(path: str | None = None) -> Configuration:
    """The current context of the kubeconfig at ``path`` (default ``$KUBECONFIG``)."""
    config = Configuration()
    load_kube_config(config_file=path, client_configuration=config)  # type: ignore[no-untyped-call]
    return config


def configuration() -> Configuration:
    """The ServiceAccount in a pod, else the kubeconfig: the order kopf's login tries them."""
    try:
        return in_cluster()
    except ConfigException as pod:
        try:
            return from_kubeconfig()
        except ConfigException as e:
            raise ConfigException(f"not in a pod ({pod}), and no kubeconfig ({e})") from e


def _without_redirects(retries: Retry | int | None) -> Retry:
    """``retries`` (urllib3's default when None), redirects returned instead of followed."""
    return Retry.from_int(retries).new(redirect=False, raise_on_redirect=False)


class KubeClient:
    """Blocking JSON calls to the API server; thread-safe.

    ``configure`` makes the library configuration on first use (so an operator without
    credentials yet starts, and its calls raise ``ApiUnreachable`` until it has some); the
    client changes that configuration's ``retries`` so that it follows no redirect. A call
    the server answers 401 (its credentials revoked or expired) drops the configuration and
    is made once more with a new one from ``configure``, which reads the credentials again
    (a rotated token); a second 401 is the caller's, and the next call tries again.
    """

    def __init__(self, configure: Callable[[], Configuration] = configuration, *,
                 timeout_s: float = 30.0) -> None:
        self._configure = configure
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._api: ApiClient | None = None

    def __repr__(self) -> str:  # never the token
        host = self._api.configuration.host if self._api else "not configured yet"
        return f"KubeClient({host})"

    def _client(self) -> ApiClient:
        with self._lock:
            if self._api is None:
                try:
                    config = self._configure()
                except ConfigException as e:
                    raise ApiUnreachable(f"No credentials for the API server: {e}.") from e
                config.retries = _without_redirects(config.retries)
                self._api = ApiClient(config)
            return self._api

    def _renew(self, api: ApiClient) -> None:
        """Forget ``api``'s configuration (the server refused its credentials), unless
        another thread already did; the next call asks ``configure`` again."""
        with self._lock:
            if self._api is api:
                self._api = None

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                query: Mapping[str, str] | None = None, content_type: str = JSON,
                timeout_s: float | None = None) -> Any:
        """One call; the decoded JSON answer."""
        call = (method, path, body, query, content_type, timeout_s or self.timeout_s)
        api = self._client()
        status, raw = self._call(api, *call)
        if status == 401:  # nothing was done: the server refused whoever asked
            self._renew(api)
            api = self._client()
            status, raw = self._call(api, *call)
            if status == 401:
                self._renew(api)
        if not 200 <= status < 300:
            raise _api_error(method, path, status, raw)
        return json.loads(raw) if raw else {}

    @staticmethod
    def _call(api: ApiClient, method: str, path: str, body: Mapping[str, Any] | None,
              query: Mapping[str, str] | None, content_type: str, timeout_s: float
              ) -> tuple[int, bytes]:
        headers = {"Accept": JSON, **({"Content-Type": content_type} if body is not None
                                      else {})}
        try:
            # auth_settings: the library adds the (refreshed) bearer token, if there is one.
            request = api.param_serialize(method, path, query_params=list((query or {}).items()),
                                          header_params=headers, auth_settings=["BearerToken"],
                                          body=None if body is None else dict(body))
            response = api.call_api(*request, _request_timeout=timeout_s)
            raw: bytes = response.read()  # type: ignore[no-untyped-call]
        except (HTTPError, ApiException, ConfigException, OSError) as e:
            raise ApiUnreachable(f"{method} {path}: no answer from {api.configuration.host}: "
                                 f"{_reason(e)}.") from e
        return response.status, raw

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


def _reason(e: Exception) -> str:
    """Why no answer came, in one line (urllib3's own text names the URL and the pool)."""
    reason = getattr(e, "reason", None) or e
    return " ".join(str(reason).split())


def _api_error(method: str, path: str, status: int, raw: bytes) -> ApiError:
    try:
        answer = json.loads(raw)
        message, reason = str(answer.get("message", "")), str(answer.get("reason", ""))
    except (ValueError, AttributeError):
        message, reason = f"HTTP {status}", ""
    if 300 <= status < 400:
        message = "a redirect, which this client never follows (it would carry credentials)"
    text = f"{method} {path}: HTTP {status} {reason}: {message}"
    return _ERRORS.get(status, ApiError)(text, status, reason)


def api_path(group: str, version: str, plural: str, namespace: str, name: str = "",
             sub: str = "") -> str:
    """The REST path of a namespaced resource (core group when ``group`` is empty).

    Namespace, name and subresource are quoted as single path segments: a name read from
    a spec cannot add segments (``/``), a query (``?``) or a fragment (``#``, which urllib3
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
