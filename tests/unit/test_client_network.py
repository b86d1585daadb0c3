"""``dcr.client`` on a network that fails: a loopback stand-in for the API server that
refuses, drops and expires as a restarting one does.

The stand-in answers the WeightRefit calls the official ``kubernetes`` client makes, and
does what each test scripts: a 503 for a create, a watch whose connection drops before or
after an event, a 410 Gone for a resourceVersion too old, nothing at all. ``refit`` must
come through every one of them by asking again (with the last resourceVersion it saw),
and when the caller's deadline passes with no answer raise a :class:`WeightRefitError`
naming the call, never a transport error of the libraries underneath.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes.client import ApiClient, Configuration

import dcr.client
from dcr.client import WeightRefitRefused, WeightRefitUnreachable, refit

NS, NAME = "rl", "policy-v7"
BASE = f"/apis/dcr.dev/v1alpha1/namespaces/{NS}/weightrefits"


def weightrefit(rv: int, *conditions: tuple[str, str, str]) -> dict[str, Any]:
    return {"apiVersion": "dcr.dev/v1alpha1", "kind": "WeightRefit",
            "metadata": {"name": NAME, "namespace": NS, "resourceVersion": str(rv)},
            "spec": {}, "status": {"phase": "Applying", "conditions": [
                {"type": t, "status": s, "reason": r, "message": ""}
                for t, s, r in conditions]}}


APPLYING = ("Applying", "True", "Applying")
COMMITTED = ("Committed", "True", "Committed")


class ApiServer(ThreadingHTTPServer):
    """Answers the client's calls from scripts: ``creates`` (statuses), ``watches``
    (per watch: events to send, then ``"drop"`` or ``"gone"`` or ``"end"``) and the
    object ``current`` for a GET; records each watch's resourceVersion."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.creates: list[int] = [201]
        self.watches: list[list[Any]] = []
        self.current = weightrefit(1)
        self.watched_from: list[str] = []
        self.calls: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ApiServer

    def log_message(self, *_: Any) -> None:
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        status = self.server.creates.pop(0) if self.server.creates else 201
        self.server.calls.append(f"POST {status}")
        if status == 201:
            self._json(201, self.server.current)
        else:
            self._json(status, {"kind": "Status", "code": status, "message": "not now"})

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if query.get("watch") != ["true"]:
            self.server.calls.append("GET")
            self._json(200, self.server.current)
            return
        self.server.watched_from.append(query["resourceVersion"][0])
        script = self.server.watches.pop(0) if self.server.watches else ["end"]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for step in script:
            if step == "drop":  # the connection ends inside the chunked body
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if step == "gone":
                step = {"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                    "reason": "Expired", "message": "too old"}}
            elif step != "end":
                self.server.current = step["object"]
            if step != "end":
                line = json.dumps(step).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def server() -> Iterator[ApiServer]:
    s = ApiServer()
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    s.shutdown()
    s.server_close()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcr.client, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(dcr.client, "RETRY_MAX_S", 0.2)


def api(url: str) -> ApiClient:
    config = Configuration(host=url)
    config.retries = 0  # the client's own retries are what is tested
    return ApiClient(config)


def test_a_503_and_dropped_watches_and_a_410_are_ridden_through_to_the_commit(
        server: ApiServer) -> None:
    server.creates = [503, 503, 201]
    server.watches = [
        ["drop"],  # dropped before any event: watched again from version 1
        [{"type": "MODIFIED", "object": weightrefit(2, APPLYING)}, "drop"],
        ["gone"],  # version 2 is too old: read again (version 3), watched from there
        [{"type": "MODIFIED", "object": weightrefit(4, COMMITTED)}, "end"],
    ]
    server.current = weightrefit(1)

    def gone_reads_three() -> None:
        server.current = weightrefit(3, APPLYING)

    seen: list[str] = []
    done = refit("policy", 7, "/ckpt/step-7", namespace=NS, api_client=api(server.url),
                 progress_bar=False, timeout_s=60,
                 on_progress=lambda p: (seen.append(p.message),
                                        gone_reads_three() if len(seen) == 2 else None))
    assert done.name == NAME
    assert server.calls[:3] == ["POST 503", "POST 503", "POST 201"]
    assert server.watched_from == ["1", "1", "2", "3"]
    assert seen[-1].startswith("Committed/Committed")


def test_an_api_server_that_never_answers_is_a_weightrefit_error_at_the_deadline() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(WeightRefitUnreachable,
                       match=rf"Creating WeightRefit {NS}/{NAME}: the API server did not "
                             r"answer for .* until the deadline; last: MaxRetryError") as e:
        refit("policy", 7, "/ckpt/step-7", namespace=NS,
              api_client=api(f"http://127.0.0.1:{port}"), progress_bar=False, timeout_s=1.0)
    assert e.value.call == f"Creating WeightRefit {NS}/{NAME}"


def test_a_watch_that_keeps_dropping_ends_at_the_deadline_naming_the_watch(
        server: ApiServer) -> None:
    server.watches = [["drop"]] * 10_000
    with pytest.raises(WeightRefitUnreachable, match=rf"Watching WeightRefit {NS}/{NAME}: "
                                                     r".*last: ProtocolError"):
        refit("policy", 7, "/ckpt/step-7", namespace=NS, api_client=api(server.url),
              progress_bar=False, timeout_s=1.0)
    assert set(server.watched_from) == {"1"}  # each time from the version in hand


def test_a_refusal_is_not_retried_and_names_its_status(server: ApiServer) -> None:
    server.creates = [403]
    with pytest.raises(WeightRefitRefused, match=rf"Creating WeightRefit {NS}/{NAME}: 403"
                       ) as e:
        refit("policy", 7, "/ckpt/step-7", namespace=NS, api_client=api(server.url),
              progress_bar=False, timeout_s=30)
    assert e.value.status == 403
    assert server.calls == ["POST 403"]
