"""A seeded fault campaign: many refits of the main job's model under random faults.

Every party is a process: ``dcr serve`` + ``dcr agent`` pods (the main job's, two
transformers pods and a vLLM-layout TP2 pod with an FP8 layer), ``dcr encoder`` owners, and
the coordinator (bench/faultcoord.py, one process per refit, restarted after a kill as the
operator restarts its own). The store is a real S3 server (``rclone serve s3``); each pod
reaches it through its own Toxiproxy proxy (its link), the owners and the coordinator
through the training side's, and every proxy through the 5xx layer (tests/support/
http5xx.py). Per refit, ``random.Random(seed)`` draws:

- a kill -9 of an agent, an engine, an owner or the coordinator, at a stage of the attempt
  (stage, apply, flush, commit, gate open: what an agent's status or the record shows, as
  ``dcr.refit.kills`` waits for ``applying``), restarted after a random delay;
- a store fault on one link: latency, a bandwidth drop, resets, a hang, truncated bodies,
  sliced writes (Toxiproxy), or 503 answers (the 5xx layer);
- a link fault of one pod: a partition or a bandwidth drop;
- a full staging volume: each pod's staging directory is a small tmpfs of its own, and a
  filler file fills one for a while (drawn from a second generator, so a seed's other
  draws stay as they were).

With ``--transport relay`` the owners publish through a relay tree (``dcr relay``
processes: a root, an intermediate node, two leaves; every object written through to the
store, which keeps the history) and the pods receive through it; a relay node joins the
parties killed.

Then the faults stop and the fleet settles as the operator's refresh drives it
(``dcr_operator.fleet.behind``: an agent behind the record rejoins it). Parties' answers go
to ``events.jsonl``; bench/faultcheck.py judges them. The seed and the schedule are printed;
``--seed N`` replays the same schedule. ``--soak --minutes M`` runs seeds until the time is
up and writes bench/results/faults.json. docs/faults.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from http5xx import Http5xx, http5xx
from s3server import s3_server
from toxiproxy import Toxiproxy, toxiproxy_server

from dcr.checkpoint import Checkpoint
from dcr.errors import DcrError
from dcr.format.profile import ReceiverProfile, dumps, merge
from dcr.http.tokens import write_token_file
from dcr.protocol.agent_api import AgentClient, AgentStatus
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.records import CommitRecord
from dcr.refit.job import Pod, pod_reference, rollout_pod  # the main job's own pods
from dcr.refit.launch import EncoderProcess, Process
from dcr.refit.trainer import Trainer, TrainerSettings
from dcr.transport.relay.publish import TOKEN_ENV, split_through
from dcr_operator.fleet import behind  # the operator's catch-up decision
from faultcheck import Report, check, read_events
from faultcoord import emit, record_fields
from faultparts import RelayNode, fill, free, relay_tree, small_volume

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "faults.json"
STAGES = ("stage", "apply", "flush", "commit", "gate-open")
PARTIES = ("agent", "serve", "owner", "coordinator")  # serve: the engine
TRANSPORTS = ("store", "relay")  # how attempts reach the pods: the store, or a relay tree
RELAY_NODES = 4  # fan-out 2: the root, an intermediate node (pod 0's) and two leaves
STAGING_VOLUME_BYTES = 16 << 20  # each pod's staging tmpfs: many attempts of the model
STORE_FAULTS = ("latency", "bandwidth", "reset_peer", "timeout", "limit_data", "slicer",
                "http5xx")
LINK_FAULTS = ("partition", "bandwidth")
SETTLE_BOUND_S = 120.0  # once faults stop, every agent holds the newest committed version
COORDINATOR_RUNS = 6  # coordinator processes per refit (a killed or failed one is rerun)
SMALL = TrainerSettings(hidden_size=128, intermediate_size=344, layers=2, heads=4, kv_heads=2,
                        seq=32, batch=2, warmup_steps=1)


# --- the schedule ------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Kill:
    victim: str  # agent-I, serve-I, owner-K or coordinator
    stage: str  # one of STAGES
    restart_after_s: float


@dataclass(frozen=True, kw_only=True)
class Toxic:
    kind: str  # one of STORE_FAULTS or LINK_FAULTS
    link: str  # train (owners and coordinator) or pod-I
    after_s: float  # from the refit's start
    for_s: float
    amount: int  # the toxic's size: ms, KB/s, bytes, answers (by kind)


@dataclass(frozen=True, kw_only=True)
class Fill:
    pod: int  # whose staging volume fills
    after_s: float  # from the refit's start
    for_s: float
    leave_bytes: int  # what stays free


@dataclass(frozen=True, kw_only=True)
class Step:
    kill: Kill | None
    toxics: tuple[Toxic, ...]
    fill: Fill | None = None


def draw(rng: random.Random, pods: int, owners: int, relays: int = 0) -> Step:
    """One refit's faults, from the campaign's generator alone (so a seed replays)."""
    kinds = (*PARTIES, "relay") if relays else PARTIES
    kind = rng.choice(kinds)  # each kind of party as often, however many of it run
    victims = {"agent": f"agent-{rng.randrange(pods)}", "serve": f"serve-{rng.randrange(pods)}",
               "owner": f"owner-{rng.randrange(owners)}", "coordinator": "coordinator"}
    if relays:  # drawn after the others: a store campaign's seeds draw as they always did
        victims["relay"] = f"relay-{rng.randrange(relays)}"
    victim = victims[kind]
    kill = Kill(victim=victim, stage=rng.choice(STAGES),
                restart_after_s=round(rng.uniform(0.0, 2.0), 2)) if rng.random() < 0.7 else None
    links = ["train"] + [f"pod-{i}" for i in range(pods)]
    toxics = []
    if rng.random() < 0.7:
        kind = rng.choice(STORE_FAULTS)
        toxics.append(Toxic(kind=kind, link=rng.choice(links),
                            after_s=round(rng.uniform(0, 1.5), 2),
                            for_s=round(rng.uniform(0.5, 3.0), 2),
                            amount=_amount(rng, kind)))
    if rng.random() < 0.3:
        kind = rng.choice(LINK_FAULTS)
        toxics.append(Toxic(kind=kind, link=f"pod-{rng.randrange(pods)}",
                            after_s=round(rng.uniform(0, 1.5), 2),
                            for_s=round(rng.uniform(0.5, 4.0), 2), amount=_amount(rng, kind)))
    return Step(kill=kill, toxics=tuple(toxics))


def draw_fill(rng: random.Random, pods: int) -> Fill | None:
    """Whether a pod's staging volume fills during the refit, from a generator of its own."""
    if rng.random() >= 0.3:
        return None
    return Fill(pod=rng.randrange(pods), after_s=round(rng.uniform(0, 3.0), 2),
                for_s=round(rng.uniform(1.0, 5.0), 2), leave_bytes=rng.randint(0, 64 << 10))


AMOUNTS: dict[str, tuple[int, int]] = {  # the range each kind's size is drawn from
    "latency": (50, 800),  # ms each way
    "bandwidth": (16, 512),  # KB/s
    "reset_peer": (0, 500),  # ms before the reset
    "timeout": (0, 0),  # 0: the connection hangs until the toxic goes
    "limit_data": (200, 200_000),  # bytes before the connection is cut
    "slicer": (16, 512),  # average slice, bytes
    "http5xx": (1, 6),  # 503 answers
    "partition": (0, 0),
}


def _amount(rng: random.Random, kind: str) -> int:
    lo, hi = AMOUNTS[kind]
    return rng.randint(lo, hi)


def _attributes(t: Toxic) -> dict[str, int]:
    return {"latency": {"latency": t.amount, "jitter": t.amount // 4},
            "bandwidth": {"rate": t.amount}, "reset_peer": {"timeout": t.amount},
            "timeout": {"timeout": 0}, "limit_data": {"bytes": t.amount},
            "slicer": {"average_size": t.amount, "size_variation": t.amount // 2,
                       "delay": 50}}[t.kind]


# --- the fleet ---------------------------------------------------------------------------

@dataclass(kw_only=True)
class Fleet:
    """The running parties and how to reach them."""

    out: Path
    events: Path
    ckpts: Path
    pods: list[Pod]
    owners: list[EncoderProcess]
    toxi: Toxiproxy
    layer: Http5xx
    spec: Path  # the coordinator's spec (bench/faultcoord.py)
    record: SqliteCommitStore
    train_env: dict[str, str]
    direct_env: dict[str, str]
    store: str
    trainer: Trainer
    relays: list[RelayNode] = field(default_factory=list)  # empty: a store campaign
    volumes: list[Path] = field(default_factory=list)  # the pods' staging tmpfs mounts
    coordinator: subprocess.Popen[bytes] | None = None
    round: int = 0
    last_record: tuple[int, str] | None = None

    def agents(self) -> list[AgentClient]:
        return [p.sidecar.client(timeout_s=30.0) for p in self.pods]

    def process(self, name: str) -> Process | None:
        table: dict[str, Process] = {p.sidecar.name: p.sidecar for p in self.pods}
        table.update({f"serve-{i}": p.server for i, p in enumerate(self.pods)})
        table.update({o.name: o for o in self.owners})
        table.update({r.name: r for r in self.relays})
        return table.get(name)

    def observe_record(self) -> CommitRecord:
        """Read the record (its own answer) and log it when it changed."""
        r = self.record.read()
        key = (r.committed_version, r.attempt)
        if key != self.last_record:
            emit(self.events, "harness", "record", **record_fields(r))
            self.last_record = key
        return r


def _env(endpoint: str, s3: Any) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_DEFAULT_REGION": s3.region}


@contextmanager
def fleet(out: Path, seed: int, pods: int, owners: int, size: TrainerSettings,
          transport: str = "store") -> Iterator[Fleet]:
    """Start every party; stop them all on exit (then unmount the staging volumes)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ckpts = out / "checkpoints"
    trainer = Trainer(size)
    trainer.export(ckpts / "v0")
    token, owner_token = secrets.token_hex(16), secrets.token_hex(16)
    with ExitStack() as stack:
        s3 = stack.enter_context(s3_server(out / "s3", bucket="campaign"))
        layer = stack.enter_context(http5xx(s3.endpoint.removeprefix("http://")))
        toxi = stack.enter_context(toxiproxy_server(out / "toxiproxy", seed))
        links = {name: toxi.proxy(name, f"127.0.0.1:{layer.port}")
                 for name in ["train"] + [f"pod-{i}" for i in range(pods)]}
        store = f"s3://{s3.bucket}/policy"
        train_env = _env(f"http://{links['train']}", s3)
        sources: list[dict[str, Any]] = [{"store": store}] * pods
        publish, owner_env, relays = store, train_env, []
        if transport == "relay":
            tree = relay_tree(out / "relay", max(RELAY_NODES, pods + 1))
            relays = tree.nodes
            # No pod at the root; pod 0 at the intermediate node, the last pod at a leaf
            # below it. Every pod still reads the history (its rejoins) from the store.
            sources = [{"relay": relays[len(relays) - pods + i].url, "store": store,
                        "relay_token_file": tree.read_token_file} for i in range(pods)]
            publish = tree.publish_uri(store)
            owner_env = {**train_env, TOKEN_ENV: tree.publish_token_file.read_text().strip()}
        the_pods = [rollout_pod(i, pods, out, sources[i], ckpts, token,
                                _env(f"http://{links[f'pod-{i}']}", s3)) for i in range(pods)]
        volumes = [p.serve.staging_dir for p in the_pods]
        mounted = [stack.enter_context(small_volume(v, STAGING_VOLUME_BYTES)) for v in volumes]
        running: list[Process] = []
        stack.callback(lambda: [p.stop() for p in reversed(running)])
        the_owners = [EncoderProcess(name=f"owner-{k}", workdir=out / "owners" / f"owner-{k}",
                                     token=owner_token, env=owner_env,
                                     args=["--store", publish, "--checkpoint-root", str(ckpts),
                                           "--threads", "1"]) for k in range(owners)]
        procs: list[Process] = [*relays, *(p.server for p in the_pods),
                                *(p.sidecar for p in the_pods)]
        for p in [*procs, *the_owners]:
            p.start()
            running.append(p)
        for p in [*procs, *the_owners]:
            p.wait_ready()
        clients = [p.sidecar.client() for p in the_pods]
        profile = merge(ReceiverProfile.model_validate(c.profile()) for c in clients)
        (out / "profile.json").write_text(dumps(profile))
        spec = out / "coordinator.json"
        spec.write_text(json.dumps({
            "events": str(out / "events.jsonl"), "record": str(out / "commit.db"),
            "checkpoint": str(ckpts / "v{v}"), "store": store,
            "publish": split_through(publish)[0],  # where the owners say they wrote
            "profile": str(out / "profile.json"),
            "owners": [o.url for o in the_owners], "agents": [[c.name, c.url] for c in clients],
            "agent_token_file": str(write_token_file(out / "agent-token", token)),
            "owner_token_file": str(write_token_file(out / "owner-token", owner_token)),
            "agent_timeout_s": 30.0,
            "coordinator": {"attempt_timeout_s": 90.0, "max_attempts": 4}}))
        record = SqliteCommitStore(out / "commit.db", CommitRecord(
            committed_version=0, baseline_id=str(ckpts / "v0"), attempt=""))
        f = Fleet(out=out, events=out / "events.jsonl", ckpts=ckpts, pods=the_pods,
                  owners=the_owners, toxi=toxi, layer=layer, spec=spec, record=record,
                  train_env=train_env, direct_env=_env(s3.endpoint, s3), store=store,
                  trainer=trainer, relays=relays,
                  volumes=[v for v, m in zip(volumes, mounted, strict=True) if m])
        try:
            yield f
        finally:
            if f.coordinator is not None and f.coordinator.poll() is None:
                f.coordinator.kill()
                f.coordinator.wait()


# --- one refit under faults --------------------------------------------------------------

@dataclass
class Outcome:
    committed: bool = False
    coordinator_runs: int = 0
    attempts: int = 0
    landed: list[dict[str, Any]] = field(default_factory=list)  # faults that happened


def _at_stage(f: Fleet, stage: str, watched: AgentClient, version: int) -> bool:
    """Whether the refit to ``version`` has reached ``stage``, by the parties' answers."""
    if stage == "gate-open":
        return f.observe_record().committed_version >= version
    if stage == "commit":
        states = []
        for a in f.agents():
            try:
                states.append(a.status().state)
            except DcrError:
                return False
        return all(s == "flushed" for s in states)
    want = {"stage": {"prepared", "streaming", "staged", "gate_closed"},
            "apply": {"applying"}, "flush": {"flushed"}}[stage]
    try:
        return watched.status().state in want
    except DcrError:
        return False


def _kill(f: Fleet, k: Kill, version: int, running: threading.Event,
          out: Outcome) -> None:
    """Wait for ``k.stage`` of the refit, kill -9 the victim, restart it after a delay."""
    idx = int(k.victim.rsplit("-", 1)[1]) if k.victim[-1].isdigit() else 0
    watched = f.agents()[idx if k.victim.startswith(("agent", "serve")) else 0]
    watched.timeout_s = 2.0
    while running.is_set() and not _at_stage(f, k.stage, watched, version):
        time.sleep(0.005)
    if not running.is_set():
        return  # the refit ended before the stage was seen: nothing landed
    if k.victim == "coordinator":
        proc = f.coordinator
        if proc is None or proc.poll() is not None:
            return
        proc.kill()  # the driver loop restarts it after the delay
    else:
        victim = f.process(k.victim)
        assert victim is not None
        victim.kill()
        time.sleep(k.restart_after_s)
        victim.start()
        victim.wait_ready()
    _landed(f, out, {"fault": f"kill {k.victim.rsplit('-', 1)[0]}", "stage": k.stage})


def _toxic(f: Fleet, t: Toxic, running: threading.Event, out: Outcome) -> None:
    time.sleep(t.after_s)
    if not running.is_set():
        return
    if t.kind == "http5xx":
        f.layer.arm(t.amount)
    elif t.kind == "partition":
        f.toxi.enable(t.link, False)
    else:
        f.toxi.toxic(t.link, t.kind, _attributes(t), name=f"campaign-{t.kind}")
    _landed(f, out, {"fault": t.kind, "link": "train" if t.link == "train" else "pod"})
    time.sleep(t.for_s)
    _clear(f)


def _fill(f: Fleet, v: Fill, running: threading.Event, out: Outcome) -> None:
    """Fill pod ``v.pod``'s staging volume for ``v.for_s``, then free it."""
    time.sleep(v.after_s)
    volume = f.pods[v.pod].serve.staging_dir
    if not running.is_set() or volume not in f.volumes:  # not root: no volume to fill
        return
    fill(volume, v.leave_bytes)
    _landed(f, out, {"fault": "volume_full", "link": "pod"})
    time.sleep(v.for_s)
    free(volume)


def _landed(f: Fleet, out: Outcome, fault: dict[str, str]) -> None:
    """A fault that happened (logged for the record; the checker does not read it)."""
    out.landed.append(fault)
    emit(f.events, "harness", "fault", **fault)


def _clear(f: Fleet) -> None:
    f.toxi.reset()
    f.layer.disarm()
    for volume in f.volumes:
        free(volume)


def _drive(f: Fleet, version: int, kill: Kill | None, out: Outcome) -> None:
    """The operator's part: run coordinator processes until ``version`` is committed."""
    for _ in range(COORDINATOR_RUNS):
        with open(f.out / "coordinator.log", "ab") as log:
            f.coordinator = subprocess.Popen(
                [sys.executable, str(HERE / "faultcoord.py"), str(f.spec), str(version)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env={**os.environ, **f.train_env})
        code = f.coordinator.wait()
        out.coordinator_runs += 1
        if code == 0:
            out.committed = True
            return
        if code < 0 and kill is not None:  # killed: restarted after the drawn delay
            time.sleep(kill.restart_after_s)


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def complete(f: Fleet, pod: Pod, running: threading.Event) -> None:
    """A client of ``pod``'s server: greedy completions while the refit runs, each answer's
    per-token weight versions logged as the server reported them."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "return_weight_versions": True,
                       "logprobs": 0}).encode()
    while running.is_set():
        req = urllib.request.Request(pod.server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                choice = json.loads(r.read())["choices"][0]
        except (OSError, ValueError, KeyError):  # killed, restarting, or refused
            time.sleep(0.1)
            continue
        emit(f.events, "client", "completion", pod=pod.server.name, pod_kind=pod.kind,
             versions=choice.get("weight_versions"), tokens=choice["token_ids"],
             logprobs=choice["logprobs"]["token_logprobs"])
        time.sleep(0.05)


def refit(f: Fleet, version: int, step: Step) -> Outcome:
    out = Outcome()
    running = threading.Event()
    running.set()
    threads = [threading.Thread(target=_toxic, args=(f, t, running, out), daemon=True)
               for t in step.toxics]
    threads += [threading.Thread(target=complete, args=(f, p, running), daemon=True)
                for p in f.pods]
    if step.fill is not None:
        threads.append(threading.Thread(target=_fill, args=(f, step.fill, running, out),
                                        daemon=True))
    if step.kill is not None:
        threads.append(threading.Thread(target=_kill, args=(f, step.kill, version, running,
                                                           out), daemon=True))
    for t in threads:
        t.start()
    try:
        _drive(f, version, step.kill, out)
    finally:
        running.clear()
        for t in threads:
            t.join(120)
        _clear(f)
    return out


# --- settling and checking ---------------------------------------------------------------

def observe(f: Fleet, catch_up: bool) -> bool:
    """One round: every agent's status and fingerprints, as it answers; an agent behind the
    record rejoins (the operator's refresh). Whether every agent is clean at the record."""
    f.round += 1
    record = f.observe_record()
    settled = True
    for pod, client in zip(f.pods, f.agents(), strict=True):
        try:
            st: AgentStatus | None = client.status()
            assert st is not None
            clean = st.dirty is None and st.unknown is None and st.version is not None
            fp = client.fingerprint() if clean else None
        except DcrError as e:
            emit(f.events, "harness", "agent", round=f.round, agent=client.name,
                 pod_kind=pod.kind, error=str(e)[:200])
            settled = False
            continue
        emit(f.events, "harness", "agent", round=f.round, agent=client.name, pod_kind=pod.kind,
             version=st.version, dirty=st.dirty, unknown=st.unknown, state=st.state,
             attempt=st.attempt, fingerprint=fp)
        if st.version != record.committed_version or not clean:
            settled = False
            if catch_up and behind(st, record):
                try:
                    client.rejoin(record.committed_version, None, record.history_digest or None)
                except DcrError as e:
                    print(f"  {client.name} rejoin: {e}", flush=True)
    return settled


def settle(f: Fleet, step: int) -> None:
    emit(f.events, "harness", "faults_stopped", step=step, bound_s=SETTLE_BOUND_S,
         agents=[p.sidecar.name for p in f.pods])
    deadline = time.monotonic() + SETTLE_BOUND_S
    while time.monotonic() < deadline:
        if observe(f, catch_up=True) and observe(f, catch_up=False):
            return
        time.sleep(0.5)


def references(f: Fleet, version: int) -> None:
    ckpt = f.ckpts / f"v{version}"
    for kind, pod in {p.kind: p for p in f.pods}.items():
        emit(f.events, "harness", "reference", version=version, pod_kind=kind,
             fingerprint=pod_reference(pod, ckpt))


def tensor_sums(ckpt: Path) -> dict[str, str]:
    with Checkpoint(ckpt) as c:
        return {n: hashlib.sha256(c.bits(n).tobytes()).hexdigest()[:32] for n in c.names()}


def materialize_all(f: Fleet) -> None:
    """Build every committed version from the store alone; log its tensors and the
    checkpoint's."""
    top = f.record.read().committed_version
    for v in range(1, top + 1):
        dest = f.out / "materialized" / f"v{v}"
        run = subprocess.run(
            [sys.executable, "-m", "dcr", "materialize", "--store", f.store, "--out", str(dest),
             "--version", str(v), "--held", "0", "--seed", str(f.ckpts / "v0"), "--json"],
            capture_output=True, text=True, timeout=600, check=False,
            env={**os.environ, **f.direct_env})
        if run.returncode != 0:
            emit(f.events, "harness", "materialized", version=v,
                 error=run.stderr.strip().splitlines()[-1:], tensors={})
        else:
            emit(f.events, "harness", "materialized", version=v, tensors=tensor_sums(dest))
        if (f.ckpts / f"v{v}").exists():  # else the record names a version never trained
            emit(f.events, "harness", "checkpoint", version=v,
                 tensors=tensor_sums(f.ckpts / f"v{v}"))
        shutil.rmtree(dest, ignore_errors=True)


# --- a campaign --------------------------------------------------------------------------

@dataclass
class Campaign:
    seed: int
    transport: str = "store"
    refits: int = 0
    failed_refits: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    report: Report = field(default_factory=Report)
    events: Path | None = None
    attempts: list[int] = field(default_factory=list)  # per committed version


def attempts_per_commit(events: list[dict[str, Any]]) -> list[int]:
    """Attempts each committed version took, over every coordinator process that worked on
    it, as each reported them; a process killed before it could report counts one."""
    ended = {e["pid"]: len(e["attempts"]) for e in events if e["kind"] in ("done", "failed")}
    per: Counter[int] = Counter()
    for e in events:
        if e["kind"] == "start":
            per[int(e["target"])] += ended.get(e["pid"], 1)
    done = {int(e["new"]["version"]) for e in events
            if e["kind"] == "cas" and e["outcome"] == "success"}
    return [per[v] for v in sorted(done)]


def schedule(seed: int, steps: int, pods: int, owners: int, transport: str = "store"
             ) -> list[Step]:
    """The campaign's faults, from ``seed`` alone."""
    rng, volumes = random.Random(seed), random.Random(f"staging volumes {seed}")
    relays = max(RELAY_NODES, pods + 1) if transport == "relay" else 0
    return [replace(draw(rng, pods, owners, relays), fill=draw_fill(volumes, pods))
            for _ in range(steps)]


def run(seed: int, steps: int, out: Path, *, pods: int = 3, owners: int = 2,
        size: TrainerSettings = SMALL, transport: str = "store",
        say: Callable[[str], None] = print) -> Campaign:
    """``steps`` refits under faults drawn from ``seed``, then the check."""
    plan = schedule(seed, steps, pods, owners, transport)
    say(f"seed {seed}: {steps} refits, {pods} pods, {owners} owners, through the "
        f"{transport} (replay: python bench/faults.py --seed {seed} --steps {steps} "
        f"--transport {transport})")
    for i, s in enumerate(plan, 1):
        say(f"  refit {i}: kill {asdict(s.kill) if s.kill else None}; "
            f"toxics {[asdict(t) for t in s.toxics]}; "
            f"fill {asdict(s.fill) if s.fill else None}")
    c = Campaign(seed=seed, transport=transport)
    with fleet(out, seed, pods, owners, size, transport) as f:
        if len(f.volumes) < pods:
            say("  (not root: the staging volumes are plain directories; no fill lands)")
        c.events = f.events
        emit(f.events, "harness", "campaign", seed=seed, steps=steps)
        f.observe_record()
        references(f, 0)
        for i, s in enumerate(plan, 1):
            version = f.record.read().committed_version + 1
            if not (f.ckpts / f"v{version}").exists():
                f.trainer.step()
                f.trainer.export(f.ckpts / f"v{version}")
                references(f, version)
            t0 = time.monotonic()
            o = refit(f, version, s)
            c.outcomes.append(o)
            c.refits += o.committed
            c.failed_refits += not o.committed
            settle(f, i)
            say(f"  refit {i} -> v{version}: {'committed' if o.committed else 'NOT committed'}"
                f" in {time.monotonic() - t0:.1f} s, {o.coordinator_runs} coordinator runs; "
                f"landed {o.landed}")
        materialize_all(f)
    events = read_events(f.events)
    c.report = check(events)
    c.attempts = attempts_per_commit(events)
    for v in c.report.violations:
        say(f"  VIOLATION seed {seed}: {v}")
    say(f"seed {seed}: {c.refits} committed, {c.failed_refits} not, "
        f"{len(c.report.violations)} violations")
    return c


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summary(campaigns: list[Campaign], minutes: float, steps: int) -> dict[str, Any]:
    landed = [x for c in campaigns for o in c.outcomes for x in o.landed]
    recovery = [x for c in campaigns for x in c.report.recovery_s]
    runs = [o.coordinator_runs for c in campaigns for o in c.outcomes if o.committed]
    attempts = [n for c in campaigns for n in c.attempts]
    return {
        "command": f"python bench/faults.py --soak --minutes {minutes:g} --seed "
                   f"{campaigns[0].seed} --steps {steps} --transport {campaigns[0].transport}",
        "seeds": [c.seed for c in campaigns], "minutes": minutes, "steps_per_seed": steps,
        "refits_committed": sum(c.refits for c in campaigns),
        "refits_not_committed": sum(c.failed_refits for c in campaigns),
        "faults_by_kind": dict(Counter(x["fault"] for x in landed)),
        "kills_by_stage": dict(Counter(x["stage"] for x in landed if "stage" in x)),
        "violations": [{"seed": c.seed, "kind": v.kind, "detail": v.detail}
                       for c in campaigns for v in c.report.violations],
        "recovery_s": {"n": len(recovery), "p50": _percentile(recovery, 0.5),
                       "p99": _percentile(recovery, 0.99), "max": max(recovery, default=None),
                       "bound": SETTLE_BOUND_S},
        "coordinator_runs_per_commit": {
            "mean": statistics.mean(runs) if runs else None, "max": max(runs, default=None)},
        "attempts_per_commit": {
            "mean": statistics.mean(attempts) if attempts else None,
            "p99": _percentile([float(a) for a in attempts], 0.99),
            "max": max(attempts, default=None)},
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=None, help="replay this seed (default: random)")
    ap.add_argument("--steps", type=int, default=4, help="refits per seed")
    ap.add_argument("--soak", action="store_true", help="run seeds until --minutes pass, "
                    "then write bench/results/faults.json")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--transport", choices=TRANSPORTS, default="store",
                    help="relay: attempts travel a relay tree whose nodes are killed too")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where --soak writes its "
                    "summary (default: bench/results/faults.json)")
    ap.add_argument("--out", type=Path, default=None, help="working directory (default: a "
                    "temporary one)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the parties on the way out
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    work = args.out or Path(tempfile.mkdtemp(prefix="dcr-faults-"))
    campaigns = []
    end = time.monotonic() + args.minutes * 60
    while True:
        campaigns.append(run(seed, args.steps, work / f"seed-{seed}",
                             transport=args.transport))
        if not args.soak or time.monotonic() > end:
            break
        seed += 1
    if args.soak:
        result = summary(campaigns, args.minutes, args.steps)
        if args.results != RESULTS:
            result["command"] += f" --results {args.results}"
        args.results.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    return 1 if any(c.report.violations for c in campaigns) else 0


if __name__ == "__main__":
    sys.exit(main())
