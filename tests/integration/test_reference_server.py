"""Real ``dcr serve`` processes on loopback, driven only through the agent's ``VllmDriver``.

Each server holds a tiny Llama (``--runtime hf``, or both ranks of the vLLM-layout
reference at TP 2) with DCR's worker extension in every rank, reads payloads from a
staging directory by file name and dense checkpoints from a checkpoint root, as a vLLM
server started with the plugin would. Payloads are made by the owner's own diff
(``diff_checkpoints`` + ``EncodeSettings``) between checkpoints of real AdamW steps and
written to the staging directory under their file names. Bits are compared through the
engine's fingerprint (xxh3-128 of every parameter and buffer's integer view, per rank)
against a second server that loaded the target densely through the same loader.
Completions (the serving side, not the agent's) are posted with a small helper.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from promtext import matching, samples
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen2MoeConfig

import vllm_serve  # the coordinator as `dcr refit` runs it; needs no vLLM
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.client import read_events, read_history, sample_commits, token_versions
from dcr.drivers import EngineError, VllmDriver
from dcr.errors import ConfigError
from dcr.files.history import HistoryStore
from dcr.format.manifest import Manifest
from dcr.format.names import Mode
from dcr.format.profile import ReceiverProfile
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.refit.launch import AgentProcess
from dcr.runtimes.vllm_reference import ReferenceConfig, random_checkpoint
from dcr.settings import MiB
from dcr.transport.store import MemoryStore, open_store

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.e2e]

KEY = "serve-test-key-0123456789abcdef"
LLAMA = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False)
START_TIMEOUT_S = 120.0
STEP_S = 0.05  # --min-step-s of the pause test's server: a 60-token completion takes 3 s


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory,
              export_llama_versions: Callable[..., None]) -> Path:
    """The checkpoint root: versions 0..2 of a tiny Llama, each a ``save_pretrained``
    directory in BF16, one real AdamW step apart (lr 1e-3, random tokens)."""
    root = tmp_path_factory.mktemp("ckpts")
    export_llama_versions(root, LLAMA)
    return root


MOE = ReferenceConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=False, num_experts=4,
                      moe_intermediate_size=32)


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Versions 0..2 of a tiny MoE in the Qwen2-MoE layout without shared experts (the
    reference's), each a safetensors file and a config.json, about 3% of elements apart."""
    root = tmp_path_factory.mktemp("moe")
    state = random_checkpoint(MOE, 0)
    gen = torch.Generator().manual_seed(1)
    for v in range(3):
        if v:
            state = {n: torch.where(torch.rand(t.shape, generator=gen) < 0.03,
                                    (t.float() * 1.05 + 1e-3).to(torch.bfloat16), t)
                     for n, t in state.items()}
        (root / f"v{v}").mkdir()
        save_file(state, root / f"v{v}" / "model.safetensors")
        Qwen2MoeConfig(vocab_size=MOE.vocab_size, hidden_size=MOE.hidden_size,
                       intermediate_size=MOE.intermediate_size,
                       num_hidden_layers=MOE.num_layers, num_attention_heads=MOE.num_heads,
                       num_key_value_heads=MOE.num_kv_heads, num_experts=MOE.num_experts,
                       moe_intermediate_size=MOE.moe_intermediate_size,
                       shared_expert_intermediate_size=0,
                       tie_word_embeddings=False).save_pretrained(root / f"v{v}")
    return root


def canonical(ckpt: Path) -> list[CanonicalTensor]:
    with Checkpoint(ckpt) as c:
        return [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=i.shape) for i in c]


# --- servers ---------------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    engine: VllmDriver
    log: Path

    @property
    def port(self) -> int:
        return int(urllib.parse.urlsplit(self.url).port or 0)


class Servers:
    """``dcr serve`` processes of one test over one staging directory and checkpoint
    root; every one is killed at teardown."""

    def __init__(self, tmp: Path, root: Path) -> None:
        self.tmp, self.root = tmp, root
        self.staging = tmp / "staging"
        self.staging.mkdir()
        self.key_file = tmp / "api-key"
        self.key_file.write_text(KEY + "\n")
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, runtime: str = "hf", *, tp: int = 1, port: int = 0,
              extra: tuple[str, ...] = (), version: int = 0) -> Server:
        cmd = [sys.executable, "-m", "dcr", "serve", "--runtime", runtime,
               "--model", str(self.root / f"v{version}"), "--listen", f"127.0.0.1:{port}",
               "--api-key-file", str(self.key_file), "--staging-dir", str(self.staging),
               "--checkpoint-root", str(self.root), "--weight-version", str(version),
               *extra]
        if tp > 1:
            cmd += ["--tp-size", str(tp)]
        log = self.tmp / f"serve-{len(self.procs)}.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=err, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        if not line:
            proc.kill()
            pytest.fail(f"dcr serve did not start:\n{log.read_text()[-3000:]}")
        url = json.loads(line)["url"]
        return Server(proc=proc, url=url, engine=VllmDriver(url, KEY), log=log)

    def stage(self, base: int, target: int, mode: Mode,
              profile: ReceiverProfile | None) -> tuple[list[str], Manifest]:
        """Diff version ``base`` -> ``target`` as an owner would, and write each payload
        to the staging directory; the file names in order, and the manifest."""
        store = MemoryStore()
        settings = EncodeSettings(target_version=target, base_version=base, mode=mode,
                                  profile=profile, bucket_bytes=1 * MiB, attempt_manifest=True)
        with Checkpoint(self.root / f"v{base}") as b, Checkpoint(self.root / f"v{target}") as t:
            manifest = diff_checkpoints(b, t, store, settings)
        names = []
        for p in sorted(manifest.payloads, key=lambda p: (p.owner, p.seq)):
            name = f"{manifest.attempt}-o{p.owner:04d}-s{p.seq:06d}.dcrp"
            (self.staging / name).write_bytes(store.get(p.key))
            names.append(name)
        return names, manifest

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def servers(tmp_path: Path, ckpt_root: Path) -> Iterator[Servers]:
    s = Servers(tmp_path, ckpt_root)
    yield s
    s.close()


def post(url: str, path: str, body: Any, key: str | None = KEY) -> tuple[int, Any]:
    """A request of the serving side (completions), not the agent's."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def complete(server: Server, tokens: int, **kw: Any) -> tuple[int, Any]:
    return post(server.url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": tokens,
                                                "return_weight_versions": True, **kw})


@dataclass(eq=False)
class Streamed:
    """A streamed completion read in a thread: its chunks as they arrive."""

    server: Server
    prompt: list[int]
    tokens: int
    chunks: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    status: int | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        parts = urllib.parse.urlsplit(self.server.url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=300)
        try:
            conn.request("POST", "/v1/completions", json.dumps({
                "prompt": self.prompt, "max_tokens": self.tokens, "stream": True,
                "return_weight_versions": True}), {"Content-Type": "application/json",
                                                   "Authorization": f"Bearer {KEY}"})
            resp = conn.getresponse()
            self.status = resp.status
            for line in resp:
                self.raw.append(line)
                self.chunks.extend(read_events([line]))
        except BaseException as e:
            self.error = e
        finally:
            conn.close()

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c["choices"][0]["token_ids"]]

    def join(self) -> Streamed:
        self.thread.join(300)
        assert self.error is None, self.error
        return self


def metric(server: Server, name: str) -> int:
    parts = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    (one,) = matching(samples(text), f"vllm:{name}").values()  # one model served
    return int(one)


def until(server: Server, name: str, value: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(server, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


# --- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize(("runtime", "tp", "pp", "model"), [
    ("hf", 1, 1, "llama"), ("vllm-ref", 2, 1, "llama"), ("vllm-ref", 2, 2, "llama"),
    ("vllm-ref", 2, 1, "moe"), ("vllm-ref", 2, 1, "moe-ep")])
def test_staged_payloads_applied_through_the_plugin_equal_a_dense_load_on_every_rank(
        servers: Servers, moe_root: Path, runtime: str, tp: int, pp: int,
        model: str) -> None:
    """Also with two pipeline stages of two TP ranks, where each stage applies what it
    holds, and with a MoE whose experts each rank shards, or holds whole and skips the
    other rank's (``--expert-parallel``); every rank checks its tensors and regions
    against the manifest."""
    extra = ("--pp-size", str(pp)) if pp > 1 else ()
    if model != "llama":
        servers.root = moe_root
        extra += ("--expert-parallel",) if model == "moe-ep" else ()
    refit = servers.start(runtime, tp=tp, extra=extra)
    dense = servers.start(runtime, tp=tp, extra=extra)
    tensors = canonical(servers.root / "v0")
    profile = refit.engine.prewarm(tensors).profile
    assert set(profile.tensors) == {t.name for t in tensors}
    assert bool(profile.regions) == (tp > 1)
    experts = [n for n in profile.tensors if ".experts." in n]
    assert bool(experts) == (model != "llama")
    # sharded experts are checked by region; an EP rank holds its experts whole
    assert [n for n in experts if n in profile.regions] == ([] if model == "moe-ep"
                                                             else experts)
    start = refit.engine.fingerprint()
    ranks = tp * pp
    assert len(start) == ranks
    assert refit.engine.instance() != dense.engine.instance()

    for base, target, mode in ((0, 1, "mixed"), (1, 2, "overwrite")):
        names, manifest = servers.stage(base, target, mode, profile)
        assert names
        refit.engine.pause("wait")
        outcome = refit.engine.apply(names)
        refit.engine.sync()
        refit.engine.set_version(str(target))
        refit.engine.resume()
        assert len(outcome.reports) == ranks
        assert outcome.names
        assert outcome.names <= {t.name for t in tensors}
        expect = {t.name: t.target for t in manifest.tensors} | manifest.region_sums()
        assert len(manifest.region_sums()) == sum(map(len, profile.regions.values()))
        assert refit.engine.check_targets(expect) == {}

        dense.engine.load_dense(f"v{target}",
                                expect={t.name: t.target for t in manifest.tensors})
        got, want = refit.engine.fingerprint(), dense.engine.fingerprint()
        for rank in range(ranks):
            differ = sorted(n for n in want[rank] if got[rank].get(n) != want[rank][n])
            assert got[rank].keys() == want[rank].keys()
            assert differ == [], f"rank {rank} differs from a dense load of v{target}"
        assert refit.engine.version() == str(target)

    moved = [n for n in start[0] if start[0][n] != got[0][n]]
    assert len(moved) >= len(start[0]) // 2  # not vacuous: the weights did change


def test_names_that_leave_the_staging_dir_or_checkpoint_root_are_refused_and_change_nothing(
        servers: Servers, request: pytest.FixtureRequest) -> None:
    server = servers.start()
    engine = server.engine
    engine.prewarm(canonical(servers.root / "v0"))
    before = engine.fingerprint()
    secret = servers.tmp / "outside.dcrp"
    names, _ = servers.stage(0, 1, "mixed", None)
    secret.write_bytes((servers.staging / names[0]).read_bytes())
    (servers.staging / "link.dcrp").symlink_to(secret)
    outside = servers.tmp / "outside-v1"  # a real checkpoint, outside the root
    outside.mkdir()
    for f in (servers.root / "v1").iterdir():
        (outside / f.name).write_bytes(f.read_bytes())
    escape = servers.root / f"escape-{servers.tmp.name}"  # a link in the root leading out
    escape.symlink_to(outside)
    request.addfinalizer(escape.unlink)

    refused = [
        ("dcr_apply", {"payloads": ["../outside.dcrp"]}),
        ("dcr_apply", {"payloads": [str(secret)]}),
        ("dcr_apply", {"payloads": ["link.dcrp"]}),  # a link out of the staging dir
        ("dcr_load_dense", {"checkpoint": "../outside-v1", "expect": None}),
        ("dcr_load_dense", {"checkpoint": escape.name, "expect": None}),
        ("dcr_load_dense", {"checkpoint": str(servers.root / "v1"), "expect": None}),
        ("dcr_load_dense", {"checkpoint": "v1", "expect": {"lm_head.weight": "xxh3-128:0"}}),
    ]
    for method, arg in refused:
        with pytest.raises(EngineError) as e:
            engine.rpc(method, arg)
        assert e.value.status == 400
        assert f"{method} (POST /collective_rpc)" in str(e.value)
    with pytest.raises(EngineError, match="is not one of DCR's plugin methods"):
        engine.rpc("load_model")
    # The adapter refuses the same names before it sends anything.
    with pytest.raises(ConfigError):
        engine.apply(["../outside.dcrp"])
    with pytest.raises(ConfigError):
        engine.load_dense("/etc")
    assert engine.fingerprint() == before
    assert engine.apply(names).names  # the same payloads under their own names apply


def test_pause_modes_drain_abort_or_park_completions_in_flight_and_gate_new_ones(
        servers: Servers) -> None:
    server = servers.start(extra=("--min-step-s", str(STEP_S)))
    engine = server.engine
    pool = ThreadPoolExecutor(4)

    # keep: the completion in flight parks and continues after resume; one sent while
    # paused waits for resume instead of being refused.
    first: Future[tuple[int, Any]] = pool.submit(complete, server, 60)
    until(server, "num_requests_running", 1)
    engine.pause("keep")
    assert engine.is_paused()
    held = pool.submit(complete, server, 4)
    until(server, "num_requests_waiting", 1)
    engine.set_version("1")
    engine.resume()
    status, answer = held.result(timeout=60)
    assert status == 200
    assert answer["choices"][0]["weight_versions"] == [{"version": "1", "start": 0, "end": 4}]
    engine.pause("wait")  # drains: the first completion ends on its own
    status, answer = first.result(timeout=60)
    choice = answer["choices"][0]
    assert (status, choice["finish_reason"], len(choice["token_ids"])) == (200, "length", 60)
    assert [s["version"] for s in choice["weight_versions"]] == ["0", "1"]
    engine.resume()

    # abort: the completion in flight ends at its next step; new ones get 503 until resume.
    third = pool.submit(complete, server, 60)
    until(server, "num_requests_running", 1)
    engine.pause("abort")
    status, answer = third.result(timeout=60)
    assert (status, answer["choices"][0]["finish_reason"]) == (200, "abort")
    assert len(answer["choices"][0]["token_ids"]) < 60
    status, answer = complete(server, 2)
    assert (status, answer["error"]["type"]) == (503, "ServiceUnavailableError")
    engine.resume()

    # wait: the completion in flight runs to its end before pause returns.
    fourth = pool.submit(complete, server, 8)
    until(server, "num_requests_running", 1)
    engine.pause("wait")
    assert metric(server, "num_requests_running") == 0
    status, answer = fourth.result(timeout=60)
    assert (status, answer["choices"][0]["finish_reason"]) == (200, "length")
    assert complete(server, 2)[0] == 503
    engine.resume()
    assert not engine.is_paused()
    assert complete(server, 2)[0] == 200
    pool.shutdown()

    for body, named in (({"prompt": [1, 600], "max_tokens": 2}, "token id 600"),
                        ({"prompt": [1], "max_tokens": 100_000}, "max_tokens"),
                        ({"prompt": [1], "temperature": -1.0}, "temperature"),
                        ({"prompt": [1], "logprobs": 1}, "logprobs"),
                        ({"prompt": [1], "n": 2}, "n")):
        status, answer = post(server.url, "/v1/completions", body)
        assert status == 400
        assert named in answer["error"]["message"], answer


def test_a_restarted_server_is_seen_as_a_new_instance_and_calls_need_the_api_key(
        servers: Servers) -> None:
    first = servers.start()
    engine = first.engine
    instance = engine.instance()
    assert engine.instance() == instance  # fixed while the process lives
    engine.set_version("7")
    assert (engine.health(), engine.version()) == (True, "7")

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    assert not engine.health()
    with pytest.raises(EngineError, match="no answer") as e:
        engine.instance()
    assert (e.value.status, e.value.call) == (None, "instance")

    again = servers.start(port=first.port)
    assert again.url == first.url
    assert engine.instance() != instance  # the same adapter sees a new engine
    assert engine.version() == "0"  # weights and label as the process started

    for key in (None, "wrong-key-0123456789abcdef"):
        stranger = VllmDriver(again.url, key)
        assert stranger.health()  # the probe needs no key
        with pytest.raises(EngineError) as e:
            stranger.instance()
        assert e.value.status == 401
    with pytest.raises(ConfigError):
        VllmDriver(again.url, "kéy")
    env = {k: v for k, v in os.environ.items() if k != "DCR_SERVE_API_KEY"}
    refused = subprocess.run(
        [sys.executable, "-m", "dcr", "serve", "--model", str(servers.root / "v0"),
         "--listen", "0.0.0.0:0", "--staging-dir", str(servers.staging)],
        capture_output=True, text=True, timeout=120, env=env, check=False)
    assert refused.returncode == 1
    assert "beyond loopback the server needs an API key" in refused.stderr
    conn = http.client.HTTPConnection("127.0.0.1", again.port, timeout=30)
    conn.putrequest("POST", "/collective_rpc")
    conn.putheader("Authorization", "Bearer k\xe9y".encode("latin-1"))
    conn.putheader("Content-Length", "0")
    conn.endheaders()
    assert conn.getresponse().status == 401  # a non-ASCII header is a 401, not a 500
    conn.close()


class PauseWhenInFlight:
    """The agent's client to a coordinator, whose ``close_gate`` first calls ``before``: the
    refit's pause lands on completions known to be in flight, however long encoding took."""

    def __init__(self, client: Any, before: Callable[[], None]) -> None:
        self._client, self._before = client, before

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def close_gate(self) -> Any:
        self._before()
        return self._client.close_gate()


FLIGHT = 120  # tokens of each completion frozen across the refit: 6 s at STEP_S


def test_a_completion_frozen_by_keep_across_a_refit_reports_both_versions_where_they_changed(
        servers: Servers, tmp_path: Path) -> None:
    """A real refit (``dcr agent --pause-mode keep``, ``dcr encode`` owners, a coordinator
    recording the store's history) lands while two completions are in flight, one
    streamed and one not. Each reports version 1 up to the token where the pause froze it
    and version 2 from there, those tokens are version 1's own continuation before and a
    fresh version-2 server's after, and each label names the commit that made it."""
    server = servers.start(extra=("--min-step-s", str(STEP_S)))
    dirs = [servers.root / f"v{v}" for v in range(3)]
    store = tmp_path / "store"
    agent = AgentProcess(name="rollout-0", state_dir=tmp_path / "agent",
                         token="agent-test-token-0123456789abcdef",
                         args=["--store", store.as_uri(), "--engine-url", server.url,
                               "--engine-api-key-file", str(servers.key_file),
                               "--staging-dir", str(servers.staging),
                               "--canonical", str(dirs[0]), "--model-version", "0",
                               "--pause-mode", "keep"])
    agent.start()
    try:
        agent.wait_ready()
        client = agent.client(timeout_s=300)
        flights: list[Any] = []
        pool = ThreadPoolExecutor(1)

        def start_flights() -> None:
            if flights:
                return
            flights.append(Streamed(server, [1, 2, 3], FLIGHT))
            flights.append(pool.submit(complete, server, FLIGHT))
            until(server, "num_requests_running", 2)
            deadline = time.monotonic() + 60
            while len(flights[0].token_ids) < 4:
                assert time.monotonic() < deadline, "the streamed completion did not start"
                time.sleep(0.01)

        _, coordinator = vllm_serve.refitter(tmp_path, dirs, client, store)
        history = HistoryStore(open_store(store.as_uri()))
        digests: list[str] = []
        coordinator.on_commit = lambda record, owners: digests.append(
            history.commit(record.committed_version, record.attempt, owners))
        first = coordinator.refit(1, str(dirs[1]))
        _, before = complete(server, FLIGHT)  # version 1's own continuation
        coordinator.receivers = [PauseWhenInFlight(client, start_flights)]
        second = coordinator.refit(2, str(dirs[2]))
        streamed = flights[0].join()
        status, answer = flights[1].result(timeout=300)
        pool.shutdown()
        coordinator.close()
    finally:
        agent.kill()

    assert (streamed.status, status) == (200, 200)
    assert streamed.raw[-2:] == [b"data: [DONE]\n", b"\n"]
    assert [len(c["choices"][0]["token_ids"]) for c in streamed.chunks] == [1] * FLIGHT + [0]
    assert streamed.chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("weight_versions" not in c["choices"][0] for c in streamed.chunks[:-1])
    fresh = servers.start(version=2)  # the target, loaded densely
    proof = sample_commits(["1", "2"], read_history(store.as_uri(), digests[-1]))
    assert [(c.version, c.attempt) for c in proof.values()] == [
        (1, first.attempt), (2, second.attempt)]
    assert all(len(c.manifests) == 1 and c.history_digest == digests[-1]
               for c in proof.values())
    for got, tokens in ((streamed.chunks, streamed.token_ids),
                        (answer, answer["choices"][0]["token_ids"])):
        versions = token_versions(got)
        k = versions.index("2")
        assert 0 < k < FLIGHT, "the pause did not find the completion in flight"
        assert versions == ["1"] * k + ["2"] * (FLIGHT - k)
        assert tokens[:k] == before["choices"][0]["token_ids"][:k]
        _, rest = post(fresh.url, "/v1/completions", {"prompt": [1, 2, 3, *tokens[:k]],
                                                      "max_tokens": FLIGHT - k})
        assert tokens[k:] == rest["choices"][0]["token_ids"]
        assert tokens[k:] != before["choices"][0]["token_ids"][k:]  # the label is not vacuous


@contextlib.contextmanager
def asking(server: Server, body: Any, headers: dict[str, str]
           ) -> Iterator[http.client.HTTPResponse]:
    """A completion with ``headers``; its answer, to be read while the connection lasts."""
    parts = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {
            "Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **headers})
        yield conn.getresponse()
    finally:
        conn.close()


def ask(server: Server, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    with asking(server, body, headers) as answer:
        return answer.status, json.loads(answer.read())


def test_completions_honour_the_staleness_headers_as_the_client_door_does(
        servers: Servers) -> None:
    """X-DCR-Min-Version is a 409 naming both versions while the label is older; a
    completion that X-DCR-Max-Version-Span: 0 bounds, frozen by a keep pause while the label
    moves on, is ended with the reason: a stream's last event (no [DONE]), else a 409.
    Without the headers' checks both completions end normally with [DONE] and a 200."""
    server = servers.start(extra=("--min-step-s", str(STEP_S)))
    engine = server.engine
    engine.set_version("1")
    body = {"prompt": [1, 2, 3], "max_tokens": FLIGHT}
    status, error = ask(server, body, {"X-DCR-Min-Version": "2"})
    assert (status, error["kind"]) == (409, "StaleVersion")
    assert "committed version is 1; the request accepts 2 or newer" in error["error"]
    assert ask(server, body, {"X-DCR-Min-Version": "x"})[1]["kind"] == "BadRequest"
    span = {"X-DCR-Max-Version-Span": "0"}
    with ThreadPoolExecutor(1) as pool, asking(server, {**body, "stream": True},
                                               span) as streamed:
        whole = pool.submit(ask, server, body, span)
        lines = [streamed.readline()]  # its first token: both are under way
        until(server, "num_requests_running", 2)
        engine.pause("keep")  # what the agent does around a refit under keep
        engine.set_version("2")
        engine.resume()
        lines += list(streamed)
        unstreamed = whole.result(timeout=300)
    events = [json.loads(line[6:]) for line in lines
              if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]")]
    assert streamed.status == 200
    assert b"data: [DONE]\n" not in lines
    error = events[-1]["error"]
    assert (error["type"], error["code"]) == ("VersionSpanExceeded", 409)
    assert "from 1 to 2, more than the 0 versions" in error["message"]
    assert 0 < len(events) - 1 < FLIGHT  # ended at the refit
    assert (unstreamed[0], unstreamed[1]["kind"]) == (409, "VersionSpanExceeded")
    assert ask(server, body, {"X-DCR-Min-Version": "2", **span})[0] == 200  # a new one is served
