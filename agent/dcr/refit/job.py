"""``dcr refit`` / ``make demo``: the main job, every part a real process on one machine.

It writes a table per step (log lines under the step's row, and in ``refit.log``),
``summary.json``, ``refit.png`` and ``boundary.json``. What it
runs and checks: docs/architecture.md, "The main job"; the flags: docs/cli.md.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dcr.checkpoint import Checkpoint
from dcr.drivers.base import merge_fingerprints
from dcr.errors import ConfigError, DcrError
from dcr.files.history import HistoryStore
from dcr.format.profile import ReceiverProfile, coverage, dumps, merge
from dcr.http.direct import OPENER
from dcr.http.prometheus import sample
from dcr.http.tls import TlsSettings
from dcr.http.tokens import write_token_file
from dcr.owner.process import ProcessOwner
from dcr.owner.warm import WarmOwner
from dcr.protocol.agent_api import AgentError, AgentStatus
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings
from dcr.protocol.records import CommitRecord
from dcr.receiver.settings import AgentSettings
from dcr.refit.boundary import Boundary
from dcr.refit.full import FullPath, full_refit
from dcr.refit.kills import Held, Killer, KillPoint
from dcr.refit.launch import AgentProcess, ServeProcess, free_port
from dcr.refit.ledger import crossed_lines, mb, split_down
from dcr.refit.plot import plot_refit
from dcr.refit.steplog import StepLog, install
from dcr.refit.trainer import Trainer, TrainerSettings, reference_fingerprint
from dcr.serve.settings import ServeSettings
from dcr.settings import option, to_argv
from dcr.transport.relay.publish import TOKEN_ENV, RelayPublisher
from dcr.transport.relay.settings import RelaySettings
from dcr.transport.store import Store

log = logging.getLogger(__name__)
LAUNCHED = ("name", "listen", "state_dir", "token_file")  # AgentProcess passes these itself
SERVED = ("listen", "api_key_file")  # and ServeProcess these


@dataclass(frozen=True, kw_only=True)
class RefitSettings:
    """The main job: how long it runs, how many processes, which transport, what breaks."""

    out: Path = option(Path("refit-out"), metavar="DIR", doc="working directory, emptied "
                       "first: checkpoints, store, agents' state, summary.json, refit.png")
    steps: int = option(4, metavar="K", doc="optimizer steps, each refit to every agent")
    agents: int = option(3, metavar="N", doc="rollout pods, each a dcr serve server and a "
                         "dcr agent: the last server holds both ranks of a vLLM-layout TP2 "
                         "model, the others a transformers model (so 4 ranks by default)")
    owners: int | None = option(None, metavar="M", doc="owners splitting the tensors "
                                "(default 2)")
    owner_form: Literal["warm", "process"] = option(
        "warm", doc="warm: each owner an in-process encoder in this (the trainer's) process "
        "holding the committed checkpoint memory-mapped, so a publish starts no process; "
        "process: a dcr encode process per attempt, what an encoder Job is on Kubernetes "
        "(about a second more per publish, mostly the process start)")
    transport: Literal["store", "relay"] = option("store", doc="store: a file store; relay: "
                                                  "a relay tree, one node per agent")
    kill_receiver_every: int = option(0, metavar="N", doc="kill a pod's process mid-refit "
                                      "every N steps, its agent the first time, its server "
                                      "the next, and so on (0: never)")
    store_kind: Literal["s3", "file"] = option(
        "s3", doc="s3: a real S3 server (rclone serve s3) on loopback, each rollout pod "
        "reaching it through its own emulated link, as across clusters or regions; file: a "
        "directory on this disk, no boundary (a full checkpoint then moves as fast as a "
        "delta)")
    link_mbit: float = option(200.0, metavar="MBIT", doc="capacity of each emulated link, "
                              "Mbit/s each way: a pod's to the S3 store, or the trainer's "
                              "to the relay root (0: no link)")
    rtt_ms: float = option(20.0, metavar="MS", doc="round-trip delay of each emulated link, "
                           "in milliseconds (20: nearby regions)")
    trainer: TrainerSettings = option(TrainerSettings(), cli=False,
                                      doc="the trainer (its own options)")
    coordinator: CoordinatorSettings = option(
        CoordinatorSettings(attempt_timeout_s=300.0), cli=False,
        doc="the coordinator; on one machine an attempt takes seconds, so a stuck one "
        "fails after 5 minutes rather than a cluster's 10")

    def __post_init__(self) -> None:
        if self.owners is None:
            object.__setattr__(self, "owners", 2)
        if self.steps < 1 or self.owner_count < 1 or self.kill_receiver_every < 0:
            raise ConfigError(f"steps ({self.steps}) and owners ({self.owners}) must be >= 1, "
                              f"kill_receiver_every ({self.kill_receiver_every}) >= 0.")
        if self.link_mbit < 0 or self.rtt_ms < 0:
            raise ConfigError(f"--link-mbit {self.link_mbit} and --rtt-ms {self.rtt_ms} must "
                              "not be negative.")
        if self.agents < 2:
            raise ConfigError(f"--agents {self.agents}: at least 2 (one transformers pod "
                              "and the vLLM-layout TP2 pod).")

    @property
    def owner_count(self) -> int:
        assert self.owners is not None  # set in __post_init__
        return self.owners


@dataclass(frozen=True, kw_only=True)
class Pod:
    """One rollout pod: its server and its agent, and their settings."""

    serve: ServeSettings
    agent: AgentSettings
    server: ServeProcess
    sidecar: AgentProcess

    @property
    def name(self) -> str:
        return self.agent.name

    @property
    def kind(self) -> str:
        s = self.serve
        if s.runtime == "hf":
            return s.runtime
        return f"{s.runtime} TP{s.tp_size}, FP8 {', '.join(s.fp8) or 'none'}"

    def start(self) -> None:
        self.server.start()
        self.server.wait_ready()
        self.sidecar.start()

    def stop(self) -> None:
        self.sidecar.stop()
        self.server.stop()


def rollout_pod(i: int, n: int, out: Path, source: dict[str, Any], ckpts: Path,
                token: str, env: dict[str, str]) -> Pod:
    """Pod ``i`` of ``n``: the last one serves both ranks of the vLLM-layout TP2 model,
    the others a transformers model; server and agent share ``staging``; the agent's
    environment adds ``env`` (how it reaches the store)."""
    home = out / "pods" / f"pod-{i}"
    staging = home / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    weights = ckpts  # without a store's history: the trainer's checkpoints
    if "store" in source:  # the store fleet's and the relay fleet's pods alike
        # The pod's own volume: the run's starting model (as a public base model would
        # be), and later what it builds from the store; never the trainer's checkpoints.
        weights = home / "weights"
        shutil.copytree(ckpts / "v0", weights / "v0")
    tp: dict[str, Any] = {} if i < n - 1 else {
        "runtime": "vllm-ref", "tp_size": 2, "fp8": ("self_attn.o_proj",)}
    serve = ServeSettings(model=weights / "v0", staging_dir=staging, checkpoint_root=weights,
                          weight_version="0", **tp)
    server = ServeProcess(name=f"serve-{i}", args=to_argv(serve, skip=SERVED),
                          workdir=home / "serve")
    agent = AgentSettings(name=f"agent-{i}", state_dir=home / "agent",
                          engine_url=server.url, staging_dir=staging,
                          canonical=weights / "v0", checkpoint_root=weights, **source)
    sidecar = AgentProcess(name=agent.name, args=to_argv(agent, skip=LAUNCHED),
                           state_dir=agent.state_dir, token=token, env=env)
    return Pod(serve=serve, agent=agent, server=server, sidecar=sidecar)


@dataclass(frozen=True, kw_only=True)
class RelayTree:
    """The running ``dcr relay`` nodes: processes, URLs (the first is the root), and the
    two token files: agents get the read token, the owner the publish token."""

    procs: list[subprocess.Popen[bytes]]
    urls: list[str]
    read_token_file: Path
    publish_token_file: Path


def start_relays(work: Path, n: int) -> RelayTree:
    """``dcr relay`` nodes, one per agent, in one tree (HTTPS when the environment gives
    them a certificate, :mod:`dcr.http.tls`)."""
    work.mkdir(parents=True, exist_ok=True)
    read_file = write_token_file(work / "read-token", secrets.token_hex(16))
    publish_file = write_token_file(work / "publish-token", secrets.token_hex(16))
    ports = [free_port() for _ in range(n)]
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for i, p in enumerate(ports):
        with open(work / f"relay-{i}.log", "ab") as log_file:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dcr", "relay", "--listen", f"127.0.0.1:{p}",
                 "--members", members, "--index", str(i), "--token-file", str(read_file),
                 "--publish-token-file", str(publish_file)],
                stdout=subprocess.DEVNULL, stderr=log_file))
    urls = [f"{TlsSettings.from_env().scheme}://127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + 60
    for url, proc in zip(urls, procs, strict=True):
        while True:
            try:
                with OPENER.open(url + "/healthz", timeout=2):
                    break
            except OSError as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DcrError(f"Relay node {url} did not start: {e}.") from e
                time.sleep(0.05)
    return RelayTree(procs=procs, urls=urls, read_token_file=read_file,
                      publish_token_file=publish_file)


def pod_reference(pod: Pod, ckpt: Path) -> dict[str, str]:
    """What a dense load of ``ckpt`` through the pod's server's own loader holds, every
    rank of it, as its agent's fingerprint says it."""
    s = pod.serve
    return merge_fingerprints([reference_fingerprint(ckpt, s.runtime, tp_size=s.tp_size,
                                                     tp_rank=r, fp8=s.fp8) for r in s.ranks])


def _status(pod: Pod, wait_s: float = 120.0) -> AgentStatus:
    """The pod's agent's status, waiting while it answers 503: a restarted agent (or one
    beside a restarted server) prewarms its engine before it reports."""
    client = pod.sidecar.client()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.status()
        except AgentError as e:
            if e.status != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run_refit(s: RefitSettings) -> list[dict[str, Any]]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    out = s.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    held = install(out / "refit.log")
    ckpts = out / "checkpoints"
    token = secrets.token_hex(16)

    trainer = Trainer(s.trainer)
    trainer.export(ckpts / "v0")
    boundary = Boundary(work=out / "boundary", store_dir=out / "store",
                        store_kind=s.store_kind, pods=s.agents, link_mbit=s.link_mbit,
                        rtt_ms=s.rtt_ms)
    relays: list[subprocess.Popen[bytes]] = []
    pods: list[Pod] = []
    coordinator: Coordinator | None = None
    cache: RelayPublisher | None = None  # the coordinator drops replaced attempts there
    owners: list[ProcessOwner | WarmOwner] = []
    try:
        boundary.start()
        store = boundary.store_uri
        sources: list[dict[str, Any]] = [{"store": store}] * s.agents
        publish_to, owner_env = store, boundary.direct_env()
        if s.transport == "relay":
            tree = start_relays(out / "relay", s.agents)
            relays = tree.procs
            # Attempts travel the tree; the store beside it keeps every attempt and the
            # history, which the pods catch up from (docs/relay.md, "History and catch-up").
            sources = [{"relay": u, "relay_token_file": tree.read_token_file, "store": store}
                       for u in tree.urls]
            root = boundary.relay_root(int(tree.urls[0].rsplit(":", 1)[1]))
            publish_to = f"relay+http://127.0.0.1:{root}?through={store}"
            owner_env = {**owner_env, TOKEN_ENV: tree.publish_token_file.read_text()}
            cache = RelayPublisher(f"relay+http://127.0.0.1:{root}",
                                   token=tree.publish_token_file.read_text().strip())
        pods = [rollout_pod(i, s.agents, out, sources[i], ckpts, token,
                            boundary.pod_env(i))
                for i in range(s.agents)]
        t0 = time.perf_counter()
        for proc in [p.server for p in pods] + [p.sidecar for p in pods]:
            proc.start()
        for proc in [p.server for p in pods] + [p.sidecar for p in pods]:
            proc.wait_ready()
        startup_s = time.perf_counter() - t0
        clients = [p.sidecar.client() for p in pods]
        profile = merge(ReceiverProfile.model_validate(c.profile()) for c in clients)
        profile_path = out / "profile.json"
        profile_path.write_text(dumps(profile))
        with Checkpoint(ckpts / "v0") as v0:
            shares = coverage(profile, {i.name: i.nbytes for i in v0})
        owners = _owners(s, publish_to, owner_env, ckpts, profile, profile_path, boundary)
        commits = SqliteCommitStore(out / "commit.db", CommitRecord(
            committed_version=0, baseline_id=str(ckpts / "v0"), attempt=""))
        kills = KillPoint()
        # Receivers rejoin from the store's history alone (through their links), with
        # either transport: a relay fleet's owners write every attempt through to the store.
        history = HistoryStore(boundary.direct_store())
        coordinator = Coordinator(
            commits, [Held(owner=o, point=kills) for o in owners], clients,
            settings=s.coordinator, history=history, cache=cache)
        job = _Job(trainer=trainer, ckpts=ckpts, pods=pods, coordinator=coordinator,
                   owners=owners, kills=kills, full=_full_stores(boundary),
                   from_store=history is not None, boundary=boundary, held=held)
        where = (f"relay tree of {s.agents} nodes (fan-out {RelaySettings.fanout}), root "
                 f"{tree.urls[0]}" if relays else f"store {store}")
        print(f"model: Llama, {trainer.parameters:,} parameters, "
              f"{mb(trainer.parameters * 2)} BF16; AdamW lr={s.trainer.lr}; {where}")
        print(boundary.describe(relay=bool(relays)))
        print(f"{s.agents} rollout pods (a dcr serve server and a dcr agent each) up in "
              f"{startup_s:.1f} s ({'; '.join(sorted({p.kind for p in pods}))}); "
              f"{_owners_line(s)}; commit record {commits.path}")
        print(f"full-checkpoint refits (full s) through {store}: the trainer uploads, then "
              f"every pod downloads{' through its link' if boundary.links else ''} and "
              "dense-loads" + (" (the relay carries only DCR attempts)" if relays else ""))
        print("coverage (share of weight bytes by path): "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items() if v))
        print(f"{'step':>4} {'loss':>7} {'changed':>8} {'sent':>8} {'payload B':>10} "
              f"{'% dense':>8} "
              f"{'prepare':>7} {'publish':>7} {'flush':>6} {'commit':>6} {'total s':>7} "
              f"{'full s':>6}  attempts                          bit-exact")
        held.print_held()
        rows = [_step(v, s, job) for v in range(1, s.steps + 1)]
    finally:
        if cache is not None:
            cache.close()
        _stop(coordinator, owners, pods, relays, boundary)
        held.print_held()
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    (out / "boundary.json").write_text(json.dumps({
        "store": boundary.store_uri, "link_mbit": s.link_mbit if boundary.linked else None,
        "rtt_ms": s.rtt_ms if boundary.linked else None, "links": boundary.crossed()},
        indent=1))
    for line in crossed_lines(rows, boundary.crossed()):
        print(line)
    plot = plot_refit(rows, out / "refit.png")
    exact = all(r["bit_exact"] and r["full_bit_exact"] for r in rows)
    ratios = [r["full_s"] / r["total_s"] for r in rows]
    print(f"full-checkpoint refit / DCR refit time: median {statistics.median(ratios):.2f}x "
          f"(per step {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"{'all' if exact else 'NOT all'} {s.steps} refits bit-exact on every live agent; "
          f"record {asdict(commits.read())}; summary {out / 'summary.json'}"
          + (f"; plot {plot}" if plot else ""))
    if not exact:
        raise DcrError("A receiver differs from a dense load of the trainer's export.")
    return rows


def _store_bytes_fetched(pod: Pod) -> int:
    """What the pod's agent has read from the store to build versions for rejoins."""
    with urllib.request.urlopen(f"{pod.sidecar.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(sample(text, "dcr_agent_store_bytes_fetched_total") or 0)




def _fetched(job: _Job) -> dict[str, int]:
    """What each pod's agent read from the store to rebuild versions since the last call
    (a restarted agent counts from zero again), by link name."""
    out = {}
    for i, pod in enumerate(job.pods):
        now, seen = _store_bytes_fetched(pod), job.fetched.get(pod.name, 0)
        out[f"pod-{i}"] = now - seen if now >= seen else now
        job.fetched[pod.name] = now
    return out


def _stop(coordinator: Coordinator | None, owners: Sequence[ProcessOwner | WarmOwner],
          pods: Sequence[Pod], relays: Sequence[subprocess.Popen[bytes]],
          boundary: Boundary) -> None:
    """Stop everything the job started, in the order it depends on each other."""
    if coordinator is not None:
        coordinator.close()
    publishers = {id(o.store): o.store for o in owners
                  if isinstance(o, WarmOwner) and isinstance(o.store, RelayPublisher)}
    for o in owners:
        if isinstance(o, WarmOwner):
            o.close()
    for publisher in publishers.values():  # the warm owners share one
        publisher.close()
    for pod in pods:
        pod.stop()
    for r in relays:
        r.terminate()
        r.wait(10)
    boundary.close()


def _owners(s: RefitSettings, publish_to: str, owner_env: dict[str, str], ckpts: Path,
            profile: ReceiverProfile, profile_path: Path, boundary: Boundary
            ) -> list[ProcessOwner | WarmOwner]:
    """The owners, in the form ``s.owner_form`` names; warm ones share one store, which
    they reach as the training side does (no link)."""
    def checkpoints(v: int) -> Path:
        return ckpts / f"v{v}"

    n = s.owner_count
    if s.owner_form == "process":
        return [ProcessOwner(store_uri=publish_to, checkpoints=checkpoints, version=0, owner=k,
                             owners=n, profile_path=profile_path, env=owner_env)
                for k in range(n)]
    token = owner_env.get(TOKEN_ENV)  # the relay's publish token, given, not inherited
    direct = boundary.direct_store()
    store: Store = (RelayPublisher(publish_to, token=token.strip(), through=direct)
                    if token is not None else direct)
    return [WarmOwner.open(checkpoints=checkpoints, version=0, store=store, owner=k, owners=n,
                           profile=profile)
            for k in range(n)]


def _owners_line(s: RefitSettings) -> str:
    n = s.owner_count
    if s.owner_form == "process":
        return f"{n} encoder process{'es' if n > 1 else ''} per attempt (dcr encode)"
    return f"{n} warm encoder{'s' if n > 1 else ''} in this process"


def _full_stores(boundary: Boundary) -> FullPath:
    """Full checkpoints go up as the owners publish, and down through each pod's link."""
    return FullPath(upload=boundary.direct_store(),
                     pods=[boundary.pod_store(i) for i in range(boundary.pods)])


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What every step works on: the trainer, its exports and the running processes."""

    trainer: Trainer
    ckpts: Path
    pods: list[Pod]
    coordinator: Coordinator
    owners: Sequence[ProcessOwner | WarmOwner]
    kills: KillPoint  # the coordinator's owners publish once a step's kill has landed
    full: FullPath  # where full checkpoints travel, for the comparison
    from_store: bool  # receivers rejoin from the store's history (else a checkpoint path)
    boundary: Boundary  # the pods' links, read before and after each phase of a step
    held: StepLog  # log records of the step, printed under its row
    fetched: dict[str, int] = field(default_factory=dict)  # each agent's counter, last read


def _changed_pct(old: Path, new: Path) -> float:
    """Share of elements whose stored bits differ between two exports: the step's real
    change rate. The owners' record count (``sent``) is larger where a receiver path takes
    whole tensors (the FP8 pod's quantized ``o_proj``, whose scale depends on every element)."""
    with Checkpoint(old) as a, Checkpoint(new) as b:
        changed = total = 0
        for name in b.names():
            x, y = a.bits(name), b.bits(name)
            changed += int(np.count_nonzero(x != y))
            total += y.size
    return 100 * changed / total


def _step(v: int, s: RefitSettings, job: _Job) -> dict[str, Any]:
    loss = job.trainer.step()
    ckpt = job.ckpts / f"v{v}"
    job.trainer.export(ckpt)
    pods, coordinator = job.pods, job.coordinator
    killer = None
    if s.kill_receiver_every and v % s.kill_receiver_every == 0:
        pod = pods[v % len(pods)]
        nth = v // s.kill_receiver_every  # the agent on odd kills, the server on even ones
        killer = Killer(pod.sidecar, pod.sidecar if nth % 2 else pod.server)
        killer.start()
    first = len(coordinator.history)
    job.kills.killer = killer
    down0 = job.boundary.pods_down()
    t0 = time.perf_counter()
    try:
        record = coordinator.refit(v, str(ckpt))
    finally:
        job.kills.killer = None
    total_s = time.perf_counter() - t0
    if killer is not None:
        killer.done.wait()
    attempts = coordinator.history[first:]
    # A receiver the last attempt could not admit rejoins now, between attempts.
    rejoined_after = []
    t1 = time.perf_counter()
    for pod in pods:
        if _status(pod).version != record.committed_version:
            pod.sidecar.client().rejoin(record.committed_version,
                                        None if job.from_store else str(ckpt),
                                        record.history_digest or None)
            rejoined_after.append(pod.name)
    rejoin_s = time.perf_counter() - t1
    by_pod = _fetched(job)
    fetched = sum(by_pod.values())
    down1 = job.boundary.pods_down()
    refs: dict[str, dict[str, str]] = {}
    exact = True
    for pod in pods:
        if pod.kind not in refs:
            refs[pod.kind] = pod_reference(pod, ckpt)
        exact &= pod.sidecar.client().fingerprint() == refs[pod.kind]
    full = full_refit(v, ckpt, [p.sidecar for p in pods], job.full,
                      [p.agent.dense_root / f"full-{p.name}" for p in pods])
    full_exact = all(p.sidecar.client().fingerprint() == refs[p.kind] for p in pods)
    down2 = job.boundary.pods_down()
    last = attempts[-1]
    summaries = [o.summaries[last.attempt] for o in job.owners]
    changed = sum(int(str(x["changed_elements"])) for x in summaries)
    total = sum(int(str(x["total_elements"])) for x in summaries)
    payload = sum(int(str(x["payload_bytes"])) for x in summaries)
    dense = sum(int(str(x["dense_bytes"])) for x in summaries)
    row: dict[str, Any] = {
        "step": v, "loss": loss, "changed_pct": _changed_pct(job.ckpts / f"v{v - 1}", ckpt),
        "sent_pct": 100 * changed / total,
        "payload_bytes": payload, "dense_bytes": dense, "dense_pct": 100 * payload / dense,
        "total_s": total_s, "bit_exact": exact, "record": asdict(record),
        **full, "full_bit_exact": full_exact,
        "killed": killer.victim.name if killer else None,  # agent-N or serve-N
        "rejoined_after": rejoined_after,
        "rejoin_fetched_bytes": fetched,  # from the store, through the pods' links
        "rejoin_after_s": rejoin_s,  # rejoining pods the commit left behind (after total_s)
        "link_down_bytes": split_down(down0, down1, down2, by_pod),  # by pod, by phase
        "attempts": [asdict(h) for h in attempts],
    }
    st = last.stages
    label = ", ".join(f"{h.mode} {h.outcome.split(':')[0]}" for h in attempts)
    extra = [f"killed {row['killed']}"] if killer else []
    extra += [f"rejoined {', '.join(h.rejoined)}" for h in attempts if h.rejoined]
    extra += [f"rejoined {n} after" for n in rejoined_after]
    extra += [f"rejoins fetched {mb(fetched)} from the store"] if fetched else []
    print(f"{v:>4} {loss:>7.4f} {row['changed_pct']:>7.3f}% {row['sent_pct']:>7.3f}% "
          f"{payload:>10,} "
          f"{row['dense_pct']:>7.3f}% {st.get('prepare', 0):>7.3f} {st.get('publish', 0):>7.3f} "
          f"{st.get('flush', 0):>6.3f} {st.get('commit', 0):>6.3f} {total_s:>7.2f} "
          f"{full['full_s']:>6.2f}  {label:<33} "
          f"{'yes' if exact and full_exact else 'NO'}"
          + (f"  ({'; '.join(extra)})" if extra else ""), flush=True)
    job.held.print_held()
    if v > 1:  # v0 is what agents (re)start from; a rejoin needs only the committed one
        shutil.rmtree(job.ckpts / f"v{v - 1}")
    return row
