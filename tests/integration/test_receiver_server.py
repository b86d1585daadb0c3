"""The agent's HTTP server under load, over real loopback HTTP: threads, waits, liveness.

The server (:func:`dcr.receiver.server.make_app`) runs on its own event loop thread on a
free port; clients are plain sockets and ``urllib``. The agent drives an in-process
engine (``LocalDriver``) holding one rank of the small vLLM-layout reference runtime, and
its store never receives anything, so every ``/v1/staged`` wait lasts as long as it is
allowed to.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from appserver import Server
from promtext import samples, value

from dcr.apply.plan import CanonicalTensor
from dcr.protocol.agent_api import AgentStatus, AttemptSpec
from dcr.protocol.records import Attempt, Transition
from dcr.receiver.server import make_app
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import ReferenceConfig, ReferenceModel, random_checkpoint
from dcr.serve.local import LocalDriver
from dcr.transport.receive import Source, StoreSource
from dcr.transport.store import MemoryStore

pytestmark = pytest.mark.timeout(120)

TOKEN = "server-test-token-0123456789abcdef"
CFG = ReferenceConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=4, tie_word_embeddings=False)
# 5b0b0ae ran every blocking call on asyncio's default pool: this many threads.
DEFAULT_POOL = min(32, (os.cpu_count() or 1) + 4)


def agent(tmp: Path, **kw: Any) -> AgentService:
    state = random_checkpoint(CFG, 0)
    canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                 for n, t in state.items()]
    model = ReferenceModel(CFG, tp_size=1, tp_rank=0)
    model.load_weights(state.items())
    engine = LocalDriver([model], staging_dir=tmp / "staging", checkpoint_root=tmp)
    store = MemoryStore()  # nothing is ever published: every wait waits

    def source_for(spec: AttemptSpec) -> Source:
        return StoreSource(store=store, version=spec.target_version, attempt=spec.attempt)

    return AgentService("rx", engine, source_for, canonical=canonical,
                        staging_dir=tmp / "staging", version=0, **kw)


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(service: AgentService, **kw: Any) -> Server:
        servers.append(Server(make_app(service, TOKEN, **kw)))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def http(url: str, *, body: object = None, timeout_s: float = 10.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Authorization": f"Bearer {TOKEN}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def prepared(svc: AgentService) -> Attempt:
    a = Attempt(transition=Transition(base_version=0, target_version=1), mode="mixed",
                receivers=("rx",), deadline=time.time() + 600)
    svc.prepare(a)
    return a


def until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the state never showed"
        time.sleep(0.01)


def test_status_and_stop_answer_while_waits_hold_every_thread_they_may(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    """More long ``/v1/staged`` waits than 5b0b0ae had threads for all its calls: the
    first ``max_waits`` wait, the rest are refused at once with 503, and ``/v1/status``
    and ``/v1/stop`` still answer (stop ends the waits). Fails on 5b0b0ae: the waits took
    every thread, and status timed out behind them."""
    svc = agent(tmp_path)
    server = serve(svc)
    a = prepared(svc)
    n = DEFAULT_POOL + 1
    answers: list[tuple[int, str]] = []

    def wait() -> None:
        answers.append(http(f"{server.url}/v1/staged", body={"attempt": a.id,
                                                            "timeout_s": 60},
                            timeout_s=90))

    waiting = [threading.Thread(target=wait) for _ in range(n)]
    for t in waiting:
        t.start()
    admitted = min(n, 8)  # AgentSettings.max_waits
    until(lambda: svc.waits == admitted and len(answers) == n - admitted)
    assert all(code == 503 and json.loads(text)["kind"] == "Busy" for code, text in answers)

    code, text = http(f"{server.url}/v1/status", timeout_s=5)
    assert code == 200
    assert AgentStatus.model_validate_json(text).state == "streaming"
    code, text = http(f"{server.url}/v1/stop", body={"attempt": a.id}, timeout_s=5)
    assert (code, AgentStatus.model_validate_json(text).state) == (200, "obsolete")
    for t in waiting:
        t.join(30)
    stopped = [json.loads(text)["error"] for code, text in answers if code == 409]
    assert len(stopped) == admitted
    assert all("was stopped" in e for e in stopped)


def test_a_wait_ends_when_its_client_goes_away(serve: Callable[..., Server],
                                               tmp_path: Path) -> None:
    """A client that sends ``/v1/staged`` and hangs up leaves no wait behind. Fails on
    5b0b0ae, whose waits ran to their deadline in a thread whatever the client did (and
    which exported no gauge of them)."""
    svc = agent(tmp_path)
    server = serve(svc)
    a = prepared(svc)
    body = json.dumps({"attempt": a.id, "timeout_s": 600}).encode()
    request = (f"POST /v1/staged HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(request)
        until(lambda: svc.waits == 1)
        assert value(samples(http(f"{server.url}/metrics")[1]), "dcr_agent_waits") == 1
    until(lambda: svc.waits == 0, timeout_s=10)  # hung up: the wait was cancelled
    assert value(samples(http(f"{server.url}/metrics")[1]), "dcr_agent_waits") == 0
    assert svc.status().state == "streaming"  # the attempt itself goes on


def test_a_wait_lasts_no_longer_than_the_agent_allows(serve: Callable[..., Server],
                                                      tmp_path: Path) -> None:
    """``timeout_s: 3600`` asks for an hour; the agent caps it at its ``max_wait_s``.
    Fails on 5b0b0ae, which waited as long as any client asked."""
    svc = agent(tmp_path, max_wait_s=0.5)
    server = serve(svc)
    a = prepared(svc)
    t0 = time.monotonic()
    code, text = http(f"{server.url}/v1/staged", body={"attempt": a.id, "timeout_s": 3600},
                      timeout_s=30)
    assert (code, json.loads(text)["kind"]) == (422, "AttemptFailed")
    assert "not staged after 0.5 s" in json.loads(text)["error"]
    assert time.monotonic() - t0 < 20


def test_liveness_reports_a_wedged_control_loop(serve: Callable[..., Server],
                                                tmp_path: Path) -> None:
    """While the agent's state lock is held (a wedged control loop), ``/healthz`` answers
    503; once it is free again, 200. Fails on 5b0b0ae, whose ``/healthz`` said ok
    whatever the agent could still do."""
    svc = agent(tmp_path)
    server = serve(svc, liveness_timeout_s=0.3)
    assert http(f"{server.url}/healthz") == (200, "ok\n")
    with svc._cond:  # what a call stuck inside the lock looks like from outside
        code, text = http(f"{server.url}/healthz", timeout_s=10)
    assert code == 503
    assert text.startswith("wedged:")
    assert http(f"{server.url}/healthz") == (200, "ok\n")
