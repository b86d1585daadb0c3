"""Real ``dcr agent`` processes over loopback HTTP, each beside a ``dcr serve`` reference
server (a rollout pod): the API's edges and process deaths, of agents and of servers.

Servers hold a tiny Llama checkpoint written with ``save_pretrained`` (the ``hf``
runtime, or both ranks of the vLLM-layout reference runtime at TP 2 in one server) and
read staged payloads from the directory they share with their agent; agents read
payloads from a ``FileStore`` under the test's directory, keep their journal in
``--state-dir`` and drive their server only through its HTTP API. Owners are
``ProcessOwner``s: every attempt runs ``python -m dcr encode`` as a process. Bits are
compared through ``AgentClient.fingerprint()`` (xxh3 of the integer view of every
parameter and buffer, every rank of the server) against a runtime of the same kind built
in this process and loaded densely with the target through the same loader.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from promtext import samples, value
from replica_group import flip_bits
from transformers import LlamaConfig, LlamaForCausalLM

from dcr import __version__
from dcr.drivers.base import merge_fingerprints
from dcr.errors import DcrError
from dcr.format.layout import manifest_key, payload_key, version_prefix
from dcr.format.profile import ReceiverProfile, dumps, merge
from dcr.owner.process import ProcessOwner
from dcr.protocol.agent_api import AgentClient, AgentError, AgentStatus, FlushAck
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import (
    Coordinator,
    CoordinatorSettings,
    ReceiverHandle,
    RefitFailed,
)
from dcr.protocol.records import Attempt, CommitRecord, Transition
from dcr.refit.launch import AgentProcess, ServeProcess
from dcr.refit.trainer import reference_fingerprint
from dcr.versions import AGENT_API, OVERRIDE_ENV

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow, pytest.mark.e2e]

TOKEN = "agent-test-token-0123456789abcdef"
# About 6.5 MiB in BF16: with 1 MiB buckets an encoder streams several payloads.
LLAMA = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False)
V0 = CommitRecord(committed_version=0, baseline_id="ckpt-0", attempt="")
SETTINGS = CoordinatorSettings(attempt_timeout_s=60.0)
TP = {"hf": 1, "vllm-ref": 2}  # ranks of each runtime's server


@dataclass(frozen=True, kw_only=True)
class Checkpoints:
    root: Path

    def dir(self, v: int) -> Path:
        return self.root / f"v{v}"

    def dense(self, v: int) -> str:
        """The coordinator's ``dense_checkpoint`` callback."""
        return str(self.dir(v))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Versions 0..2 of a tiny Llama, each a ``save_pretrained`` directory."""
    ckpts = Checkpoints(root=tmp_path_factory.mktemp("llama"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LLAMA).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for v in range(3):
        if v:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-2 * torch.randn(p.shape, generator=gen).to(p.dtype))
        model.save_pretrained(ckpts.dir(v))
    return ckpts


_FINGERPRINTS: dict[tuple[Path, str, int], dict[str, str]] = {}


def dense_fingerprint(ckpts: Checkpoints, runtime: str, v: int) -> dict[str, str]:
    """What a pod of ``runtime`` holds after a dense load of version ``v``, every rank of
    its server as its agent reports them (the oracle)."""
    key = (ckpts.root, runtime, v)
    if key not in _FINGERPRINTS:
        tp = TP[runtime]
        _FINGERPRINTS[key] = merge_fingerprints([
            reference_fingerprint(ckpts.dir(v), runtime, tp_size=tp, tp_rank=r)
            for r in range(tp)])
    return _FINGERPRINTS[key]


# --- pods: a server and its agent ---------------------------------------------------


@dataclass(eq=False, kw_only=True)
class Agent:
    name: str
    runtime: str  # "hf", or "vllm-ref" (both ranks of tensor-parallel size 2)
    process: AgentProcess
    server: ServeProcess
    hello: dict[str, Any]  # the JSON line it printed once listening
    client: AgentClient

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def proc(self) -> subprocess.Popen[str]:
        assert self.process.proc is not None
        return self.process.proc


class Fleet:
    """Pods of one test, all on one store; every process is killed at teardown. A pod's
    server outlives its agent: starting an agent of the same name again finds it."""

    def __init__(self, tmp: Path, ckpts: Checkpoints) -> None:
        self.tmp = tmp
        self.ckpts = ckpts
        self.store = tmp / "store"
        self.servers: dict[str, ServeProcess] = {}
        self.agents: list[AgentProcess] = []
        self.models: dict[str, Path] = {}  # what a pod's server loads at start (default v0)

    def server(self, name: str, runtime: str) -> ServeProcess:
        """The pod's reference server, started if it is not running."""
        server = self.servers.get(name)
        if server is None:
            server = ServeProcess(
                name=f"serve-{name}", workdir=self.tmp / name / "serve",
                args=["--runtime", runtime,
                      "--model", str(self.models.get(name, self.ckpts.dir(0))),
                      "--tp-size", str(TP[runtime]), "--staging-dir", str(self.staging(name)),
                      "--checkpoint-root", str(self.ckpts.root), "--weight-version", "0"])
            self.servers[name] = server
        if server.proc is None or server.proc.poll() is not None:
            server.start()
            server.wait_ready()
        return server

    def staging(self, name: str) -> Path:
        path = self.tmp / name / "staging"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, *specs: tuple[str, str], env: dict[str, str] | None = None
              ) -> list[Agent]:
        """Start pods ``(name, runtime)`` side by side (a running server is kept), their
        agents with ``env`` added; return once each agent is listening."""
        pods = []
        for name, runtime in specs:
            server = self.server(name, runtime)
            agent = AgentProcess(
                name=name, state_dir=self.tmp / name / "agent", token=TOKEN,
                args=["--store", self.store.as_uri(), "--engine-url", server.url,
                      "--staging-dir", str(self.staging(name)),
                      "--canonical", str(self.ckpts.dir(0)), "--model-version", "0"],
                env=dict(env or {}))
            agent.start()
            self.agents.append(agent)
            pods.append((name, runtime, agent, server))
        started = [Agent(name=name, runtime=runtime, process=agent, server=server,
                         hello=agent.wait_ready(), client=agent.client())
                   for name, runtime, agent, server in pods]
        for a in started:
            a.client.profile()  # returns once the agent has met and prewarmed its server
        return started

    def close(self) -> None:
        for proc in [*self.agents, *self.servers.values()]:
            proc.kill()

    def owner(self, **kw: Any) -> ProcessOwner:
        return ProcessOwner(store_uri=self.store.as_uri(), checkpoints=self.ckpts.dir,
                            version=0, timeout_s=120.0, **kw)

    def assert_holds(self, agent: Agent, version: int) -> None:
        want = dense_fingerprint(self.ckpts, agent.runtime, version)
        if version:  # not vacuous: the previous version differs almost everywhere
            before = dense_fingerprint(self.ckpts, agent.runtime, version - 1)
            assert sum(before[n] != want[n] for n in want) >= len(want) - TP[agent.runtime]
        got = agent.client.fingerprint()
        assert got.keys() == want.keys()
        differ = [n for n in want if got[n] != want[n]]
        assert differ == [], f"{agent.name} differs from a dense load of v{version}: {differ[:4]}"
        st = agent.client.status()
        assert (st.version, st.dirty, st.unknown, st.gate_open) == (version, None, None, True)
        assert agent.server.engine().version() == str(version)  # the engine's label


@pytest.fixture(scope="module")
def adamw_checkpoints(tmp_path_factory: pytest.TempPathFactory,
                      export_llama_versions: Callable[..., None]) -> Checkpoints:
    """Versions 0..2 one AdamW step apart: every matrix changes from step to step, the
    RMSNorm weights (1.0 less a step of 1e-3) stay as they are in BF16."""
    ckpts = Checkpoints(root=tmp_path_factory.mktemp("adamw"))
    export_llama_versions(ckpts.root, LLAMA)
    return ckpts


@pytest.fixture
def fleet(tmp_path: Path, checkpoints: Checkpoints) -> Iterator[Fleet]:
    f = Fleet(tmp_path, checkpoints)
    yield f
    f.close()


def http(url: str, *, method: str = "GET", body: bytes | None = None,
         token: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def outcomes(c: Coordinator) -> list[tuple[str, str]]:
    return [(h.mode, h.outcome.split(":")[0]) for h in c.history]


def profile_file(tmp: Path, agents: list[Agent]) -> Path:
    """The receivers' merged profile, for the encoder processes' ``--profile``."""
    path = tmp / "profile.json"
    merged = merge(ReceiverProfile.model_validate(a.client.profile()) for a in agents)
    path.write_text(dumps(merged))
    return path


# --- tests -----------------------------------------------------------------------------


def test_the_agent_api_needs_a_token_names_a_bad_field_and_refuses_a_wrong_base_version(
        fleet: Fleet) -> None:
    (agent,) = fleet.start(("api", "hf"))
    assert agent.hello == {"url": agent.url, "name": "api", "version": 0}
    spec = {"attempt": "a-api1", "base_version": 0, "target_version": 1, "mode": "mixed",
            "deadline": time.time() + 60}

    for token in (None, "not-the-token-0123456789"):
        code, text = http(agent.url + "/v1/status", token=token)
        assert (code, json.loads(text)["kind"]) == (401, "Unauthorized")
        code, _ = http(agent.url + "/v1/prepare", method="POST", token=token,
                       body=json.dumps(spec).encode())
        assert code == 401
    assert http(agent.url + "/healthz") == (200, "ok\n")
    assert http(agent.url + "/readyz") == (200, "version 0\n")
    code, text = http(agent.url + "/metrics")
    assert code == 200
    assert value(samples(text), "dcr_agent_version") == 0

    bad = [
        ("/v1/prepare", {**spec, "base_version": "zero"}, "AttemptSpec: base_version:"),
        ("/v1/prepare", {**spec, "attempt": "../escape"}, "AttemptSpec: attempt:"),
        ("/v1/prepare", {**spec, "surprise": 1}, "AttemptSpec: surprise:"),
        ("/v1/flush", {"attempt": "a-api1", "timeout_s": -1}, "AttemptRef: timeout_s:"),
        ("/v1/dense", {"version": 0, "checkpoint": ""}, "DenseRequest: checkpoint:"),
    ]
    for path, body, named in bad:
        code, text = http(agent.url + path, method="POST", token=TOKEN,
                          body=json.dumps(body).encode())
        err = json.loads(text)
        assert (code, err["kind"]) == (400, "BadRequest"), text
        assert err["error"].startswith(named), err
    code, text = http(agent.url + "/v1/flush", method="POST", token=TOKEN, body=b"{not json")
    assert code == 400
    assert json.loads(text)["error"].startswith("AttemptRef: body: Invalid JSON")

    wrong = Attempt(transition=Transition(base_version=5, target_version=6), mode="mixed",
                    receivers=("api",), deadline=time.time() + 60)
    with pytest.raises(AgentError, match="holds version 0") as refused:
        agent.client.prepare(wrong)
    assert refused.value.status == 409
    assert f"attempt {wrong.id} is for base 5" in str(refused.value)

    st = agent.client.status()  # nothing above changed it
    assert (st.attempt, st.version, st.gate_open) == (None, 0, True)
    fleet.assert_holds(agent, 0)


@dataclass(frozen=True, kw_only=True)
class VictimRun:
    """A refit to v1 of two pods, ``a`` (hf) and ``b`` (vllm-ref TP 2, behind ``victim``)."""

    a: Agent
    b: Agent
    victim: Any
    coordinator: Coordinator
    record: CommitRecord
    owners: list[ProcessOwner]
    commits: SqliteCommitStore


def refit(fleet: Fleet, commits: SqliteCommitStore, owners: list[ProcessOwner],
          receivers: list[ReceiverHandle], version: int) -> tuple[Coordinator, CommitRecord]:
    """Refit ``receivers`` to ``version`` (baseline ``ckpt-<version>``) by a coordinator of
    its own, rejoining by a dense load of the fleet's checkpoints; it and the record."""
    c = Coordinator(commits, owners, receivers, settings=SETTINGS,
                    dense_checkpoint=fleet.ckpts.dense)
    try:
        return c, c.refit(version, f"ckpt-{version}")
    finally:
        c.close()


def refit_with_a_victim(fleet: Fleet, victim_of: Callable[[Agent], Any]) -> VictimRun:
    """Refit two pods to v1 through two encoder processes, pod ``b`` behind the handle
    ``victim_of(b)`` that breaks something mid-attempt."""
    a, b = fleet.start(("a", "hf"), ("b", "vllm-ref"))
    profile = profile_file(fleet.tmp, [a, b])
    owners = [fleet.owner(owner=k, owners=2, profile_path=profile) for k in range(2)]
    commits = SqliteCommitStore(fleet.tmp / "commit.db", V0)
    victim = victim_of(b)
    c, record = refit(fleet, commits, owners, [a.client, victim], 1)
    return VictimRun(a=a, b=b, victim=victim, coordinator=c, record=record, owners=owners,
                     commits=commits)


class KilledBeforeFlush:
    """An agent's handle whose process is SIGKILLed mid-apply, just before its first flush.

    The kill waits until the agent has applied a payload: the journal then says it was
    applying, with unsettled writes.
    """

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.name = agent.name
        self.seen: AgentStatus | None = None

    def __getattr__(self, call: str) -> Any:
        return getattr(self.agent.client, call)

    def flush(self, attempt: Attempt) -> FlushAck:
        if self.seen is None:
            deadline = time.monotonic() + 30
            while (st := self.agent.client.status()).payloads_applied < 1:
                assert time.monotonic() < deadline, f"{self.name} never applied a payload"
                time.sleep(0.01)
            self.seen = st
            self.agent.proc.send_signal(signal.SIGKILL)
            self.agent.proc.wait(timeout=30)
        return self.agent.client.flush(attempt)


def test_an_agent_killed_mid_apply_is_left_out_then_restarted_unknown_and_rejoined_dense(
        fleet: Fleet) -> None:
    run = refit_with_a_victim(fleet, KilledBeforeFlush)
    a, b, victim, c, record = run.a, run.b, run.victim, run.coordinator, run.record
    owners, commits = run.owners, run.commits
    assert victim.seen is not None
    assert (victim.seen.state, victim.seen.dirty) == ("applying", (0, 1))
    assert b.proc.returncode == -signal.SIGKILL
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert "unreachable" in c.history[0].outcome
    assert c.history[1].receivers == ("a",)  # committed by the survivor alone
    assert record == commits.read() == CommitRecord(
        committed_version=1, baseline_id="ckpt-1", attempt=c.history[1].attempt)
    assert [o.version for o in owners] == [1, 1]
    fleet.assert_holds(a, 1)

    (b2,) = fleet.start(("b", "vllm-ref"))  # the same --state-dir (its journal), server
    assert b2.hello["version"] is None
    st = b2.client.status()
    assert st.version is None
    assert st.unknown is not None
    assert f"attempt {c.history[0].attempt} was applying" in st.unknown
    assert http(b2.url + "/readyz")[0] == 503

    c2 = Coordinator(commits, owners, [a.client, b2.client], settings=SETTINGS,
                     dense_checkpoint=fleet.ckpts.dense)
    try:
        record = c2.refit(2, "ckpt-2")
    finally:
        c2.close()
    assert outcomes(c2) == [("mixed", "committed")]
    assert c2.history[0].rejoined == ("b",)  # a dense load of v1 before the attempt
    assert c2.history[0].receivers == ("a", "b")
    assert record == commits.read() == CommitRecord(
        committed_version=2, baseline_id="ckpt-2", attempt=c2.history[0].attempt)
    assert [o.version for o in owners] == [2, 2]
    assert value(samples(http(b2.url + "/metrics")[1]), "dcr_agent_dense_loads_total") == 1
    fleet.assert_holds(a, 2)
    fleet.assert_holds(b2, 2)


class KilledMidStream:
    """An owner whose first encoder process is SIGKILLed once its first payload landed.

    Its owner runs with 1 MiB buckets, so that more payloads and the manifest would
    follow, and kills it when payload 0 appears in the store; before failing the attempt
    it watches the receiver for ``watch_s``: a receiver applies nothing its owner's
    manifest part does not list, so it must apply nothing of this attempt (it applied
    payload 0 within that time before receivers waited for the manifest). Later attempts
    run the owner as usual.
    """

    watch_s = 3.0

    def __init__(self, owner: ProcessOwner, store: Path, receiver: ReceiverHandle) -> None:
        self.owner = owner
        self.store = store
        self.receiver = receiver
        self.landed: list[str] = []
        self.manifest_written: bool | None = None
        self.applied = 0  # payloads the receiver had applied when the attempt failed

    def publish(self, attempt: Attempt) -> None:
        if self.manifest_written is not None:
            self.owner.publish(attempt)
            return
        v = attempt.transition.target_version
        cmd = self.owner.command(attempt)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        first = self.store / payload_key(v, attempt.id, 0, 0)
        deadline = time.monotonic() + 60
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.kill()
        proc.wait()
        folder = self.store / version_prefix(v) / attempt.id
        self.landed = sorted(p.name for p in folder.glob("o*.dcrp"))
        self.manifest_written = (self.store / manifest_key(v)).exists()
        deadline = time.monotonic() + self.watch_s
        while (st := self.receiver.status()).payloads_applied < 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        self.applied = st.payloads_applied
        raise DcrError(f"Encoder for {attempt.id} was killed after {len(self.landed)} "
                       "payloads.")

    def advance_baseline(self, record: CommitRecord) -> None:
        self.owner.advance_baseline(record)


def test_an_encoder_process_killed_mid_stream_is_repaired_by_an_overwrite_retry(
        fleet: Fleet) -> None:
    (a,) = fleet.start(("a", "hf"))
    owner = fleet.owner(bucket_mib=1)
    killed = KilledMidStream(owner, fleet.store, a.client)
    commits = SqliteCommitStore(fleet.tmp / "commit.db", V0)
    c = Coordinator(commits, [killed], [a.client], settings=SETTINGS)
    try:
        record = c.refit(1, "ckpt-1")
    finally:
        c.close()
    assert killed.manifest_written is False  # it died mid-stream
    assert killed.landed[0] == "o0000-s000000.dcrp"
    assert killed.applied == 0  # no manifest part listed payload 0: it was never applied
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert "was killed after" in c.history[0].outcome
    applied = http(a.url + "/metrics")[1]
    assert value(samples(applied), "dcr_agent_attempts_total", outcome="obsolete") == 1
    assert record == commits.read() == CommitRecord(
        committed_version=1, baseline_id="ckpt-1", attempt=c.history[1].attempt)
    assert owner.version == 1
    fleet.assert_holds(a, 1)


def test_dense_loads_stay_under_the_checkpoint_root_and_completions_check_their_input(
        fleet: Fleet) -> None:
    """``/v1/dense`` refuses a path outside the checkpoint root (the directory holding
    ``--canonical`` by default) and a file there that is not a checkpoint, without
    quoting the file; the weights and the gate stay as they were. Generation is the
    server's (``/v1/completions``): it refuses an id outside the vocabulary and a prompt
    longer than it allows, naming the value. Fails on 5b0b0ae: it loaded any path (500,
    leaving the agent unknown with its gate shut), a non-checkpoint file's first 8 bytes
    came back as a "header length", and an id of 10**9 gave a 500."""
    (agent,) = fleet.start(("low", "hf"))
    junk = fleet.ckpts.root / "junk.safetensors"
    secret = b"SECRET!!" + b"x" * 64
    junk.write_bytes(secret)
    try:
        for checkpoint, refusal in (("/etc", "dense loads come from under"),
                                    ("../..", "dense loads come from under"),
                                    (str(junk), "is not a readable safetensors checkpoint")):
            code, text = http(agent.url + "/v1/dense", method="POST", token=TOKEN,
                              body=json.dumps({"version": 0, "checkpoint": checkpoint}).encode())
            assert code == 409, text
            assert refusal in json.loads(text)["error"]
            assert "SECRET" not in text
            assert str(int.from_bytes(secret[:8], "little")) not in text
    finally:
        junk.unlink()
    fleet.assert_holds(agent, 0)  # version 0, clean, the gate open

    def complete(ids: list[int], n: int = 1) -> tuple[int, Any]:
        code, text = http(agent.server.url + "/v1/completions", method="POST",
                          body=json.dumps({"prompt": ids, "max_tokens": n}).encode())
        return code, json.loads(text)

    code, err = complete([1, 10**9])
    assert code == 400
    assert (f"token id {10**9} is outside the vocabulary (0..{LLAMA.vocab_size - 1})"
            in err["error"]["message"])
    code, err = complete([1] * 4097)
    assert code == 400
    assert "4097 token ids; at most 4096" in err["error"]["message"]
    code, out = complete([1, 2, 3], 2)
    assert code == 200
    assert len(out["choices"][0]["token_ids"]) == 2
    assert http(agent.url + "/v1/generate", method="POST", token=TOKEN, body=b"{}")[0] == 404


class ServerRestartedMidAttempt:
    """A pod's handle whose server is SIGKILLed and restarted on its port right after
    the agent opened apply (its journal says dirty), before any payload reached it."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.name = agent.name
        self.instances: list[str] = []

    def __getattr__(self, call: str) -> Any:
        return getattr(self.agent.client, call)

    def open_apply(self, attempt: Attempt) -> AgentStatus:
        st = self.agent.client.open_apply(attempt)
        if not self.instances:
            engine = self.agent.server.engine()
            self.instances.append(engine.instance())
            self.agent.server.restart()  # SIGKILL, then the same port: what v0 loads
            self.instances.append(engine.instance())
        return st


def test_a_server_restarted_mid_refit_is_seen_as_a_new_instance_and_rejoined_dense(
        fleet: Fleet) -> None:
    """The agent's weights live in the server: a restarted server holds what it loaded
    at start, whatever the agent's journal says. Its agent sees a new instance id, fails
    the attempt, reports its weights unknown, and is restored by a dense load before the
    overwrite retry; both pods end bit-exact with v1."""
    run = refit_with_a_victim(fleet, ServerRestartedMidAttempt)
    a, b, victim, c, record = run.a, run.b, run.victim, run.coordinator, run.record
    commits = run.commits
    before, after = victim.instances
    assert before != after
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert "b: attempt" in c.history[0].outcome
    assert c.history[1].rejoined == ("b",)  # unknown weights: a dense load of v0 first
    assert c.history[1].receivers == ("a", "b")
    assert record == commits.read() == CommitRecord(
        committed_version=1, baseline_id="ckpt-1", attempt=c.history[1].attempt)
    journal = json.loads((fleet.tmp / "b" / "agent" / "journal.json").read_text())
    assert (journal["version"], journal["instance"]) == (1, after)
    assert value(samples(http(b.url + "/metrics")[1]), "dcr_agent_dense_loads_total") == 1
    assert "the engine restarted (instance" in b.process.log_path.read_text()
    fleet.assert_holds(a, 1)
    fleet.assert_holds(b, 1)


# A bit of rank 1's shard of a tensor every step changes; one of a tensor each rank holds
# whole and the AdamW step leaves as it is in BF16.
TOUCHED = {"lm_head.weight": 3000 * 256 + 7}
UNTOUCHED = {"model.layers.1.input_layernorm.weight": 9}


@pytest.mark.parametrize("flips", [TOUCHED | UNTOUCHED, UNTOUCHED], ids=["both", "untouched"])
def test_a_tp_server_whose_ranks_loaded_wrong_bits_is_rejoined_before_the_fleet_commits(
        tmp_path: Path, adamw_checkpoints: Checkpoints, flips: dict[str, int]) -> None:
    """One pod's TP 2 server started from v0 with a bit flipped in a tensor every step
    changes (in rank 1's shard of it) and one in a tensor each rank holds whole. The flush
    compares every tensor and region each rank holds, touched or not: that pod fails the
    attempt, is rejoined densely, and v1 commits with every rank of both pods equal to a
    dense load of v1."""
    fleet = Fleet(tmp_path, adamw_checkpoints)
    checkpoints = adamw_checkpoints
    fleet.models["flipped"] = fleet.tmp / "flipped-v0"  # outside the root: a rejoin reads v0
    flip_bits(checkpoints.dir(0), fleet.models["flipped"], flips)
    try:
        _commits_after_rejoin(fleet, checkpoints, flips)
    finally:
        fleet.close()


def _commits_after_rejoin(fleet: Fleet, checkpoints: Checkpoints, flips: dict[str, int]
                          ) -> None:
    clean, flipped = fleet.start(("clean", "vllm-ref"), ("flipped", "vllm-ref"))
    assert flipped.client.fingerprint() != clean.client.fingerprint()
    owner = fleet.owner(profile_path=profile_file(fleet.tmp, [clean, flipped]))
    c = Coordinator(SqliteCommitStore(fleet.tmp / "commit.db", V0), [owner],
                    [clean.client, flipped.client], settings=SETTINGS,
                    dense_checkpoint=checkpoints.dense)
    assert c.refit(1, "ckpt-1").committed_version == 1
    first, last = c.history[0], c.history[-1]
    assert "flipped: attempt" in first.outcome
    assert "differ from the manifest's target at flush" in first.outcome
    quoted = {n: f"'{n}@" if n in TOUCHED else f"'{n}'" for n in flips}  # a region: rank 1's
    assert all(q in first.outcome for q in quoted.values())
    assert (last.outcome, last.rejoined) == ("committed", ("flipped",))
    want = dense_fingerprint(checkpoints, "vllm-ref", 1)  # the norms are v0's too
    for a in (clean, flipped):
        got = a.client.fingerprint()
        assert got.keys() == want.keys()
        assert [n for n in want if got[n] != want[n]] == [], a.name
        st = a.client.status()
        assert (st.version, st.dirty, st.unknown, st.gate_open) == (1, None, None, True)
    c.close()


# --- versions: skew and upgrades (docs/upgrades.md) ----------------------------------

NEXT_RELEASE = "0.999.0"  # the "new build" of an upgrade: this code, named another release


def test_an_agent_one_api_version_ahead_is_refused_by_name_and_left_out_of_the_refit(
        fleet: Fleet) -> None:
    (a,) = fleet.start(("a", "hf"))
    ahead_of_us = (r"Agent ahead's answer \(GET /v1/profile\) has agent API version 2, but "
                   rf"this DCR {__version__} reads agent API version 1")
    with pytest.raises(AgentError, match=ahead_of_us):
        fleet.start(("ahead", "hf"), env={OVERRIDE_ENV: "agent-api=2"})
    ahead = fleet.agents[-1].client()
    code, text = http(ahead.url + "/v1/status", token=TOKEN)  # as an older client asks
    assert (code, json.loads(text)) == (400, {"kind": "VersionSkew", "error": (
        f"The request has agent API version 1, but this DCR {__version__} reads agent API "
        "version 2: upgrade the older side within the supported skew (docs/upgrades.md, "
        '"Skew").')})

    commits = SqliteCommitStore(fleet.tmp / "commit.db", V0)
    owners = [fleet.owner(profile_path=profile_file(fleet.tmp, [a]))]
    c, record = refit(fleet, commits, owners, [a.client, ahead], 1)
    assert outcomes(c) == [("mixed", "committed")]
    assert (c.history[0].receivers, c.history[0].left_out) == (("a",), ("ahead",))
    assert record == commits.read()
    fleet.assert_holds(a, 1)
    req = urllib.request.Request(ahead.url + "/v1/status", headers={
        "Authorization": f"Bearer {TOKEN}", AGENT_API.header: "2"})
    with urllib.request.urlopen(req, timeout=30) as resp:  # in its own version: untouched
        st = json.loads(resp.read())
    assert (st["version"], st["attempt"], st["gate_open"]) == (0, None, True)


def test_a_manifest_of_the_next_format_is_refused_by_name_before_any_gate_closes(
        fleet: Fleet) -> None:
    (a,) = fleet.start(("a", "hf"))
    commits = SqliteCommitStore(fleet.tmp / "commit.db", V0)
    owners = [fleet.owner(profile_path=profile_file(fleet.tmp, [a]),
                          env={OVERRIDE_ENV: "manifest=3"})]  # an encoder one format ahead
    c = Coordinator(commits, owners, [a.client], dense_checkpoint=fleet.ckpts.dense,
                    settings=CoordinatorSettings(attempt_timeout_s=60.0, gate="async",
                                                 max_attempts=1))
    try:
        with pytest.raises(RefitFailed):
            c.refit(1, "ckpt-1")
    finally:
        c.close()
    (failed,) = c.history
    part = (fleet.store / f"v0000000001/{failed.attempt}/manifest-o0000.dcrm").as_uri()
    assert (f"Manifest {part} has manifest format version 3, but this DCR {__version__} "
            "reads manifest format version 2") in failed.outcome
    assert "gate" not in failed.stages  # refused while staging, before any gate closed
    assert commits.read() == V0
    fleet.assert_holds(a, 0)


class UpgradedBeforeFlush:
    """An agent's handle whose process is rolled onto the new build (SIGTERM, then the
    same pod started with :data:`NEXT_RELEASE`) the first time the coordinator flushes it,
    as a rolling update of the fleet's pods would replace it mid-refit; the flush goes on
    once the new pod is ready (its engine met and prewarmed), as the rollout waits for a
    replaced pod's readiness before it rolls the next."""

    def __init__(self, agent: Agent) -> None:
        self.agent, self.name, self.rolled = agent, agent.name, False

    def __getattr__(self, call: str) -> Any:
        return getattr(self.agent.client, call)

    def flush(self, attempt: Attempt) -> FlushAck:
        if not self.rolled:
            self.rolled = True
            self.agent.process.stop()
            self.agent.process.env[OVERRIDE_ENV] = f"release={NEXT_RELEASE}"
            self.agent.process.start()
            self.agent.process.wait_ready()
            self.agent.client.profile()  # returns once the engine is prewarmed
        return self.agent.client.flush(attempt)


def test_agents_rolled_one_at_a_time_onto_a_new_build_mid_refit_keep_refits_bit_exact(
        fleet: Fleet) -> None:
    a, b = fleet.start(("a", "hf"), ("b", "vllm-ref"))
    profile = profile_file(fleet.tmp, [a, b])
    owners = [fleet.owner(owner=k, owners=2, profile_path=profile) for k in range(2)]
    commits = SqliteCommitStore(fleet.tmp / "commit.db", V0)
    assert {a.client.release, b.client.release} == {__version__}
    for version, rolled in ((1, a), (2, b)):  # one pod per refit, as maxUnavailable: 1
        handles: list[ReceiverHandle] = [
            UpgradedBeforeFlush(p) if p is rolled else p.client for p in (a, b)]
        c, record = refit(fleet, commits, owners, handles, version)
        assert record == commits.read()
        assert record.committed_version == version
        assert outcomes(c)[-1] == ("overwrite", "committed")  # after the rolled pod's retry
        for pod in (a, b):
            fleet.assert_holds(pod, version)  # every parameter and buffer, bit for bit
    assert (a.client.release, b.client.release) == (NEXT_RELEASE, NEXT_RELEASE)
