"""``make gpu-check``: DCR refitting a real ``vllm serve`` through the agent sidecar, on a GPU.

One script, meant to finish in under 8 minutes on one H200:

1. **Checkpoints.** A Llama-family model (``--model-size 1b``: ~1.1 B parameters) is
   made offline with transformers (random init), then trained for ``--steps`` real
   AdamW steps at lr 1e-6 on random tokens with FP32 master weights; every version is
   exported in BF16 (``v0`` .. ``vN``, with a word-level tokenizer so the engine serves
   text as usual). At lr 1e-6 about 1% of the BF16 elements change per step.
   With ``--engine reference``, the applier alone next (``paths.py``): two copies of
   ``v0`` in this process, one applied with records expanded on the host, one on the
   device, the same sets side by side (the AdamW steps, then uniform 1%, 3%, 5%): apply
   seconds, dense-equivalent GB/s, the split (decode, upload, expand, scatter, loader),
   the check of every target fingerprint, and both copies' bits.
2. **The rollout pod, as processes.** The engine (``vllm serve`` with
   ``--worker-extension-cls dcr.runtimes.vllm.DcrWorkerExtension`` and
   ``VLLM_SERVER_DEV_MODE=1``; or, for the CPU dry run, ``dcr serve``) and the agent
   sidecar (``dcr agent --engine vllm --engine-url ... --staging-dir ...``) share a
   staging directory; versions lie side by side under the checkpoint root.
3. **Refits through the sidecar.** A local coordinator, as ``dcr refit`` runs it (SQLite
   commit record, ``dcr encode`` owner processes, a ``file://`` store), refits the agent
   one version at a time. A completion streams through every refit (the pause a request
   in flight sees). After each, **every rank's fingerprint** (xxh3-128 of every parameter
   and buffer's integer view) is compared with the same ranks' fingerprint after a dense
   load of that version through the same loader (``dcr_load_dense``).
4. **Apply throughput.** With the agent stopped, the engine is loaded densely with ``v0``
   and the same steps are applied again straight through the engine adapter (payloads
   from the owner's diff staged as files), each inside ``pause(keep)`` / ``resume`` with
   a completion streaming: apply seconds (the adapter's call, end to end), the
   dense-equivalent throughput (the model's BF16 bytes / apply seconds), the plugin's own
   split, the longest gap between tokens of the request in flight, and a dense load's
   seconds for comparison. The last version's fingerprints must again equal the dense
   load's.

Writes ``--out`` (``bench/results/gpu.json`` for vLLM; the dry run writes
``bench/results/gpu-dry.json`` so that it never stands in for a GPU result). Exits 1 if
any fingerprint differs. Nothing here asserts a time: numbers are recorded, not judged.

Dry run on CPU: ``make gpu-check ENGINE=reference MODEL_SIZE=tiny`` (``dcr serve
--runtime hf``, a tiny model): the same steps, to show the script works end to end.
With ``--engine reference`` on a machine with CUDA, ``dcr serve --device cuda`` holds the
transformers model on the GPU and DCR's plugin applies there: the CUDA paths of the apply
engine, through the sidecar, where vLLM itself cannot be installed (written to
``bench/results/gpu-reference.json``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import secrets
import select
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SIZES: dict[str, dict[str, int]] = {  # LlamaConfig fields
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192,
           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
}
SERVED = "policy"  # the served model name
START_TIMEOUT_S = 600.0


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- 1. checkpoints ---------------------------------------------------------------------------


def make_checkpoints(root: Path, size: str, steps: int, lr: float, device: str) -> dict[str, Any]:
    """``v0`` .. ``v<steps>`` under ``root``: random init, then AdamW steps, BF16 exports."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], tie_word_embeddings=False,  # type: ignore[arg-type]
                         max_position_embeddings=4096)
    with torch.device(device):
        model = LlamaForCausalLM(config)  # FP32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    params = sum(p.numel() for p in model.parameters())
    losses = []
    for v in range(steps + 1):
        if v:
            ids = torch.randint(0, config.vocab_size, (4, 256), device=device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        out = root / f"v{v}"
        bf16 = {k: t.detach().to(torch.bfloat16).contiguous()
                for k, t in model.state_dict().items()}
        model.save_pretrained(out, state_dict=bf16)
        meta = json.loads((out / "config.json").read_text())
        meta["dtype"] = "bfloat16"  # what the tensors are (the live model is FP32)
        (out / "config.json").write_text(json.dumps(meta, indent=2))
        write_tokenizer(out, config.vocab_size)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"family": "LlamaForCausalLM", "size": size, "parameters": params,
            "config": SIZES[size], "lr": lr, "losses": losses}


def write_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` made-up words ("t0 t1 ..."), so an engine
    that wants a tokenizer has one; prompts are sent as token ids anyway."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0",  # type: ignore[no-untyped-call]
                                   eos_token="t1", bos_token="t2")
    fast.save_pretrained(out)


# --- 2. processes -----------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log(f"starting {self.name}: {' '.join(self.argv)}")
        with self.log_path.open("ab") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=err,
                                         env={**os.environ, **self.env}, cwd=REPO)

    def json_line(self, timeout_s: float) -> dict[str, Any]:
        """The JSON line the process prints once listening (dcr serve, dcr agent)."""
        assert self.proc is not None
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.fail("printed no listening line")
        got: dict[str, Any] = json.loads(line)
        return got

    def fail(self, what: str) -> None:
        tail = self.log_path.read_text(errors="replace")[-4000:]
        raise SystemExit(f"{self.name} {what}; its log ({self.log_path}) ends:\n{tail}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(proc: Proc, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc is not None and proc.proc.poll() is not None:
            proc.fail(f"exited with {proc.proc.returncode}")
        try:
            status, _ = request(url, "GET", "/health", timeout_s=5)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    proc.fail(f"did not answer /health within {timeout_s:.0f} s")


def request(url: str, method: str, path: str, body: Any = None, *,
            timeout_s: float = 60) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def start_engine(kind: str, ckpts: Path, staging: Path, tmp: Path, tp: int,
                 device: str, quantization: str | None = None) -> tuple[Proc, str]:
    env = {"DCR_STAGING_DIR": str(staging), "DCR_CHECKPOINT_ROOT": str(ckpts),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if kind == "vllm":
        port = free_port()
        vllm = Path(sys.executable).with_name("vllm")
        proc = Proc("vllm serve", [str(vllm), "serve", str(ckpts / "v0"),
                                   "--host", "127.0.0.1", "--port", str(port),
                                   "--served-model-name", SERVED, "--dtype", "bfloat16",
                                   "--tensor-parallel-size", str(tp),
                                   "--max-model-len", "2048",
                                   "--gpu-memory-utilization", "0.5",
                                   *(["--quantization", quantization] if quantization else []),
                                   "--worker-extension-cls",
                                   "dcr.runtimes.vllm.DcrWorkerExtension"],
                    tmp / "engine.log", {**env, "VLLM_SERVER_DEV_MODE": "1"})
        proc.start()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, START_TIMEOUT_S)
        return proc, url
    proc = Proc("dcr serve", [sys.executable, "-m", "dcr", "serve", "--runtime", "hf",
                              "--model", str(ckpts / "v0"), "--listen", "127.0.0.1:0",
                              "--staging-dir", str(staging), "--checkpoint-root", str(ckpts),
                              "--weight-version", "0", "--min-step-s", "0.02",
                              "--max-tokens", "256", "--device", device],
                tmp / "engine.log", env)
    proc.start()
    url = str(proc.json_line(START_TIMEOUT_S)["url"])
    wait_healthy(proc, url, 60)
    return proc, url


def start_agent(engine_url: str, ckpts: Path, staging: Path, store: str, tmp: Path,
                token: str, pause_mode: str) -> tuple[Proc, str]:
    """The sidecar, with the flags of the rollout pods in charts/dcr/examples."""
    token_file = tmp / "agent-token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    proc = Proc("dcr agent", [sys.executable, "-m", "dcr", "agent", "--name", "rollout-0",
                              "--listen", "127.0.0.1:0", "--token-file", str(token_file),
                              "--state-dir", str(tmp / "agent-state"), "--store", store,
                              "--engine", "vllm", "--engine-url", engine_url,
                              "--staging-dir", str(staging), "--canonical", str(ckpts / "v0"),
                              "--model-version", "0", "--pause-mode", pause_mode],
                tmp / "agent.log")
    proc.start()
    return proc, str(proc.json_line(START_TIMEOUT_S)["url"])


# --- a request in flight -----------------------------------------------------------------------


@dataclass
class InFlight:
    """One completion running while something else happens; token arrival times when the
    engine streams (vLLM), the whole request's seconds when it does not (dcr serve)."""

    url: str
    stream: bool
    max_tokens: int
    times: list[float] = field(default_factory=list)
    status: int | None = None
    error: str | None = None
    started: float = 0.0
    ended: float = 0.0
    _thread: threading.Thread | None = None

    def start(self) -> InFlight:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def wait_tokens(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.stream and len(self.times) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self.stream:
            time.sleep(0.3)  # a few generation steps of dcr serve

    def _run(self) -> None:
        body: dict[str, Any] = {"model": SERVED, "prompt": [5, 6, 7, 8],
                                "max_tokens": self.max_tokens}
        if self.stream:
            body |= {"stream": True, "ignore_eos": True, "temperature": 0}
        parts = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            if self.stream:
                for line in resp:
                    if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                        self.times.append(time.perf_counter())
            else:
                resp.read()
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.ended = time.perf_counter()
            conn.close()

    def join(self, baseline_s: float | None = None) -> dict[str, Any]:
        """What the request saw. ``pause_seen_s``: streaming, its longest gap between
        tokens less the median gap; otherwise its seconds less ``baseline_s`` (the same
        request with nothing happening)."""
        assert self._thread is not None
        self._thread.join(600)
        seconds = self.ended - self.started
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        seen = (max(gaps) - statistics.median(gaps) if gaps
                else None if baseline_s is None or self.stream else seconds - baseline_s)
        return {"status": self.status, "error": self.error, "seconds": round(seconds, 4),
                "tokens": len(self.times) if self.stream else None,
                "longest_gap_s": round(max(gaps), 4) if gaps else None,
                "median_gap_s": round(statistics.median(gaps), 5) if gaps else None,
                "pause_seen_s": None if seen is None else round(seen, 4)}


def unpaused(args: argparse.Namespace, engine_url: str) -> float:
    """Seconds of the request kept in flight when nothing else happens."""
    flight = InFlight(engine_url, args.engine == "vllm", args.request_tokens).start()
    seconds: float = flight.join()["seconds"]
    return seconds


# --- 3. refits through the sidecar -------------------------------------------------------------


def verify(engine: Any, ckpts: Path, v: int) -> tuple[bool, list[dict[str, str]]]:
    """Every rank's fingerprint now, against the same ranks after a dense load of ``v``."""
    refit = engine.fingerprint()
    t0 = time.perf_counter()
    engine.load_dense(f"v{v}")
    dense_s = time.perf_counter() - t0
    dense = engine.fingerprint()
    log(f"v{v}: {len(refit)} rank(s), fingerprints {'equal' if refit == dense else 'DIFFER'} "
        f"to a dense load ({dense_s:.2f} s)")
    return refit == dense, dense


def sidecar_refits(args: argparse.Namespace, engine: Any, agent_url: str, token: str,
                   ckpts: Path, store: str, tmp: Path, engine_url: str) -> list[dict[str, Any]]:
    from dcr.owner.process import ProcessOwner
    from dcr.protocol.agent_api import AgentClient
    from dcr.protocol.commitstore import SqliteCommitStore
    from dcr.protocol.coordinator import Coordinator, CoordinatorSettings
    from dcr.protocol.records import CommitRecord

    client = AgentClient("rollout-0", agent_url, token, timeout_s=600)
    profile_path = tmp / "profile.json"
    profile_path.write_text(json.dumps({"tensors": client.profile()["tensors"]}))
    owner = ProcessOwner(store_uri=store, checkpoints=lambda v: ckpts / f"v{v}", version=0,
                         owner=0, owners=1, profile_path=profile_path)
    commits = SqliteCommitStore(tmp / "commit.db", CommitRecord(
        committed_version=0, baseline_id=str(ckpts / "v0"), attempt=""))
    coordinator = Coordinator(commits, [owner], [client],
                              settings=CoordinatorSettings(gate="sync", attempt_timeout_s=600),
                              dense_checkpoint=lambda v: str(ckpts / f"v{v}"))
    rows = []
    baseline_s = unpaused(args, engine_url)
    try:
        for v in range(1, args.steps + 1):
            first = len(coordinator.history)
            flight = InFlight(engine_url, args.engine == "vllm", args.request_tokens).start()
            flight.wait_tokens(8)
            t0 = time.perf_counter()
            record = coordinator.refit(v, str(ckpts / f"v{v}"))
            refit_s = time.perf_counter() - t0
            seen = flight.join(baseline_s)
            attempts = coordinator.history[first:]
            summary = owner.summaries[attempts[-1].attempt]
            exact, _ = verify(engine, ckpts, v)
            rows.append({"step": v, "refit_s": round(refit_s, 3),
                         "changed_pct": 100 * int(str(summary["changed_elements"]))
                         / int(str(summary["total_elements"])),
                         "payload_bytes": summary["payload_bytes"],
                         "dense_bytes": summary["dense_bytes"],
                         "attempts": [asdict(a) for a in attempts],
                         "record": asdict(record), "request_in_flight": seen,
                         "bit_exact": exact})
            log(f"v{v}: refit through the sidecar in {refit_s:.2f} s "
                f"({', '.join(a.mode + ' ' + a.outcome.split(':')[0] for a in attempts)}); "
                f"request in flight: {seen}")
    finally:
        coordinator.close()
    return rows


# --- 4. apply throughput -----------------------------------------------------------------------


def stage(ckpts: Path, staging: Path, base: int, target: int, profile: Any
          ) -> tuple[list[str], dict[str, Any]]:
    """The owner's diff ``base`` -> ``target`` (mixed) staged as files, as the agent does."""
    from dcr.checkpoint import Checkpoint
    from dcr.drivers.base import staged_name
    from dcr.owner.diff import diff_checkpoints
    from dcr.owner.settings import EncodeSettings
    from dcr.transport.store import MemoryStore

    store = MemoryStore()
    settings = EncodeSettings(target_version=target, base_version=base, mode="mixed",
                              profile=profile, attempt_manifest=True)
    with Checkpoint(ckpts / f"v{base}") as b, Checkpoint(ckpts / f"v{target}") as t:
        manifest = diff_checkpoints(b, t, store, settings)
    names = []
    for p in sorted(manifest.payloads, key=lambda p: (p.owner, p.seq)):
        name = staged_name(manifest.attempt, p.owner, p.seq)
        tmp = staging / f".{name}"
        tmp.write_bytes(store.get(p.key))
        tmp.rename(staging / name)
        names.append(name)
    return names, manifest.stats.model_dump()


def apply_throughput(args: argparse.Namespace, engine: Any, ckpts: Path, staging: Path,
                     engine_url: str, dense_fp: list[dict[str, str]]) -> dict[str, Any]:
    from dcr.apply.applier import CanonicalTensor
    from dcr.checkpoint import Checkpoint

    with Checkpoint(ckpts / "v0") as c:
        tensors = [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=tuple(i.shape))
                   for i in c]
        dense_bytes = sum(i.nbytes for i in c)
    t0 = time.perf_counter()
    engine.load_dense("v0")
    dense_load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    profile = engine.prewarm(tensors).profile
    prewarm_s = time.perf_counter() - t0
    rows = []
    baseline_s = unpaused(args, engine_url)
    for v in range(1, args.steps + 1):
        names, stats = stage(ckpts, staging, v - 1, v, profile)
        flight = InFlight(engine_url, args.engine == "vllm", args.request_tokens).start()
        flight.wait_tokens(8)
        t_pause = time.perf_counter()
        engine.pause("keep")
        t0 = time.perf_counter()
        outcome = engine.apply(names)
        apply_s = time.perf_counter() - t0
        engine.resume()
        paused_s = time.perf_counter() - t_pause
        seen = flight.join(baseline_s)
        for n in names:
            (staging / n).unlink()
        split = {k: round(max(float(r.get(k, 0.0)) for r in outcome.reports), 4)
                 for k in ("decode_s", "upload_s", "expand_s", "scatter_s", "loader_s",
                           "intercept_s")}
        rows.append({"step": v, "changed_pct": 100 * stats["changed_elements"]
                     / stats["total_elements"], "payload_bytes": stats["payload_bytes"],
                     "payloads": len(names), "apply_s": round(apply_s, 4),
                     "dense_equivalent_GBps": round(dense_bytes / apply_s / 1e9, 3),
                     "plugin_split_s": split, "paused_s": round(paused_s, 4),
                     "request_in_flight": seen})
        log(f"apply v{v - 1}->v{v}: {apply_s:.3f} s, "
            f"{dense_bytes / apply_s / 1e9:.2f} GB/s dense-equivalent; paused {paused_s:.3f} s; "
            f"request in flight: {seen}")
    exact = engine.fingerprint() == dense_fp
    log(f"after the direct applies: fingerprints {'equal' if exact else 'DIFFER'} to the "
        f"dense load of v{args.steps}")
    gbps = [r["dense_equivalent_GBps"] for r in rows]
    return {"dense_bytes": dense_bytes, "dense_load_s": round(dense_load_s, 3),
            "dense_load_GBps": round(dense_bytes / dense_load_s / 1e9, 3),
            "prewarm_s": round(prewarm_s, 3), "steps": rows,
            "dense_equivalent_GBps": {"best": max(gbps), "median": statistics.median(gbps)},
            "bit_exact": exact}


# --- main ------------------------------------------------------------------------------------


def versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        out["dcr_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True,
                                           capture_output=True, check=True).stdout.strip()
        out["dcr_tree_dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, text=True,
            capture_output=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        out["dcr_commit"] = out["dcr_tree_dirty"] = None
    try:
        import vllm  # type: ignore[import-not-found,unused-ignore]

        out["vllm"] = vllm.__version__
    except ImportError:
        out["vllm"] = None
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
    else:
        out["device"] = "cpu"
    return out


def timed(phases: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        phases[name] = round(time.perf_counter() - t0, 2)
        log(f"phase {name}: {phases[name]:.1f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["vllm", "reference"], default="vllm")
    p.add_argument("--model-size", choices=sorted(SIZES), default="1b")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    p.add_argument("--pause-mode", choices=["wait", "abort", "keep"], default="keep",
                   help="the agent's --pause-mode during the sidecar refits (keep: the "
                   "request in flight freezes and continues, so it sees the pause)")
    p.add_argument("--request-tokens", type=int, default=None,
                   help="tokens of the request kept in flight (default: 1000 on vLLM, "
                   "200 on dcr serve)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="vLLM's online quantization of the BF16 checkpoint: vLLM computes "
                   "from FP8 copies it makes after loading, which DCR rebuilds from the "
                   "BF16 form it keeps (docs/derived-weights.md, \"Weights an engine derives "
                   "after loading\")")
    p.add_argument("--work", type=Path, default=None,
                   help="scratch directory (default: a fresh one under /tmp, removed after)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.request_tokens is None:
        args.request_tokens = 1000 if args.engine == "vllm" else 200
    sys.path.insert(0, str(REPO / "agent"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # paths.py beside it
    import torch

    cuda = torch.cuda.is_available()
    if args.quantization and args.engine != "vllm":
        raise SystemExit("gpu-check: --quantization applies to --engine vllm only.")
    out = args.out or REPO / "bench" / "results" / (
        f"gpu-{args.quantization}.json" if args.quantization else
        "gpu.json" if args.engine == "vllm" else
        "gpu-reference.json" if cuda else "gpu-dry.json")

    from dcr.drivers import VllmDriver
    from dcr.drivers.plugin import EngineTimeouts

    if args.engine == "vllm" and not torch.cuda.is_available():
        raise SystemExit("gpu-check: --engine vllm needs a CUDA device; on CPU run the dry "
                         "mode (make gpu-check ENGINE=reference MODEL_SIZE=tiny).")
    work = args.work or Path(f"/tmp/dcr-gpu-check-{secrets.token_hex(4)}")
    ckpts, staging, tmp = work / "checkpoints", work / "staging", work / "run"
    for d in (ckpts, staging, tmp):
        d.mkdir(parents=True, exist_ok=True)
    store = f"file://{work / 'store'}"
    phases: dict[str, float] = {}
    procs: list[Proc] = []
    result: dict[str, Any] = {"engine": args.engine, "dry_run": not cuda,
                              "versions": versions(), "argv": sys.argv[1:]}
    t_all = time.perf_counter()
    try:
        device = "cuda" if cuda else "cpu"
        result["model"] = timed(phases, "checkpoints", lambda: make_checkpoints(
            ckpts, args.model_size, args.steps, args.lr, device))
        if args.engine == "reference":
            from paths import compare_paths
            result["paths"] = timed(phases, "apply_paths", lambda: compare_paths(
                ckpts, args.steps, device))
        engine_proc, engine_url = timed(phases, "engine_start", lambda: start_engine(
            args.engine, ckpts, staging, tmp, args.tp, device, args.quantization))
        procs.append(engine_proc)
        token = secrets.token_hex(24)
        agent_proc, agent_url = timed(phases, "agent_start", lambda: start_agent(
            engine_url, ckpts, staging, store, tmp, token, args.pause_mode))
        procs.append(agent_proc)
        engine = VllmDriver(engine_url, timeouts=EngineTimeouts(call_s=120.0))
        result["sidecar_refits"] = timed(phases, "sidecar_refits", lambda: sidecar_refits(
            args, engine, agent_url, token, ckpts, store, tmp, engine_url))
        agent_proc.stop()
        _, dense_fp = verify(engine, ckpts, args.steps)
        result["apply"] = timed(phases, "apply_throughput", lambda: apply_throughput(
            args, engine, ckpts, staging, engine_url, dense_fp))
    finally:
        for proc in reversed(procs):
            proc.stop()
        result["phases_s"] = phases
        result["total_s"] = round(time.perf_counter() - t_all, 1)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    exact = (all(r["bit_exact"] for r in result["sidecar_refits"])
             and result["apply"]["bit_exact"] and result.get("paths", {}).get("bit_exact", True))
    result["bit_exact"] = exact
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"{'every' if exact else 'NOT every'} fingerprint equal to a dense load; "
        f"{result['total_s']} s in all; wrote {out}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
