"""A real ``vllm serve`` refit by ``dcr agent --engine vllm``, as the chart's vLLM pod runs.

Each pod is a ``vllm serve`` process group (vLLM's CPU build: API server, engine core, a
worker per rank, DCR's worker extension in each) and a ``dcr agent`` process beside it,
sharing a staging directory; versions are real AdamW steps of a small Llama under the
engine's checkpoint root. Refits run through a coordinator as ``dcr refit`` runs one
(``dcr encode`` processes, a file store, an SQLite commit record): the test never calls
the engine to apply anything itself.

vLLM's CPU build computes every linear layer from a oneDNN copy it packs after loading
and empties the parameter, so the agent starts with the weights unknown and rejoins
densely before the first delta (docs/derived-weights.md, "Weights an engine derives after
loading"). Bits are checked three ways: the agent's own check of every attempt against
the manifest's targets; greedy completions with logprobs against a fresh ``vllm serve``
of the target; every rank's fingerprints against a dense load through the same server,
taken last, since a dense load rebuilds everything it touches.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import vllm_serve

if vllm_serve.cpu_build() is None:
    pytest.skip("needs vLLM's CPU build (DCR_VLLM_FLAVOUR=cpu tools/engines/setup.sh): only "
                "it runs `vllm serve` without a GPU", allow_module_level=True)

from dcr.client import token_versions
from dcr.drivers.base import PauseMode
from dcr.errors import DcrError
from dcr.http.admission import MAX_SPAN, MIN_VERSION
from dcr.http.engine_guard import TOKEN_FILE_ENV
from dcr.owner.process import ProcessOwner
from dcr.protocol.agent_api import AgentClient
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.records import Attempt, CommitRecord
from dcr.refit.launch import AgentProcess

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow, pytest.mark.e2e]
STEPS = 3
LR = 1e-5
TOKEN = "vllm-serve-agent-token-0123456789ab"
ENGINE_TOKEN = "vllm-serve-engine-admin-token-0123456789"
PROMPT = [5, 6, 7, 8, 9]
LONG = list(range(10, 170))  # whole KV blocks, which vLLM's prefix cache keeps


@pytest.fixture(scope="module")
def dirs(checkpoint_root: Path) -> list[Path]:
    return vllm_serve.serve_versions(checkpoint_root / "llama-serve", steps=STEPS, lr=LR)


@dataclass(eq=False, kw_only=True)
class Pod:
    """A rollout pod (server and agent) and the coordinator that refits it."""

    tmp: Path
    dirs: list[Path]
    server: vllm_serve.VllmServer
    agent: AgentProcess
    client: AgentClient
    owner: ProcessOwner
    coordinator: Coordinator
    others: list[vllm_serve.VllmServer] = field(default_factory=list)

    def refit(self, v: int) -> CommitRecord:
        return self.coordinator.refit(v, str(self.dirs[v]))

    def outcomes(self) -> list[tuple[str, str]]:
        return [(a.mode, a.outcome.split(":")[0]) for a in self.coordinator.history]

    def fresh(self, v: int) -> vllm_serve.VllmServer:
        """Another server, started on version ``v`` as loaded from disk."""
        other = vllm_serve.VllmServer(name=f"fresh-v{v}", model=self.dirs[v],
                                      root=self.dirs[0].parent, tp=self.server.tp,
                                      staging=self.tmp / f"fresh-v{v}" / "staging",
                                      workdir=self.tmp / f"fresh-v{v}")
        self.others.append(other)
        other.start()
        other.wait_ready()
        return other

    def assert_holds(self, v: int, *, prompts: Sequence[list[int]] = (PROMPT,),
                     also: Callable[[vllm_serve.VllmServer], None] | None = None) -> None:
        """Completions of ``prompts`` equal a fresh server of ``v``'s (and ``also`` is
        checked against that server); then every rank's fingerprints equal a dense load
        of ``v`` through this server; the agent says ``v``."""
        st = self.client.status()
        assert (st.version, st.dirty, st.unknown, st.gate_open) == (v, None, None, True)
        fresh = self.fresh(v)
        try:
            if also is not None:
                also(fresh)
            for prompt in prompts:
                assert vllm_serve.greedy(self.server.url, prompt) == \
                    vllm_serve.greedy(fresh.url, prompt)
        finally:
            fresh.kill()
        engine = self.server.engine()
        refit = engine.fingerprint()
        assert len(refit) == self.server.tp
        engine.load_dense(f"v{v}")
        assert engine.fingerprint() == refit

    def close(self) -> None:
        self.coordinator.close()
        self.agent.kill()
        for s in [self.server, *self.others]:
            s.kill()


@pytest.fixture
def pods(tmp_path: Path, dirs: list[Path]) -> Iterator[Callable[..., Pod]]:
    made: list[Pod] = []

    def make(*, tp: int = 1, pause_mode: PauseMode = "keep", slow_steps: bool = False,
             guard: bool = False) -> Pod:
        staging = tmp_path / "staging"
        server = vllm_serve.VllmServer(name="rollout-0", model=dirs[0], root=dirs[0].parent,
                                       staging=staging, workdir=tmp_path / "vllm", tp=tp,
                                       slow_steps=slow_steps,
                                       guard_token=ENGINE_TOKEN if guard else None)
        server.start()
        server.wait_ready()
        store = tmp_path / "store"
        agent = AgentProcess(name="rollout-0", state_dir=tmp_path / "agent", token=TOKEN,
                             args=["--store", store.as_uri(), "--engine", "vllm",
                                   "--engine-url", server.url, "--staging-dir", str(staging),
                                   "--canonical", str(dirs[0]), "--model-version", "0",
                                   "--pause-mode", pause_mode],
                             env={TOKEN_FILE_ENV: str(server.token_file)} if guard else {})
        agent.start()
        agent.wait_ready()
        client = agent.client(timeout_s=600)
        owner, coordinator = vllm_serve.refitter(tmp_path, dirs, client, store)
        pod = Pod(tmp=tmp_path, dirs=dirs, server=server, agent=agent, client=client,
                  owner=owner, coordinator=coordinator)
        made.append(pod)
        return pod

    yield make
    for pod in made:
        pod.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_refits_through_the_agent_equal_a_fresh_server_of_the_target(
        pods: Callable[..., Pod], tp: int) -> None:
    pod = pods(tp=tp)
    st = pod.client.status()
    assert st.version is None  # DCR holds no loading form of the packed layers yet
    assert "derived after loading" in (st.unknown or "")
    for v in range(1, STEPS + 1):
        assert pod.refit(v).committed_version == v
    assert pod.outcomes() == [("mixed", "committed")] * STEPS
    assert pod.coordinator.history[0].rejoined == ("rollout-0",)  # the one dense load
    assert [a.rejoined for a in pod.coordinator.history[1:]] == [()] * (STEPS - 1)
    pod.assert_holds(STEPS)


class FailsOnce:
    """An owner whose first attempt fails after its payloads are in the store."""

    def __init__(self, owner: ProcessOwner) -> None:
        self.owner = owner
        self.failed = False

    def publish(self, attempt: Attempt) -> None:
        self.owner.publish(attempt)
        if not self.failed:
            self.failed = True
            raise DcrError(f"Owner of {attempt.id} lost after publishing.")

    def advance_baseline(self, record: CommitRecord) -> None:
        self.owner.advance_baseline(record)


def test_a_failed_attempt_is_repaired_by_an_overwrite_retry(pods: Callable[..., Pod]) -> None:
    pod = pods()
    pod.refit(1)
    pod.coordinator.owners = [FailsOnce(pod.owner)]
    assert pod.refit(2).committed_version == 2
    assert pod.outcomes() == [("mixed", "committed"), ("mixed", "failed"),
                              ("overwrite", "committed")]
    pod.assert_holds(2)


def kill_when_applying(pod: Pod, kill: Callable[[], None]) -> Callable[[], None]:
    """A watcher that calls ``kill`` once the agent's attempt is applying (it journals
    that before its first write); returns the join."""
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not done.is_set():
            st = pod.client.status()
            if st.attempt is not None and st.state == "applying":
                kill()
                return
            time.sleep(0.002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()

    def join() -> None:
        done.set()
        t.join(60)

    return join


def test_a_server_killed_mid_refit_restarts_rejoins_densely_and_is_refit(
        pods: Callable[..., Pod]) -> None:
    pod = pods()
    pod.refit(1)
    join = kill_when_applying(pod, pod.server.kill)
    with contextlib.suppress(DcrError):  # no receiver left: the refit fails, and runs again
        pod.refit(2)
    join()
    assert pod.server.proc is not None
    assert pod.server.proc.poll() is not None  # killed
    pod.server.start()  # a new instance, on the same port: the container restarted
    pod.server.wait_ready()
    assert pod.refit(2).committed_version == 2
    last = pod.coordinator.history[-1]
    assert (last.outcome, last.rejoined) == ("committed", ("rollout-0",))
    pod.assert_holds(2)


def test_an_agent_killed_mid_refit_restarts_unknown_and_is_refit(
        pods: Callable[..., Pod]) -> None:
    pod = pods()
    pod.refit(1)
    join = kill_when_applying(pod, pod.agent.kill)
    with contextlib.suppress(DcrError):
        pod.refit(2)
    join()
    pod.agent.start()  # the same state directory: its journal says what it was doing
    pod.agent.wait_ready()
    st = pod.client.status()
    assert st.version is None
    assert st.unknown is not None
    assert pod.refit(2).committed_version == 2
    assert pod.coordinator.history[-1].rejoined == ("rollout-0",)
    pod.assert_holds(2)


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_a_request_in_flight_across_a_refit(pods: Callable[..., Pod], mode: PauseMode,
                                            record_property: Callable[..., None]) -> None:
    """What a streamed request sees when a refit pauses the engine in each mode: how it
    ends, how many tokens it got, and which weight versions its tokens carry. Each step of
    the engine sleeps 20 ms first (vllm_steps), so the request lasts 4 s or more on any
    machine and the refit's pause, asked for once it has 8 tokens, finds it in flight."""
    pod = pods(pause_mode=mode, slow_steps=True)
    pod.refit(1)
    vllm_serve.greedy(pod.server.url, LONG)  # its whole KV blocks now in the prefix cache
    before = vllm_serve.Generation(pod.server.url, PROMPT, 200).start().join()  # version 1's
    flight = vllm_serve.Generation(pod.server.url, PROMPT, 200).start()
    flight.wait_tokens(8)
    t0 = time.perf_counter()
    pod.refit(2)
    refit_s = time.perf_counter() - t0
    flight.join()
    record_property("in_flight", {"mode": mode, "refit_s": round(refit_s, 3),
                                  "tokens": len(flight.token_ids),
                                  "finish_reason": flight.finish_reason,
                                  "weight_versions": flight.weight_versions,
                                  "longest_gap_s": round(flight.longest_gap_s(), 3),
                                  "error": flight.error})
    assert flight.error is None
    spans = [(w["version"], w["start"], w["end"]) for w in flight.weight_versions or []]
    if mode == "wait":  # the refit waited for it: every token is version 1's
        assert (flight.finish_reason, len(flight.token_ids)) == ("length", 200)
        assert spans == [("1", 0, 200)]
    elif mode == "abort":  # ended where the pause found it
        assert flight.finish_reason == "abort"
        assert len(flight.token_ids) < 200
        assert [s[0] for s in spans] == ["1"]
    else:  # frozen, then finished on version 2's weights, labelled as such
        assert (flight.finish_reason, len(flight.token_ids)) == ("length", 200)
        assert [s[0] for s in spans] == ["1", "2"]
        assert (spans[0][1], spans[-1][2]) == (0, 200)
        assert token_versions([{"choices": [{"index": 0, "weight_versions":
                                             flight.weight_versions}]}]) == \
            ["1"] * spans[0][2] + ["2"] * (200 - spans[0][2])
    k = spans[0][2]  # version 1's tokens are its own continuation, logprobs and all
    assert (flight.token_ids[:k], flight.logprobs[:k]) == (before.token_ids[:k],
                                                           before.logprobs[:k])

    def frozen_request_resumed_on_the_target(fresh: vllm_serve.VllmServer) -> None:
        """Its tokens after the pause, with their logprobs, are what the target makes of
        the prompt and the tokens before the pause: nothing computed under version 1 (its
        keys and values included) went on into version 2's tokens."""
        rest = vllm_serve.Generation(fresh.url, PROMPT + flight.token_ids[:k], 200 - k)
        rest.start().join()
        assert rest.error is None
        assert len(flight.logprobs) == 200
        assert (rest.token_ids, rest.logprobs) == (flight.token_ids[k:], flight.logprobs[k:])
        assert flight.logprobs[k:] != before.logprobs[k:]  # the boundary is where it says

    # LONG, cached under version 1, answers as on a fresh server: no stale prefix cache.
    pod.assert_holds(2, prompts=[PROMPT, LONG],
                     also=frozen_request_resumed_on_the_target if mode == "keep" else None)


@pytest.mark.skipif(tuple(int(p) for p in (vllm_serve.cpu_build() or "0").split(".")[:2])
                    < (0, 33), reason=f"vLLM {vllm_serve.cpu_build()}'s /v1/completions has "
                    "no return_weight_versions (vLLM 0.33 adds it); the in-flight test checks "
                    "the spans of /inference/v1/generate instead")
def test_completions_report_weight_versions_across_a_keep_refit(
        pods: Callable[..., Pod]) -> None:
    """vLLM 0.33's ``/v1/completions`` with ``return_weight_versions``, not streamed: a
    completion frozen by keep reports version 1, then 2 from the token the refit froze it at."""
    pod = pods(pause_mode="keep", slow_steps=True)
    pod.refit(1)
    body = {"model": vllm_serve.SERVED, "prompt": PROMPT, "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "return_weight_versions": True,
            "return_token_ids": True}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(vllm_serve.post, pod.server.url, "/v1/completions", body, 600)
        time.sleep(1)  # vllm_steps: 20 ms a step, so the refit finds it in flight
        pod.refit(2)
        versions = token_versions(answer.result())
    k = versions.index("2")
    assert 0 < k < 200
    assert versions == ["1"] * k + ["2"] * (200 - k)


def status_of(url: str, method: str, path: str, headers: dict[str, str] | None = None,
              body: bytes | None = None) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of one request (an error status included)."""
    req = urllib.request.Request(url + path, body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw, code = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, code = e.read(), e.code
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, {}


def stream_events(url: str, body: dict[str, Any], headers: dict[str, str],
                  first: threading.Event) -> list[str]:
    """The data lines of a streamed completion; ``first`` is set at its first event."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers})
    events = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                first.set()
    return events


def test_clients_reach_a_guarded_engine_directly_and_only_the_agent_its_admin_routes(
        pods: Callable[..., Pod]) -> None:
    """``vllm serve --middleware dcr.http.engine_guard.EngineGuard``: the client routes
    answer without a token; the admin routes are the door's 404 to anyone without the
    engine admin token, and the agent, which has it, refits through them bit-exactly; the
    staleness headers answer as the door's."""
    pod = pods(pause_mode="keep", slow_steps=True, guard=True)
    url = pod.server.url
    assert status_of(url, "GET", "/v1/models")[0] == 200
    for method, path in [("POST", "/collective_rpc"), ("POST", "/pause"),
                         ("POST", "/update_weight_version"), ("GET", "/weight_info"),
                         ("POST", "/inference/v1/generate"), ("GET", "/v1/models/"),
                         ("POST", "/v1//completions")]:
        code, answer = status_of(url, method, path, body=b"{}" if method == "POST" else None)
        assert (code, answer.get("kind")) == (404, "NotServed"), (method, path)
    wrong = {"Authorization": f"Bearer {ENGINE_TOKEN}x"}
    assert status_of(url, "POST", "/pause", wrong, b"")[0] == 404
    assert status_of(url, "GET", "/v1/models", {MIN_VERSION: "1"})[1]["kind"] == \
        "StaleVersion"  # unknown until the agent sets the label
    assert pod.refit(1).committed_version == 1
    code, answer = status_of(url, "GET", "/v1/models", {MIN_VERSION: "2"})
    assert (code, answer["kind"]) == (409, "StaleVersion")
    assert "committed version is 1; the request accepts 2 or newer" in answer["error"]
    assert status_of(url, "GET", "/v1/models", {MIN_VERSION: "1"})[0] == 200

    first = threading.Event()
    body = {"model": vllm_serve.SERVED, "prompt": PROMPT, "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        flight = pool.submit(stream_events, url, body, {MAX_SPAN: "0"}, first)
        assert first.wait(300)
        assert pod.refit(2).committed_version == 2  # keep: the stream is frozen across it
        events = flight.result(timeout=600)
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert (error["type"], error["code"]) == ("VersionSpanExceeded", 409)
    assert "from 1 to 2, more than the 0 versions" in error["message"]
    assert len(events) < 200  # ended at the refit, not after every token
    pod.assert_holds(2)  # completions as a fresh server's; fingerprints as a dense load's
