"""The RL main job's run: pods, store, trainer and TRL, one GRPO step after another.

:func:`start_fleet` starts what the rollout side is (pods behind links to the store, the
coordinator over their agents, the owner over the trainer's parameters);
:func:`run_rl` trains on it with TRL and reports each step (:mod:`dcr.rl.job`).
"""

from __future__ import annotations

import copy
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcr.errors import DcrError
from dcr.files.history import HistoryStore
from dcr.format.profile import ReceiverProfile, merge
from dcr.integrations.trl import DcrWeightSync, FleetRollout, RolloutSettings
from dcr.loop import fingerprint
from dcr.protocol.agent_api import AgentClient, AgentError
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings
from dcr.protocol.records import CommitRecord
from dcr.receiver.settings import AgentSettings
from dcr.refit.boundary import Boundary
from dcr.refit.full import FullPath, full_refit
from dcr.refit.kills import Held, Killer, KillPoint
from dcr.refit.launch import AgentProcess, ServeProcess, free_port
from dcr.refit.trainer import Trainer, TrainerSettings
from dcr.rl.job import SIZES, RlSettings, StepRow, environment, summarize, write_summary
from dcr.rl.task import byte_tokenizer, digit_share, prompts
from dcr.serve.settings import ServeSettings
from dcr.settings import to_argv

if TYPE_CHECKING:
    import torch
    from transformers import TrainerCallback

LAUNCHED = ("name", "listen", "state_dir", "token_file")  # AgentProcess passes these itself
SERVED = ("listen", "api_key_file")  # and ServeProcess these


@dataclass(frozen=True, kw_only=True)
class Pod:
    """One rollout pod: ``dcr serve`` (hf) and its agent with a client door."""

    server: ServeProcess
    sidecar: AgentProcess
    door: str  # the client door's URL
    dense_root: Path  # where the full-checkpoint comparison puts its copies

    def client(self) -> AgentClient:
        return self.sidecar.client()


def pod(i: int, out: Path, base: Path, store: str, token: str, env: dict[str, str],
        pause_mode: str) -> Pod:
    """Pod ``i``: its own copy of the base model, its agent reading ``store``."""
    home = out / "pods" / f"pod-{i}"
    weights, staging = home / "weights", home / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copytree(base, weights / "v0")
    serve = ServeSettings(model=weights / "v0", staging_dir=staging, checkpoint_root=weights,
                          weight_version="0", max_running=64)
    server = ServeProcess(name=f"serve-{i}", args=to_argv(serve, skip=SERVED),
                          workdir=home / "serve")
    door = f"127.0.0.1:{free_port()}"
    agent = AgentSettings(name=f"agent-{i}", state_dir=home / "agent", engine_url=server.url,
                          staging_dir=staging, canonical=weights / "v0",
                          checkpoint_root=weights, store=store, client_listen=door,
                          pause_mode=pause_mode)  # type: ignore[arg-type]
    sidecar = AgentProcess(name=agent.name, args=to_argv(agent, skip=LAUNCHED),
                           state_dir=agent.state_dir, token=token, env=env)
    return Pod(server=server, sidecar=sidecar, door=f"http://{door}",
               dense_root=agent.dense_root)


@dataclass(kw_only=True)
class Fleet:
    """What the trainer refits: pods, the boundary they reach the store through, the
    coordinator and the kill point its owner's publishes wait at."""

    pods: list[Pod]
    boundary: Boundary
    kills: KillPoint = field(default_factory=KillPoint)
    coordinator: Coordinator | None = None
    profile: ReceiverProfile | None = None

    def coordinator_for(self, commits: Path, settings: CoordinatorSettings
                        ) -> Callable[[Any], Coordinator]:
        def build(owner: Any) -> Coordinator:
            owner.profile = self.profile
            history = HistoryStore(self.boundary.direct_store())
            self.coordinator = Coordinator(
                SqliteCommitStore(commits, CommitRecord(committed_version=0,
                                                        baseline_id="base", attempt="")),
                [Held(owner=owner, point=self.kills)], [p.client() for p in self.pods],
                settings=settings, history=history)
            return self.coordinator
        return build

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        for p in self.pods:
            p.sidecar.stop()
            p.server.stop()
        self.boundary.close()


def start_fleet(out: Path, base: Path, *, pods: int, store_kind: str, link_mbit: float,
                rtt_ms: float, pause_mode: str = "wait") -> Fleet:
    """``pods`` pods serving ``base``, behind links to a store; every process ready."""
    boundary = Boundary(work=out / "boundary", store_dir=out / "store",
                        store_kind=store_kind, pods=pods, link_mbit=link_mbit,
                        rtt_ms=rtt_ms)
    fleet = Fleet(pods=[], boundary=boundary)
    try:
        boundary.start()
        token = secrets.token_hex(16)
        fleet.pods = [pod(i, out, base, boundary.store_uri, token, boundary.pod_env(i),
                          pause_mode) for i in range(pods)]
        for proc in [p.server for p in fleet.pods] + [p.sidecar for p in fleet.pods]:
            proc.start()
        for proc in [p.server for p in fleet.pods] + [p.sidecar for p in fleet.pods]:
            proc.wait_ready()
        fleet.profile = merge(ReceiverProfile.model_validate(p.client().profile())
                              for p in fleet.pods)
    except BaseException:
        fleet.close()
        raise
    return fleet


def status_version(client: AgentClient, wait_s: float = 120.0) -> int | None:
    """The agent's committed version, waiting while it answers 503 (a restarted agent
    prewarms its engine first)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.status().version
        except AgentError as e:
            if e.status != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def catch_up(fleet: Fleet, version: int, history_digest: str | None) -> list[str]:
    """Pods whose agent is not at ``version`` (one killed mid-refit) rejoin from the
    store's history, the one ``history_digest`` (the commit record's) names; their names."""
    behind = [p for p in fleet.pods if status_version(p.client()) != version]
    for p in behind:
        p.client().rejoin(version, None, history_digest)
    return [p.sidecar.name for p in behind]


def bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import torch

    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def exact(fleet: Fleet, base: Path, model: torch.nn.Module) -> bool:
    """Every pod holds what a dense load of the trainer's weights (BF16) gives."""
    want = fingerprint(base, bf16(model))
    return all(p.client().fingerprint() == want for p in fleet.pods)


def dense_refit(fleet: Fleet, out: Path, version: int, model: torch.nn.Module) -> float:
    """Seconds of a full-checkpoint refit to the trainer's weights: export, upload, each
    pod's download through its link and dense load (:func:`dcr.refit.full.full_refit`)."""
    t0 = time.perf_counter()
    ckpt = out / "dense" / f"v{version}"
    shutil.rmtree(ckpt, ignore_errors=True)
    import torch

    export: Any = copy.deepcopy(model).to(torch.bfloat16)
    export.save_pretrained(ckpt, max_shard_size="2MB")
    b = fleet.boundary
    path = FullPath(upload=b.direct_store(), pods=[b.pod_store(i) for i in range(b.pods)])
    full_refit(version, ckpt, [p.sidecar for p in fleet.pods], path,
                      [p.dense_root / f"full-{p.sidecar.name}" for p in fleet.pods])
    shutil.rmtree(ckpt, ignore_errors=True)
    return time.perf_counter() - t0


@dataclass(kw_only=True)
class Reporter:
    """Callbacks around :class:`DcrWeightSync`: arm the step's kill before its refit
    (:meth:`arm`), then time, check and print the step (:meth:`report`)."""

    s: RlSettings
    fleet: Fleet
    sync: DcrWeightSync
    rollout: FleetRollout
    base: Path
    out: Path
    rewards: list[float] = field(default_factory=list)
    rows: list[StepRow] = field(default_factory=list)
    killer: Killer | None = None
    started: float = 0.0
    parameters: int = 1
    down: int | None = None  # bytes down the pods' links when the step's refit began

    versioned: list[tuple[int, int]] = field(default_factory=list)  # (samples, versioned)

    def reward(self, completion_ids: list[list[int]], weight_versions: list[list[int]],
               **_: Any) -> list[float]:
        got = digit_share(completion_ids)
        self.rewards.append(sum(got) / len(got))
        self.versioned.append((len(completion_ids), sum(
            len(v) == len(c) for v, c in zip(weight_versions, completion_ids, strict=True))))
        return got

    def begin(self) -> None:
        self.started = time.perf_counter()

    def arm(self, step: int) -> None:
        self.down = self.crossed()
        if step != self.s.kill_step:
            return
        victim = self.fleet.pods[step % len(self.fleet.pods)].sidecar
        self.killer = Killer(victim, victim)
        self.killer.start()
        self.fleet.kills.killer = self.killer

    def crossed(self) -> int | None:
        """Bytes down every pod's link so far (None without links)."""
        b = self.fleet.boundary
        return sum(b.pods_down().values()) if b.linked and b.links else None

    def since(self, before: int | None) -> tuple[int | None, int | None]:
        """The bytes down the links since ``before``, and the count now."""
        now = self.crossed()
        return (None if now is None or before is None else now - before), now

    def report(self, step: int, model: torch.nn.Module) -> StepRow:
        self.sync.wait() if not self.sync.overlap else None
        killed = None
        if self.killer is not None:
            self.killer.done.wait()
            killed, self.killer, self.fleet.kills.killer = self.killer.victim.name, None, None
        step_s = time.perf_counter() - self.started
        refit = self.sync.steps[-1] if self.sync.steps else None
        gen = self.rollout.calls[-1]
        refit_s = (refit.offer_s + refit.refit_s) if refit and not self.sync.overlap else 0.0
        check = not self.sync.overlap
        if check:
            catch_up(self.fleet, self.sync.committed, self.sync.history_digest)
        dcr_bytes, now = self.since(self.down)
        bit_exact = exact(self.fleet, self.base, model) if check else True  # before the dense
        dense_s = (dense_refit(self.fleet, self.out, step, model)
                   if self.s.dense and check and not killed else None)
        dense_bytes = self.since(now)[0] if dense_s is not None else None
        changed = refit.changed_elements if refit else 0
        row = StepRow(
            step=step, reward=self.rewards[-1], generate_s=gen.seconds,
            train_s=max(step_s - gen.seconds - refit_s, 0.0), refit_s=refit_s,
            refit_share=refit_s / step_s, step_s=step_s,
            tokens_per_s=gen.tokens / gen.seconds if gen.seconds else 0.0,
            versions={str(k): v for k, v in sorted(gen.versions.items())},
            dropped=gen.dropped, samples=self.versioned[-1][0],
            versioned=self.versioned[-1][1],
            changed_elements=changed, changed_share=changed / self.parameters,
            attempts=refit.attempts if refit else 0,
            bit_exact=bit_exact, killed=killed, dense_refit_s=dense_s, dcr_bytes=dcr_bytes,
            dense_bytes=dense_bytes)
        self.rows.append(row)
        print(line(row), flush=True)
        return row


WHEN = {True: "overlapping the next batch", False: "before the next batch"}
HEADER = (f"{'step':>4} {'reward':>6} {'gen s':>6} {'train s':>7} {'refit s':>7} "
          f"{'share':>6} {'tok/s':>6} {'dense s':>7} {'changed':>7}  "
          "versions (tokens)  bit-exact")


def line(r: StepRow) -> str:
    versions = ", ".join(f"v{k}: {n}" for k, n in r.versions.items())
    notes = [f"killed {r.killed}"] if r.killed else []
    notes += [f"{r.attempts} attempts"] if r.attempts > 1 else []
    notes += [f"{r.dropped} stale samples drawn again"] if r.dropped else []
    dense = f"{r.dense_refit_s:>7.2f}" if r.dense_refit_s is not None else f"{'-':>7}"
    return (f"{r.step:>4} {r.reward:>6.3f} {r.generate_s:>6.2f} {r.train_s:>7.2f} "
            f"{r.refit_s:>7.2f} {100 * r.refit_share:>5.1f}% {r.tokens_per_s:>6.0f} {dense} "
            f"{100 * r.changed_share:>6.1f}%  "
            f"{versions:<17} {'yes' if r.bit_exact else 'NO'}"
            + (f"  ({'; '.join(notes)})" if notes else ""))


def callbacks(rep: Reporter) -> tuple[TrainerCallback, TrainerCallback]:
    """TRL callbacks: one before the weight sync (start the clock, arm the kill), one
    after it (report)."""
    from transformers import TrainerCallback

    class Before(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            rep.begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            rep.arm(int(state.global_step))

    class After(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        **_: Any) -> None:
            rep.report(int(state.global_step), model)

    return Before(), After()


def grpo(s: RlSettings, out: Path, model: Any, rollout: FleetRollout,
         reward: Callable[..., Any], cbs: list[Any]) -> Any:
    """TRL's GRPOTrainer over ``model`` with ``rollout`` and ``cbs``, on the CPU, saving
    nothing."""
    from datasets import Dataset
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=s.prompts * s.generations,
        num_generations=s.generations, max_completion_length=s.max_tokens,
        learning_rate=s.lr, lr_scheduler_type="constant", beta=0.0, max_steps=s.steps,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        disable_tqdm=True, seed=s.seed)
    data = Dataset.from_dict({"prompt": prompts(s.prompts * s.steps)})
    from transformers import PrinterCallback

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=byte_tokenizer(), rollout_func=rollout,
                          callbacks=cbs)
    trainer.remove_callback(PrinterCallback)  # the job prints its own table
    return trainer


def run_rl(s: RlSettings) -> dict[str, Any]:
    import torch
    from transformers.utils import logging as hf_logging

    environment()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    out = s.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    trainer = Trainer(TrainerSettings(seed=s.seed, warmup_steps=0, **SIZES[s.size]))  # type: ignore[arg-type]
    base = trainer.export(out / "base")  # the pods' starting model, as a public one is
    fleet = start_fleet(out, base, pods=s.pods, store_kind=s.store_kind,
                        link_mbit=s.link_mbit, rtt_ms=s.rtt_ms, pause_mode=s.pause_mode)
    try:
        sync = DcrWeightSync.for_model(
            trainer.model, store=fleet.boundary.direct_store(), overlap=s.overlap,
            dtype=torch.bfloat16, coordinator_for=fleet.coordinator_for(
                out / "commit.db", CoordinatorSettings(attempt_timeout_s=300.0)))
        rollout = FleetRollout([p.door for p in fleet.pods], sync=sync,
                               settings=RolloutSettings(max_tokens=s.max_tokens,
                                                        max_staleness=s.max_staleness,
                                                        seed=s.seed))
        rep = Reporter(s=s, fleet=fleet, sync=sync, rollout=rollout, base=base, out=out,
                       parameters=trainer.parameters)
        before, after = callbacks(rep)
        print(f"model: Llama ({s.size}), {trainer.parameters:,} parameters; GRPO, "
              f"{s.prompts} prompts x {s.generations} completions of {s.max_tokens} tokens "
              f"a step, lr {s.lr}; reward: share of digits")
        print(fleet.boundary.describe(relay=False))
        print(f"{s.pods} rollout pods, client doors {', '.join(p.door for p in fleet.pods)}; "
              f"refit after every step by DCR ({WHEN[s.overlap]}), "
              f"no checkpoint written" + (f"; agent killed mid-refit at step {s.kill_step}"
                                          if s.kill_step else ""))
        print(HEADER)
        grpo(s, out, trainer.model, rollout, rep.reward, [before, sync, after]).train()
        sync.wait()
        if s.overlap:  # the last refit, checked once it committed
            catch_up(fleet, sync.committed, sync.history_digest)
            if not exact(fleet, base, trainer.model):
                raise DcrError("A pod differs from a dense load of the trainer's weights.")
    finally:
        fleet.close()
    summary = summarize(s, rep.rows, trainer.parameters)
    path = write_summary(out, summary)
    from dcr.rl.plot import plot_rl

    plot = plot_rl(rep.rows, out / "rl.png")
    m = summary["median"]
    print(f"reward {summary['reward_first']:.3f} at step 1, {summary['reward_last']:.3f} at "
          f"step {s.steps}; median step {m['step_s']:.2f} s, refit {m['refit_s']:.2f} s "
          f"({100 * m['refit_share']:.1f}% of the step)"
          + (f"; a dense full-checkpoint refit would make the step "
             f"{summary['dense_step_ratio']:.2f}x as long" if "dense_step_ratio" in summary
             else ""))
    print(f"{'all' if summary['bit_exact'] else 'NOT all'} {s.steps} refits bit-exact on "
          f"every pod; summary {path}" + (f"; plot {plot}" if plot else ""))
    return summary


__all__ = ["Fleet", "Pod", "catch_up", "exact", "run_rl", "start_fleet"]
