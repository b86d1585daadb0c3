"""TRL's GRPOTrainer with a DCR fleet: rollouts from the fleet, weights back to it each step.

Two of TRL's public extension points (``trl==1.16``), nothing patched:

- :class:`FleetRollout` is GRPOTrainer's ``rollout_func``: each prompt's completions come
  from the rollout pods' client door (OpenAI-compatible ``/v1/completions``, token ids in,
  token ids out), with the behaviour logprobs (``logprobs: 0``) and the weight version of
  every token (``return_weight_versions``, read by :func:`dcr.client.token_versions`);
  or (``api="generate"``) from vLLM's token route ``/inference/v1/generate``, the one
  that reports weight versions before vLLM 0.33 (``--enable-scale-out``). Each sample
  carries its per-token versions to the reward functions (``weight_versions``); a
  sample with a token older than ``max_staleness`` versions behind the trainer is
  dropped, counted, and drawn again from the newest weights.
- :class:`DcrWeightSync` is a ``TrainerCallback``: after each optimizer step it offers
  the trainer's live parameters (BF16, as an export would hold them) to an in-process
  :class:`~dcr.owner.rank.RankOwner` and has the coordinator refit the fleet to them. No
  checkpoint is written: the owner keeps the committed baseline's bits and the step's
  changed elements, and publishes those. With ``overlap`` the refit runs while the next
  batch is generated (one step off: tokens may come from the version before, which the
  staleness bound then governs); otherwise the next batch waits for the commit. A
  trainer of several ranks (FSDP2, or data parallel) uses :meth:`DcrWeightSync.for_ranks`:
  each rank offers its own shards and serves them, rank 0 drives the refit
  (:mod:`dcr.integrations.ranks`).

docs/trainer.md, "With TRL".
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from transformers import TrainerCallback

from dcr.client import token_versions
from dcr.errors import ConfigError, ExternalError
from dcr.http.gateway import MIN_VERSION
from dcr.integrations.ranks import FleetFor, RankGroup
from dcr.owner.layouts import replicated_shards
from dcr.owner.rank import RankOwner
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.records import CommitRecord
from dcr.settings import option

if TYPE_CHECKING:
    import torch

    from dcr.transport.store import Store

log = logging.getLogger(__name__)
RETRY_S = 0.2  # between tries of a completion answered 503 (engine busy or paused)


class RolloutError(ExternalError):
    """The fleet did not answer a completion, or answered one without what a sample needs."""


@dataclass(frozen=True, kw_only=True)
class Api:
    """One inference route a sample can come from: where, what to send, where the
    behaviour logprobs are in its answer's choice."""

    path: str
    body: Callable[[list[int], int, int, float], dict[str, Any]]  # prompt, tokens, seed, T
    logprobs: Callable[[dict[str, Any]], list[Any]]


APIS: dict[str, Api] = {
    "completions": Api(
        path="/v1/completions",
        body=lambda prompt, n, seed, t: {
            "prompt": prompt, "max_tokens": n, "temperature": t, "seed": seed,
            "logprobs": 0, "return_weight_versions": True},
        logprobs=lambda choice: list(choice["logprobs"]["token_logprobs"])),
    "generate": Api(
        path="/inference/v1/generate",
        body=lambda prompt, n, seed, t: {
            "token_ids": prompt, "sampling_params": {
                "max_tokens": n, "temperature": t, "seed": seed, "logprobs": 0}},
        logprobs=lambda choice: [c["logprob"] for c in choice["logprobs"]["content"]]),
}


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """How :class:`FleetRollout` asks the fleet for completions."""

    max_tokens: int = option(16, metavar="N", doc="tokens per completion")
    temperature: float = option(1.0, doc="sampling temperature (> 0: GRPO needs distinct "
                                "completions of one prompt)")
    max_staleness: int | None = option(None, metavar="K", doc="drop a sample holding a "
                                       "token more than K versions behind the trainer and "
                                       "draw it again (None: keep every sample)")
    concurrency: int = option(16, metavar="N", doc="completions in flight at once, over "
                              "every door")
    timeout_s: float = option(300.0, doc="seconds one completion may take")
    redraws: int = option(3, metavar="N", doc="times a dropped sample is drawn again "
                          "before the rollout fails")
    seed: int = option(0, doc="seed of the per-completion sampler seeds")
    api: Literal["completions", "generate"] = option(
        "completions", doc="completions: POST /v1/completions (dcr serve, vLLM 0.33 and "
        "later); generate: vLLM's token route POST /inference/v1/generate, which reports "
        "weight versions in earlier releases (the door must list it in --client-route)")
    model: str | None = option(None, doc="the served model name to ask for (None: the "
                               "engine's only one)")

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ConfigError(f"Rollout api {self.api!r} is not one of {sorted(APIS)}.")
        if self.max_tokens < 1 or self.concurrency < 1 or self.redraws < 0:
            raise ConfigError(f"Rollout max_tokens ({self.max_tokens}) and concurrency "
                              f"({self.concurrency}) must be >= 1, redraws ({self.redraws}) "
                              ">= 0.")
        if self.temperature <= 0 or self.timeout_s <= 0:
            raise ConfigError(f"Rollout temperature ({self.temperature}) and timeout_s "
                              f"({self.timeout_s}) must be positive.")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"Rollout max_staleness {self.max_staleness} is negative.")


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One completion as the trainer takes it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # of each completion token, under the distribution it was drawn from
    versions: list[int]  # the committed weight version that made each completion token


@dataclass(kw_only=True)
class RolloutStats:
    """One ``rollout_func`` call: what it cost and which weights made its samples."""

    seconds: float = 0.0
    tokens: int = 0
    versions: Counter[int] = field(default_factory=Counter)  # tokens per version
    dropped: int = 0  # samples over the staleness bound, drawn again


@dataclass(frozen=True, kw_only=True)
class RefitStep:
    """One optimizer step's refit: the version, what was offered, how long each part took."""

    version: int
    changed_elements: int
    offer_s: float
    refit_s: float
    record: CommitRecord | None  # None while an overlapped refit runs
    attempts: int


class DcrWeightSync(TrainerCallback):
    """After each optimizer step, the trainer's weights reach the fleet by DCR.

    ``owner`` holds the committed baseline of every parameter it owns; ``coordinator``
    drives the fleet's agents with that owner (one process, :meth:`for_model`), or
    ``group`` has rank 0 drive them with every rank's owner (:meth:`for_ranks`). Version
    ``base + k`` follows the k-th optimizer step."""

    def __init__(self, *, owner: RankOwner, coordinator: Coordinator | None = None,
                 group: RankGroup | None = None, overlap: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        if (coordinator is None) == (group is None):
            raise ConfigError("DcrWeightSync needs a coordinator (one process) or a rank "
                              "group (several), not both or neither.")
        if group is not None and overlap:
            raise ConfigError("DcrWeightSync over ranks refits before the next batch: "
                              "overlap=True is for one process.")
        self.owner, self.coordinator, self.group = owner, coordinator, group
        self.overlap = overlap
        self.base = owner.version
        self.version = owner.version  # the trainer's: the newest offered
        self._committed = owner.version  # what the last refit committed, over ranks
        self.dtype = dtype
        self.steps: list[RefitStep] = []
        self._running: threading.Thread | None = None
        self._error: BaseException | None = None

    @staticmethod
    def tensors(model: torch.nn.Module, dtype: torch.dtype | None
                ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The shard maps and tensors of ``model`` as one owner holds them, cast to
        ``dtype`` (what an export would hold)."""
        return replicated_shards(model, rank=0, ranks=1, dtype=dtype)

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, coordinator_for: Any, store: Any,
                  version: int = 0, overlap: bool = False,
                  dtype: torch.dtype | None = None) -> DcrWeightSync:
        """An owner over ``model``'s parameters at ``version`` writing to ``store``, and
        the coordinator ``coordinator_for(owner)`` builds for it."""
        maps, tensors = cls.tensors(model, dtype)
        owner = RankOwner(store=store, maps=maps, tensors=tensors, version=version)
        return cls(owner=owner, coordinator=coordinator_for(owner), overlap=overlap,
                   dtype=dtype)

    @classmethod
    def for_ranks(cls, model: torch.nn.Module, *, store: str | Store, token: str,
                  fleet_for: FleetFor, version: int = 0, dtype: torch.dtype | None = None,
                  copies: tuple[str, ...] | None = None,
                  listen: str = "127.0.0.1:0") -> DcrWeightSync:
        """Collective, on every rank of the trainer's default group: this rank's owner
        over its shards of ``model`` (FSDP2's, or rows of a whole one), served on
        ``listen`` with ``token`` for rank 0's ``fleet_for(rank urls)``, a
        :class:`~dcr.coordinate.LocalFleet` (:meth:`RankGroup.join`). :meth:`close`
        stops the endpoint once training is over."""
        group = RankGroup.join(model, store=store, token=token, fleet_for=fleet_for,
                               version=version, dtype=dtype, copies=copies, listen=listen)
        return cls(owner=group.owner, group=group, dtype=dtype)

    def close(self) -> None:
        """Stop this rank's endpoint (a rank group's; nothing for one process)."""
        if self.group is not None:
            self.group.close()

    @property
    def committed(self) -> int:
        """The fleet's committed version, as this process knows it."""
        return self.owner.version if self.group is None else self._committed

    @property
    def history_digest(self) -> str | None:
        """The history the last committed refit's record vouches for (None before one)."""
        record = self.steps[-1].record if self.steps else None
        return (record.history_digest or None) if record is not None else None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    **_: Any) -> None:
        if model is None:
            raise ConfigError("DcrWeightSync: the trainer passed no model to on_step_end.")
        self.wait()
        version = self.base + int(state.global_step)
        t0 = time.perf_counter()
        overlay = self.owner.offer(self._shards(model), version)
        offer_s = time.perf_counter() - t0
        self.version = version
        if not self.overlap:
            self._refit(version, overlay.elements, offer_s)
            return
        self._running = threading.Thread(target=self._refit_catching, name="dcr-refit",
                                         args=(version, overlay.elements, offer_s),
                                         daemon=True)
        self._running.start()

    def _shards(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if self.group is not None:
            return self.group.shards(model)
        return self.tensors(model, self.dtype)[1]

    def _refit_catching(self, version: int, changed: int, offer_s: float) -> None:
        try:
            self._refit(version, changed, offer_s)
        except BaseException as e:  # raised again by wait(), in the trainer's thread
            self._error = e

    def _refit(self, version: int, changed: int, offer_s: float) -> None:
        t0 = time.perf_counter()
        record, attempts = self._commit(version)
        self._committed = record.committed_version
        self.steps.append(RefitStep(
            version=version, changed_elements=changed, offer_s=offer_s,
            refit_s=time.perf_counter() - t0, record=record, attempts=attempts))
        log.info("Refit to version %d committed (attempt %s).", version, record.attempt)

    def _commit(self, version: int) -> tuple[CommitRecord, int]:
        """Commit ``version`` on the fleet: its record and the attempts it took."""
        if self.group is not None:
            return self.group.refit(version)
        assert self.coordinator is not None
        first = len(self.coordinator.history)
        record = self.coordinator.refit(version, f"trainer:v{version}")
        return record, len(self.coordinator.history) - first

    def wait(self) -> None:
        """Until the refit in flight (if any) has committed; its failure raises here."""
        if self._running is not None:
            self._running.join()
            self._running = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.wait()


class FleetRollout:
    """GRPOTrainer's ``rollout_func``: completions from the fleet's client doors.

    ``doors`` are the pods' client-door URLs, used in turn; ``sync`` says the trainer's
    version (for the staleness bound) and is waited on before a sample is drawn again.
    TRL hands each prompt as many times as it wants completions of it; one completion is
    drawn per entry, each with its own seed.
    """

    def __init__(self, doors: Sequence[str], *, sync: DcrWeightSync | None,
                 settings: RolloutSettings | None = None, api_key: str | None = None) -> None:
        if not doors:
            raise ConfigError("FleetRollout: no client door URL given.")
        self.doors = list(doors)
        self.sync = sync
        self.settings = settings or RolloutSettings()
        self.api_key = api_key
        self.calls: list[RolloutStats] = []
        self._seeds = random.Random(self.settings.seed)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        ids = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        samples, stats = self.generate(ids)
        self.calls.append(stats)
        return {"prompt_ids": [s.prompt_ids for s in samples],
                "completion_ids": [s.completion_ids for s in samples],
                "logprobs": [s.logprobs for s in samples],
                "weight_versions": [s.versions for s in samples]}

    def generate(self, prompts: list[list[int]]) -> tuple[list[Sample], RolloutStats]:
        """One completion per prompt, none staler than the bound; and what it cost."""
        stats = RolloutStats()
        t0 = time.perf_counter()
        seeds = [self._seeds.randrange(1 << 62) for _ in prompts]
        todo = list(range(len(prompts)))
        out: list[Sample | None] = [None] * len(prompts)
        for round_ in range(self.settings.redraws + 1):
            if round_ and self.sync is not None:
                self.sync.wait()  # draw again from the newest weights
            floor = self._floor()
            with ThreadPoolExecutor(self.settings.concurrency,
                                    thread_name_prefix="rollout") as pool:
                got = list(pool.map(self._complete, todo, [prompts[i] for i in todo],
                                    [seeds[i] + round_ for i in todo], [floor] * len(todo)))
            stale = []
            for i, sample in zip(todo, got, strict=True):
                if floor is not None and (sample is None or min(sample.versions) < floor):
                    stale.append(i)
                    continue
                out[i] = sample
            stats.dropped += len(stale)
            todo = stale
            if not todo:
                break
        if todo:
            raise RolloutError(f"{len(todo)} samples stayed more than "
                               f"{self.settings.max_staleness} versions behind the trainer "
                               f"(version {self._trainer_version()}) after "
                               f"{self.settings.redraws} redraws.")
        done = [s for s in out if s is not None]
        for s in done:
            stats.tokens += len(s.completion_ids)
            stats.versions.update(s.versions)
        stats.seconds = time.perf_counter() - t0
        return done, stats

    def _trainer_version(self) -> int | None:
        return None if self.sync is None else self.sync.version

    def _floor(self) -> int | None:
        """The oldest version a sample's tokens may come from (None: any)."""
        v, k = self._trainer_version(), self.settings.max_staleness
        return None if v is None or k is None else v - k

    def _complete(self, i: int, prompt: list[int], seed: int,
                  floor: int | None) -> Sample | None:
        """Prompt ``i``'s completion from door ``i mod n``; None when the door says the
        engine's weights are older than ``floor`` (409)."""
        s = self.settings
        api = APIS[s.api]
        body = api.body(prompt, s.max_tokens, seed, s.temperature)
        if s.model is not None:
            body["model"] = s.model
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if floor is not None:
            headers[MIN_VERSION] = str(max(floor, 0))
        url = self.doors[i % len(self.doors)] + api.path
        req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        deadline = time.monotonic() + s.timeout_s
        while True:
            try:
                with urllib.request.urlopen(req, timeout=s.timeout_s) as r:
                    return _sample(i, prompt, json.loads(r.read()), api)
            except urllib.error.HTTPError as e:
                if e.code == 409 and floor is not None:
                    return None  # the engine's weights are older than the bound
                if e.code != 503 or time.monotonic() > deadline:  # 503: busy, or paused
                    raise RolloutError(f"Completion {i} at {url}: HTTP {e.code}: "
                                       f"{e.read()[:300]!r}") from e
            except (OSError, ValueError) as e:
                raise RolloutError(f"Completion {i} at {url}: {e}") from e
            time.sleep(RETRY_S)


def _sample(i: int, prompt: list[int], answer: dict[str, Any], api: Api) -> Sample:
    """The sample in an answer of ``api``, or :class:`RolloutError` naming what it
    lacks."""
    try:
        choice = answer["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in api.logprobs(choice)]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise RolloutError(f"Completion {i}: the answer lacks token_ids or logprobs "
                           f"({type(e).__name__}: {e}); the engine must return token ids "
                           "and logprobs: 0.") from e
    labels = token_versions(answer)
    try:
        versions = [int(v) for v in labels]
    except ValueError:
        raise RolloutError(f"Completion {i}: weight version labels {sorted(set(labels))} "
                           "are not committed version numbers (DCR labels the weights "
                           "with the committed version).") from None
    if not len(ids) == len(logprobs) == len(versions):
        raise RolloutError(f"Completion {i}: {len(ids)} tokens, {len(logprobs)} logprobs, "
                           f"{len(versions)} versions.")
    return Sample(prompt_ids=prompt, completion_ids=ids, logprobs=logprobs,
                  versions=versions)


__all__ = ["APIS", "Api", "DcrWeightSync", "FleetRollout", "RefitStep", "RolloutError",
           "RolloutSettings", "RolloutStats", "Sample"]
