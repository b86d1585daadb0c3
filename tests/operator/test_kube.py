"""The operator's synchronous API client (dcr_operator.kube) on its edges: redirects, which
it never follows, and in-cluster credentials, whose rotated token it picks up."""

from __future__ import annotations

import datetime as dt
import http.server
import logging
import shutil
import threading
import types
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import Configuration
from kubernetes.config import incluster_config

from dcr_operator.errors import ApiError
from dcr_operator.kube import KubeClient, api_path, in_cluster

TOKEN = "s3cret-bearer-token"


@dataclass
class Loopback:
    """An HTTP server on 127.0.0.1 that records each request and redirects the paths in
    ``redirects`` (to a URL, with ``status``); every other path answers ``{}``."""

    status: int = 302
    redirects: dict[str, str] = field(default_factory=dict)
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, auth
    url: str = ""
    refused: set[str] = field(default_factory=set)  # Authorization values answered 401

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                server.seen.append((self.command, self.path, self.headers.get("Authorization")))
                if self.headers.get("Authorization") in server.refused:
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path in server.redirects:
                    self.send_response(server.status)
                    self.send_header("Location", server.redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = b"{}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PATCH = do_POST = answer  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def loopback() -> Iterator[Any]:
    """Start as many Loopback servers as a test asks for; stop them after it."""
    started: list[http.server.ThreadingHTTPServer] = []

    def start(server: Loopback) -> Loopback:
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), server.handler())
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        return server

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("status", [301, 302, 307, 308])
@pytest.mark.parametrize("method", ["GET", "PATCH"])
@pytest.mark.parametrize("target", ["another server", "the same server"])
def test_a_redirect_is_not_followed_so_the_token_goes_nowhere_else(
        loopback: Any, caplog: pytest.LogCaptureFixture, status: int, method: str,
        target: str) -> None:
    """Fails on b59354c (urllib followed a GET's redirect with its Authorization header,
    to any host) and with urllib3's default retries (which follow it, dropping the header
    only when the host changes)."""
    caplog.set_level(logging.DEBUG)
    api = loopback(Loopback(status=status))
    elsewhere = api if target == "the same server" else loopback(Loopback())
    path = api_path("dcr.dev", "v1alpha1", "rolloutfleets", "ns", "fleet")
    api.redirects[path] = f"{elsewhere.url}/elsewhere"
    kube = KubeClient(lambda: Configuration(host=api.url,
                                            api_key={"BearerToken": f"Bearer {TOKEN}"}))

    with pytest.raises(ApiError) as e:
        kube.request(method, path, {"status": {}} if method == "PATCH" else None,
                     content_type="application/merge-patch+json")

    assert e.value.status == status
    assert api.seen[0] == (method, path, f"Bearer {TOKEN}")  # the server did get it
    assert [s for s in elsewhere.seen if s[1] == "/elsewhere"] == []
    assert TOKEN not in str(e.value)
    assert TOKEN not in caplog.text
    assert TOKEN not in repr(kube)


def test_a_refused_token_is_read_again_and_the_call_made_once_more(loopback: Any) -> None:
    """Fails without the renewal: the client kept its first configuration, so a revoked
    token failed every call until the process restarted. A 401 makes the client ask
    ``configure`` again (a rotated Secret, a re-read token file) and repeat the call once;
    a second 401 is the caller's, and the next call asks again."""
    api = loopback(Loopback())
    tokens = iter(["old", "new", "newer", "newest"])
    asked: list[str] = []

    def configure() -> Configuration:
        asked.append(next(tokens))
        return Configuration(host=api.url, api_key={"BearerToken": f"Bearer {asked[-1]}"})

    kube = KubeClient(configure)
    path = api_path("", "v1", "configmaps", "ns")
    api.refused.add("Bearer old")
    assert kube.get(path) == {}
    assert [auth for _, _, auth in api.seen] == ["Bearer old", "Bearer new"]

    api.refused.update({"Bearer new", "Bearer newer"})
    with pytest.raises(ApiError) as e:
        kube.create(path, {"metadata": {"name": "x"}})
    assert e.value.status == 401
    assert kube.get(path) == {}  # the next call configures again
    assert asked == ["old", "new", "newer", "newest"]


def test_a_client_without_credentials_is_unreachable_and_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dcr_operator.errors import ApiUnreachable

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    with pytest.raises(ApiUnreachable, match="No credentials for the API server: not in a pod"):
        KubeClient().get("/api/v1/namespaces")


class _Clock:
    """The in-cluster loader's clock (it re-reads the token when a minute has passed on it),
    moved forward by the test instead of waiting."""

    def __init__(self) -> None:
        self.ahead = dt.timedelta()
        clock = self

        class Later(dt.datetime):
            @classmethod
            def now(cls, tz: dt.tzinfo | None = None) -> Later:
                return cls.fromtimestamp((dt.datetime.now(tz) + clock.ahead).timestamp(), tz)

        self.module = types.SimpleNamespace(datetime=Later, timedelta=dt.timedelta)


@pytest.mark.e2e
def test_in_cluster_credentials_pick_up_a_rotated_token(
        control_plane: Any, kube: KubeClient, namespace: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A pod's token file, CA and KUBERNETES_SERVICE_HOST/PORT, in a temporary directory:
    the library re-reads the token a minute after it last did (its clock is moved here), so
    an expired token is replaced without a restart, and no token reaches a log or an error."""
    caplog.set_level(logging.DEBUG)
    clock = _Clock()
    monkeypatch.setattr(incluster_config, "datetime", clock.module)
    tokens = {}
    for name in ("first", "second"):
        kube.create(api_path("", "v1", "serviceaccounts", namespace), {"metadata": {"name": name}})
        tokens[name] = control_plane.service_account_token(namespace, name)
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    shutil.copy(control_plane.ca_path, ca)
    token.write_text("expired-token")
    server = urllib.parse.urlsplit(control_plane.server)
    environ = {"KUBERNETES_SERVICE_HOST": str(server.hostname),
               "KUBERNETES_SERVICE_PORT": str(server.port)}
    pod = KubeClient(lambda: in_cluster(token_path=str(token), ca_path=str(ca), environ=environ))

    def whoami() -> str:
        review = pod.create("/apis/authentication.k8s.io/v1/selfsubjectreviews",
                            {"apiVersion": "authentication.k8s.io/v1",
                             "kind": "SelfSubjectReview"})
        return str(review["status"]["userInfo"]["username"])

    with pytest.raises(ApiError) as e:
        whoami()
    assert e.value.status == 401
    for name in ("first", "second"):
        token.write_text(tokens[name])
        clock.ahead += dt.timedelta(minutes=2)
        assert whoami() == f"system:serviceaccount:{namespace}:{name}"
    logged = caplog.text + str(e.value) + repr(pod)
    assert not [name for name, secret in tokens.items() if secret in logged]
