"""``dcr refit`` / ``make demo``: the main job, every part a real process on one machine.

A trainer trains a small Llama-architecture model (transformers, random init, byte
tokens of real text: the Python standard library's own source) with AdamW at an RL
learning rate and exports a BF16 Hugging Face checkpoint after every optimizer step.
Rollout ranks are ``dcr agent`` processes, each serving the model through its own
loader: transformers ranks, and two tensor-parallel ranks of the vLLM-layout reference
runtime with an FP8 ``o_proj``. Encoders are ``dcr encode`` processes that split the
tensors by name. A coordinator in this process drives every refit through the agents'
HTTP API and commits it by compare-and-set in a SQLite commit record.

``--kill-receiver-every N`` SIGKILLs one agent in the middle of every N-th refit and
restarts it on the same port and state directory, as a pod restart does: the attempt
fails, the survivors stop, the restarted agent reports an unknown version from its
journal, is restored by a dense refit, and the retry in overwrite mode commits.

After every step each live agent's fingerprint of every parameter and buffer (xxh3 of
integer views) is compared with a dense load of the trainer's export through the same
loader. A table per step, ``summary.json`` and a plot (``refit.png``) are written.
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dcr.checkpoint import Checkpoint
from dcr.errors import ConfigError, DcrError
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.process import ProcessOwner
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings
from dcr.protocol.records import CommitRecord
from dcr.receiver.launch import AgentProcess, free_port
from dcr.transport.relay.publish import TOKEN_ENV

log = logging.getLogger(__name__)
LR = 1e-6  # RL fine-tuning learning rate: most BF16 elements round back to the same bits
SEQ, BATCH = 128, 8


@dataclass(frozen=True, kw_only=True)
class RefitSettings:
    out: Path
    steps: int = 4
    seed: int = 0
    agents: int = 4  # first half transformers ranks, the rest vLLM-layout TP2 pairs
    owners: int = 2  # encoder processes
    transport: Literal["store", "relay"] = "store"  # relay: a tree of one node per agent
    kill_receiver_every: int = 0  # 0: never

    def __post_init__(self) -> None:
        if self.transport == "relay" and self.owners != 1:
            raise ConfigError(f"--transport relay carries one owner per attempt; got --owners "
                              f"{self.owners} (use --owners 1, or the store).")
        if self.steps < 1 or self.owners < 1 or self.kill_receiver_every < 0:
            raise ConfigError(f"steps ({self.steps}) and owners ({self.owners}) must be >= 1, "
                              f"kill_receiver_every ({self.kill_receiver_every}) >= 0.")
        if self.agents < 2 or self.agents % 2:
            raise ConfigError(f"--agents {self.agents}: an even number >= 2 (half of them "
                              "form vLLM-layout TP2 pairs).")


def _corpus() -> bytes:
    import argparse
    import collections
    import json as json_mod

    return "".join(inspect.getsource(m) for m in (json_mod, argparse, collections)).encode()


class _Trainer:
    def __init__(self, seed: int) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.cfg = LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        self.model = LlamaForCausalLM(self.cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        self.data = torch.tensor(list(_corpus()), dtype=torch.long)
        self.gen = torch.Generator().manual_seed(seed)
        for _ in range(3):  # leave Adam's first, sign-like steps behind
            self.step()

    def step(self) -> float:
        import torch

        starts = torch.randint(0, len(self.data) - SEQ - 1, (BATCH,), generator=self.gen)
        batch = torch.stack([self.data[s : s + SEQ] for s in starts.tolist()])
        loss = self.model(input_ids=batch, labels=batch).loss
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def export(self, path: Path) -> str:
        """Save BF16 weights as a sharded HF checkpoint; return its baseline id."""
        import copy

        import torch

        shutil.rmtree(path, ignore_errors=True)
        copy.deepcopy(self.model).to(torch.bfloat16).save_pretrained(  # type: ignore[arg-type]
            path, max_shard_size="2MB", safe_serialization=True)
        return baseline_id(path)


def baseline_id(path: Path) -> str:
    """A digest of every tensor's fingerprint: names the bits an owner's baseline holds."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    with Checkpoint(path) as c:
        for name in c.names():
            h.update(f"{name}={c.fingerprint(name)};".encode())
    return "ckpt-" + h.hexdigest()


def _agent_args(i: int, n: int, source: list[str], model: Path) -> list[str]:
    common = [*source, "--model", str(model)]
    half = n // 2
    if i < half:
        return [*common, "--runtime", "hf"]
    rank = (i - half) % 2
    return [*common, "--runtime", "vllm-ref", "--tp-size", "2", "--tp-rank", str(rank),
            "--fp8", "self_attn.o_proj"]


def _start_relays(work: Path, n: int) -> tuple[list[subprocess.Popen[bytes]], list[str], Path]:
    """``dcr relay`` nodes, one per agent, in one tree; their URLs (the first is the root)."""
    work.mkdir(parents=True, exist_ok=True)
    token_file = work / "token"
    token_file.write_text(secrets.token_hex(16))
    token_file.chmod(0o600)
    ports = [free_port() for _ in range(n)]
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for i, p in enumerate(ports):
        with open(work / f"relay-{i}.log", "ab") as log_file:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dcr", "relay", "--listen", f"127.0.0.1:{p}",
                 "--members", members, "--index", str(i), "--fanout", "2", "--token-file",
                 str(token_file)], stdout=subprocess.DEVNULL, stderr=log_file))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + 60
    for url, proc in zip(urls, procs, strict=True):
        while True:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2):
                    break
            except OSError as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DcrError(f"Relay node {url} did not start: {e}.") from e
                time.sleep(0.05)
    return procs, urls, token_file


def _reference_fingerprints(args: list[str], ckpt: Path) -> dict[str, str]:
    """What a dense load of ``ckpt`` through this agent kind's own loader holds."""
    from dcr.receiver.host import checkpoint_tensors, runtime_fingerprint
    from dcr.runtimes import build_runtime

    kind = args[args.index("--runtime") + 1]
    tp = int(args[args.index("--tp-size") + 1]) if "--tp-size" in args else 1
    rank = int(args[args.index("--tp-rank") + 1]) if "--tp-rank" in args else 0
    fp8 = tuple(args[i + 1] for i, a in enumerate(args) if a == "--fp8")
    runtime = build_runtime(kind, ckpt, tp_size=tp, tp_rank=rank, fp8=fp8)
    with Checkpoint(ckpt) as c:
        runtime.load_weights(checkpoint_tensors(c).items())
    return runtime_fingerprint(runtime)


class _Killer(threading.Thread):
    """Waits until the victim is applying an attempt, then SIGKILLs and restarts it."""

    def __init__(self, victim: AgentProcess) -> None:
        super().__init__(name=f"kill-{victim.name}", daemon=True)
        self.victim = victim
        self.killed_at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        client = self.victim.client(timeout_s=5.0)
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                try:
                    st = client.status()
                except DcrError:  # not up yet
                    time.sleep(0.01)
                    continue
                if st.state == "applying":  # journaled dirty: its bits are now in doubt
                    break
                time.sleep(0.005)
            self.killed_at = time.time()
            self.victim.restart()
        finally:
            self.done.set()


def run_refit(s: RefitSettings) -> list[dict[str, Any]]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = s.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    ckpts, store = out / "checkpoints", f"file://{out / 'store'}"
    token = secrets.token_hex(16)

    trainer = _Trainer(s.seed)
    ids = {0: trainer.export(ckpts / "v0")}
    n_params = sum(p.numel() for p in trainer.model.parameters())
    relays: list[subprocess.Popen[bytes]] = []
    sources = [["--store", store]] * s.agents
    publish_to, owner_env = store, {}
    if s.transport == "relay":
        relays, urls, token_file = _start_relays(out / "relay", s.agents)
        sources = [["--relay", u, "--relay-token-file", str(token_file)] for u in urls]
        publish_to, owner_env = f"relay+{urls[0]}", {TOKEN_ENV: token_file.read_text()}
    agents = [AgentProcess(name=f"agent-{i}",
                           args=_agent_args(i, s.agents, sources[i], ckpts / "v0"),
                           state_dir=out / "agents" / f"agent-{i}", token=token)
              for i in range(s.agents)]
    t0 = time.perf_counter()
    for a in agents:
        a.start()
    for a in agents:
        a.wait_ready()
    startup_s = time.perf_counter() - t0
    clients = [a.client() for a in agents]
    profile = merge(ReceiverProfile(tensors=c.profile()["tensors"]) for c in clients)
    profile_path = out / "profile.json"
    profile_path.write_text(json.dumps({"tensors": profile.tensors}))
    owners = [ProcessOwner(store_uri=publish_to, checkpoints=lambda v: ckpts / f"v{v}",
                           version=0, owner=k, owners=s.owners, profile_path=profile_path,
                           env=owner_env)
              for k in range(s.owners)]
    commits = SqliteCommitStore(out / "commit.db", CommitRecord(
        committed_version=0, baseline_id=ids[0], attempt=""))
    coordinator = Coordinator(commits, owners, clients,
                              settings=CoordinatorSettings(attempt_timeout_s=300.0),
                              dense_checkpoint=lambda v: str(ckpts / f"v{v}"))
    kinds = sorted({" ".join(a.args[a.args.index("--runtime"):]) for a in agents})
    where = (f"relay tree of {s.agents} nodes (fan-out 2), root {publish_to}"
             if relays else f"store {store}")
    print(f"model: Llama, {n_params:,} parameters, BF16; AdamW lr={LR}; {where}")
    print(f"{s.agents} agent processes up in {startup_s:.1f} s ({'; '.join(kinds)}); "
          f"{s.owners} encoder processes; commit record {commits.path}")
    print(f"{'step':>4} {'loss':>7} {'changed':>8} {'payload B':>10} {'% dense':>8} "
          f"{'prepare':>7} {'publish':>7} {'flush':>6} {'commit':>6} {'total s':>7}  "
          f"attempts                          bit-exact")
    rows: list[dict[str, Any]] = []
    try:
        for v in range(1, s.steps + 1):
            rows.append(_step(v, s, trainer, ckpts, ids, agents, coordinator, owners))
    finally:
        coordinator.close()
        for a in agents:
            a.stop()
        for r in relays:
            r.terminate()
            r.wait(10)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    plot = _plot(rows, out / "refit.png")
    exact = all(r["bit_exact"] for r in rows)
    print(f"{'all' if exact else 'NOT all'} {s.steps} refits bit-exact on every live agent; "
          f"record {asdict(commits.read())}; summary {out / 'summary.json'}"
          + (f"; plot {plot}" if plot else ""))
    if not exact:
        raise DcrError("A receiver differs from a dense load of the trainer's export.")
    return rows


def _step(v: int, s: RefitSettings, trainer: _Trainer, ckpts: Path, ids: dict[int, str],
          agents: list[AgentProcess], coordinator: Coordinator,
          owners: list[ProcessOwner]) -> dict[str, Any]:
    loss = trainer.step()
    ids[v] = trainer.export(ckpts / f"v{v}")
    killer = None
    if s.kill_receiver_every and v % s.kill_receiver_every == 0:
        killer = _Killer(agents[v % len(agents)])
        killer.start()
    first = len(coordinator.history)
    t0 = time.perf_counter()
    record = coordinator.refit(v, ids[v])
    total_s = time.perf_counter() - t0
    if killer is not None:
        killer.done.wait()
    attempts = coordinator.history[first:]
    # A receiver the last attempt could not admit rejoins now, between attempts.
    rejoined_after = []
    for a in agents:
        if a.client().status().version != record.committed_version:
            a.client().rejoin(record.committed_version, str(ckpts / f"v{v}"))
            rejoined_after.append(a.name)
    refs: dict[str, dict[str, str]] = {}
    exact = True
    for a in agents:
        key = " ".join(a.args)
        if key not in refs:
            refs[key] = _reference_fingerprints(a.args, ckpts / f"v{v}")
        exact &= a.client().fingerprint() == refs[key]
    last = attempts[-1]
    summaries = [o.summaries[last.attempt] for o in owners]
    changed = sum(int(str(x["changed_elements"])) for x in summaries)
    total = sum(int(str(x["total_elements"])) for x in summaries)
    payload = sum(int(str(x["payload_bytes"])) for x in summaries)
    dense = sum(int(str(x["dense_bytes"])) for x in summaries)
    row: dict[str, Any] = {
        "step": v, "loss": loss, "changed_pct": 100 * changed / total,
        "payload_bytes": payload, "dense_bytes": dense, "dense_pct": 100 * payload / dense,
        "total_s": total_s, "bit_exact": exact, "record": asdict(record),
        "killed": killer.victim.name if killer else None,
        "rejoined_after": rejoined_after,
        "attempts": [asdict(h) for h in attempts],
    }
    st = last.stages
    label = ", ".join(f"{h.mode} {h.outcome.split(':')[0]}" for h in attempts)
    extra = [f"killed {row['killed']}"] if killer else []
    extra += [f"rejoined {', '.join(h.rejoined)}" for h in attempts if h.rejoined]
    extra += [f"rejoined {n} after" for n in rejoined_after]
    print(f"{v:>4} {loss:>7.4f} {row['changed_pct']:>7.3f}% {payload:>10,} "
          f"{row['dense_pct']:>7.3f}% {st.get('prepare', 0):>7.3f} {st.get('publish', 0):>7.3f} "
          f"{st.get('flush', 0):>6.3f} {st.get('commit', 0):>6.3f} {total_s:>7.2f}  "
          f"{label:<33} {'yes' if exact else 'NO'}"
          + (f"  ({'; '.join(extra)})" if extra else ""), flush=True)
    if v > 1:  # v0 is what agents (re)start from; a rejoin needs only the committed one
        shutil.rmtree(ckpts / f"v{v - 1}")
    return row


def _plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    stages = ("prepare", "publish", "flush", "commit", "finish")
    x = 0.0
    ticks = []
    for r in rows:
        for h in r["attempts"]:
            bottom = 0.0
            for k, stage in enumerate(stages):
                sec = h["stages"].get(stage, 0.0)
                ax1.bar(x, sec, bottom=bottom, color=f"C{k}", label=stage if x == 0 else None,
                        hatch="//" if h["outcome"] != "committed" else None)
                bottom += sec
            ticks.append((x, f"{r['step']}{'' if h['mode'] == 'mixed' else ' ow'}"))
            x += 1
        x += 0.5
    ax1.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=8)
    ax1.set_xlabel("step (attempts; ow = overwrite, hatched = failed)")
    ax1.set_ylabel("seconds")
    ax1.set_title("refit timeline by stage")
    ax1.legend(fontsize=8)
    steps = [r["step"] for r in rows]
    ax2.bar([s - 0.2 for s in steps], [r["dense_bytes"] for r in rows], 0.4, label="dense")
    ax2.bar([s + 0.2 for s in steps], [r["payload_bytes"] for r in rows], 0.4, label="DCR payload")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("bytes")
    ax2.set_title("bytes per refit")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
