"""One rank of a serving engine as DCR's plugin holds it, engine-neutral.

:class:`EngineRank` answers the calls of :class:`~dcr.protocol.engine_api.EngineApi` on one
rank: its loader, the applier prewarm made, and each answer built from the table's model.
vLLM's worker extension (:mod:`dcr.runtimes.vllm`), SGLang's custom weight loader
(:mod:`dcr.runtimes.sglang`) and ``dcr serve``'s workers carry it. The helpers below read
what the agent names only inside the directories the engine process was given: staged
payloads by plain file name, checkpoints by a path under its checkpoint root.
docs/engines.md, "The plugin".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import stat
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from dcr.apply.applier import Applier, Loader
from dcr.apply.intercept import LoaderPathError, storage_key
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.drivers.base import check_checkpoint_path, check_staged_name
from dcr.errors import CheckpointError, ConfigError
from dcr.format.dtypes import DTYPES
from dcr.format.payload import NAME_RE
from dcr.format.regions import region_key, whole
from dcr.protocol.engine_api import (
    MAX_UNFILLED,
    ApplyAnswer,
    ApplyRequest,
    CheckAnswer,
    CheckTargetsRequest,
    DenseAnswer,
    DenseLoadRequest,
    FingerprintAnswer,
    InstanceAnswer,
    PluginCall,
    PrewarmRequest,
    ProfileAnswer,
    RankAnswer,
)
from dcr.runtimes.derived import DerivedLayer, DerivedLayers
from dcr.runtimes.weights import DenseRefused, Tensors, checkpoint_tensors, runtime_fingerprint

log = logging.getLogger(__name__)
INSTANCE = secrets.token_hex(16)  # this process's identity; a restart draws a new one
STAGING_ENV = "DCR_STAGING_DIR"
CHECKPOINT_ROOT_ENV = "DCR_CHECKPOINT_ROOT"


def canonical_tensors(req: PrewarmRequest) -> list[CanonicalTensor]:
    out = []
    for name, dtype, shape in req.tensors:
        if not NAME_RE.fullmatch(name):
            raise ConfigError(f"Tensor name {name[:80]!r} is empty, too long or has control "
                              "characters.")
        if dtype not in DTYPES:
            raise ConfigError(f"Tensor {name!r}: dtype {dtype!r} is not one of "
                              f"{sorted(DTYPES)}.")
        if any(d < 0 for d in shape):
            raise ConfigError(f"Tensor {name!r}: shape {shape} has a negative dimension.")
        out.append(CanonicalTensor(name=name, dtype=dtype, shape=tuple(shape)))
    return out


def engine_dir(env: str, given: Path | None = None) -> Path:
    """A directory the engine process was configured with (``given`` by its builder, else
    ``$env``), never one a caller names."""
    if given is not None:
        return given.resolve()
    value = os.environ.get(env)
    if not value:
        raise ConfigError(f"The engine process has no {env}; start it with {env} set to "
                          "the directory it shares with the DCR agent.")
    return Path(value).resolve()


def read_staged(staging: Path, name: str) -> bytes:
    """The bytes of one staged payload: a plain file name, opened without following a
    final symlink, and a regular file."""
    check_staged_name(name)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(staging / name, flags)
    except OSError as e:
        raise ConfigError(f"Staged payload {name!r} cannot be opened in {staging}: "
                          f"{e.strerror}.") from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ConfigError(f"Staged payload {name!r} in {staging} is not a regular file.")
        return f.read()


def confined_checkpoint(root: Path, relative: str) -> Path:
    """``root / relative``, for a relative path with no empty, ``.`` or ``..`` segment
    that resolves inside ``root``."""
    path = (root / check_checkpoint_path(relative)).resolve()
    if not path.is_relative_to(root):
        raise ConfigError(f"Checkpoint {relative!r} resolves outside {root}.")
    return path


def uncovered(applier: Applier, keys: AbstractSet[str]) -> list[str]:
    """The ``xor`` tensors this rank holds some canonical element of whose bits no key in
    ``keys`` checks: neither the whole tensor's fingerprint (or whole region sum) for one
    it reads back, nor its region's sum for a shard."""
    out = []
    for name, plan in sorted(applier.plans.items()):
        if plan.cls != "xor" or all(w.src is None for w in plan.writes):
            continue  # overwrite and dense paths hold no canonical bits to compare
        t = applier.tensors[name]
        if name in applier.readable:
            checks = {name, region_key(name, whole(t.shape))}
        else:
            checks = {region_key(name, applier.regions[name])} if name in applier.regions \
                else set()
        if not checks & keys:
            out.append(name)
    return out


# Why a path's bits cannot be compared at flush: storage holds no canonical bits to
# recompute a manifest's fingerprint from (docs/protocol.md, "What is checked before and
# after apply").
UNCHECKABLE = {
    "overwrite": "converted on their way to storage (a cast, FP8 storage)",
    "dense": "quantized as a whole on their way to storage",
    "xor": "shards written in more pieces than a region names (MAX_SPANS)",
}


def uncheckable(applier: Applier) -> dict[str, list[str]]:
    """The tensors this rank holds that no fingerprint can check at flush, by path: what
    prewarm decided, the same for every attempt until the next prewarm."""
    out: dict[str, list[str]] = {}
    for name, plan in sorted(applier.plans.items()):
        if all(w.src is None for w in plan.writes) and plan.cls == "xor":
            continue  # only constant fills: no canonical element reaches storage
        held = name in applier.readable or name in applier.regions
        if plan.cls in UNCHECKABLE and not (plan.cls == "xor" and held):
            out.setdefault(plan.cls, []).append(name)
    return out


class EngineRank:
    """One rank of a serving engine: its runtime, the applier prewarm made, and one
    method per row of :class:`~dcr.protocol.engine_api.EngineApi`, named as the row.

    Any engine whose workers hold a :class:`~dcr.apply.applier.Loader` can carry it.
    ``instance``, ``staging_dir`` and ``checkpoint_root`` default to the process's (its
    random id, ``$DCR_STAGING_DIR``, ``$DCR_CHECKPOINT_ROOT``); an engine that holds
    several in one process, each standing for a server of its own
    (:class:`dcr.serve.local.LocalDriver`), gives them.
    """

    def __init__(self, runtime: Loader, *, rank: int, world: int, device: torch.device,
                 instance: str = INSTANCE, staging_dir: Path | None = None,
                 checkpoint_root: Path | None = None,
                 derived: DerivedLayers | None = None) -> None:
        self.runtime = runtime
        self.derived = derived if derived is not None else DerivedLayers(None)
        self._derived_of: dict[str, list[DerivedLayer]] = {}  # canonical -> layers it writes
        self.rank = rank
        self.world = world
        self.device = device
        self.instance_id = instance
        self.staging_dir = staging_dir
        self.checkpoint_root = checkpoint_root
        self.applier: Applier | None = None  # made by prewarm
        self.canonical: list[CanonicalTensor] = []
        self._storages: dict[str, tuple[str, int]] = {}

    def serve(self, call: PluginCall[Any, Any], request: BaseModel | None = None
              ) -> dict[str, Any]:
        """This rank's answer to ``call`` (its request parsed, if it takes one), as it
        crosses the wire: the fields the rank set, JSON-ready."""
        run = getattr(self, call.name)
        answer: RankAnswer = run() if request is None else run(request)
        return answer.model_dump(mode="json", exclude_unset=True)

    def instance(self) -> InstanceAnswer:
        return InstanceAnswer(instance=self.instance_id, rank=self.rank, world=self.world)

    def prewarm(self, req: PrewarmRequest) -> ProfileAnswer:
        """Classify every canonical tensor; refuse a layer DCR would write but cannot
        rebuild. The answer names the derived layers whose loading form DCR does not
        hold yet (``unfilled``): until a dense load through DCR, this rank can only be
        refit densely."""
        canonical = canonical_tensors(req)
        applier = Applier(self.runtime, device=self.device)
        profile = applier.prewarm(canonical)
        writes = {n: {w.storage for w in plan.writes} for n, plan in applier.plans.items()}
        self.derived.refuse({t.rpartition(".")[0] for ts in writes.values() for t in ts},
                            self.rank)
        self._derived_of = {n: layers for n, ts in writes.items()
                            if (layers := self.derived.of_tensors(ts))}
        self.applier, self.canonical = applier, canonical
        self._storages = {n: storage_key(t) for n, t in self.runtime.named_tensors()}
        for d in self.derived.layers:
            log.info("Rank %s: layer %s is derived (%s): %s", self.rank, d.name, d.kind, d.why)
        for cls, names in uncheckable(applier).items():
            log.warning("Rank %s: %d tensors are %s (%s path), e.g. %s: no fingerprint "
                        "can check their bits at flush", self.rank, len(names),
                        UNCHECKABLE[cls], cls, names[:3])
        return ProfileAnswer(rank=self.rank, profile=dict(profile.tensors),
                             regions=profile.model_dump(mode="json").get("regions", {}),
                             derived=len(self.derived.layers),
                             kept_bytes=self.derived.kept_bytes(),
                             unfilled=[d.name for d in self.derived.unfilled][:MAX_UNFILLED])

    def apply(self, req: ApplyRequest) -> ApplyAnswer:
        applier = self._prewarmed("apply")
        self._check_storages()
        self.derived.check_filled("apply", self.rank)
        staging = engine_dir(STAGING_ENV, self.staging_dir)
        payloads = [read_staged(staging, name) for name in req.payloads]
        try:
            report = applier.apply_payloads(payloads)
        except BaseException:
            # Writes may have begun: what the engine computes with follows what DCR
            # holds, whatever the agent decides next.
            self.derived.rebuild(self.derived.layers)
            raise
        rebuilt = {d for n in report.names for d in self._derived_of.get(n, ())}
        self.derived.rebuild(rebuilt)
        self.sync()
        fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
        return ApplyAnswer(**fields | {"classes": dict(report.classes),
                                       "names": sorted(report.names)},
                           rank=self.rank, expand=applier.expand, rebuilt=len(rebuilt),
                           rebuild_s=self.derived.take_seconds())

    def fingerprint(self) -> FingerprintAnswer:
        self.derived.check_filled("fingerprint", self.rank)
        self.sync()
        return FingerprintAnswer(rank=self.rank, tensors=runtime_fingerprint(self.runtime))

    def check_targets(self, req: CheckTargetsRequest) -> CheckAnswer:
        """The tensors and regions among ``expect`` that this rank holds on a
        bit-preserving path (prewarm's readable set and regions) and whose bits differ from
        their fingerprint. The agent sends every fingerprint its manifest carries, so this
        is the rank's whole state, touched or not; an ``xor`` tensor the rank holds that no
        fingerprint covers is logged (docs/protocol.md, "What is checked before and after
        apply")."""
        applier = self._prewarmed("check_targets")
        self.derived.check_filled("check_targets", self.rank)
        self.sync()
        unchecked = uncovered(applier, req.expect.keys())
        if unchecked:
            log.warning("Rank %s: %d tensors it holds have no fingerprint it can recompute "
                        "among the %d expected, e.g. %s (a shard needs its region's sum: "
                        "give the owners the receivers' profile)", self.rank, len(unchecked),
                        len(req.expect), unchecked[:3])
        return CheckAnswer(rank=self.rank, differ=applier.check_targets(req.expect))

    def load_dense(self, req: DenseLoadRequest) -> DenseAnswer:
        """Read and check the whole checkpoint, then load it through the runtime's own
        loader (unless ``check_only``); a refused checkpoint leaves the weights as they
        were."""
        root = engine_dir(CHECKPOINT_ROOT_ENV, self.checkpoint_root)
        path = confined_checkpoint(root, req.checkpoint)
        try:
            tensors = self._read_dense(req, root, path)
        except DenseRefused:
            raise
        except CheckpointError as e:  # its sentence may quote the file: only the log has it
            log.warning("Rank %s: dense load of %s refused: %s", self.rank, path, e)
            raise DenseRefused(f"Checkpoint {req.checkpoint!r} is not a readable safetensors "
                               "checkpoint (the engine's log says why).") from e
        if req.check_only:
            return DenseAnswer(rank=self.rank)
        try:
            self.runtime.load_weights(tensors.items())
        except BaseException:  # layers DCR holds follow what was loaded, even part of it
            self.derived.rebuild(d for d in self.derived.layers if d.filled)
            raise
        self.derived.fill()
        self.sync()
        return DenseAnswer(rank=self.rank, rebuild_s=self.derived.take_seconds())

    def _read_dense(self, req: DenseLoadRequest, root: Path, path: Path) -> Tensors:
        """The checkpoint's tensors, checked: every file under ``root``, this rank's
        canonical tensors (once prewarmed), the expected fingerprints."""
        with Checkpoint(path) as ckpt:
            outside = [f for f in ckpt.files if not f.resolve().is_relative_to(root)]
            if outside:
                raise DenseRefused(f"Checkpoint {req.checkpoint!r}: {len(outside)} of its "
                                   f"files lie outside {root}.")
            if self.canonical:
                want = {(t.name, t.dtype, t.shape) for t in self.canonical}
                got = {(i.name, i.dtype.name, tuple(i.shape)) for i in ckpt}
                if want != got:
                    raise DenseRefused(
                        f"Checkpoint {req.checkpoint!r} does not hold this rank's canonical "
                        f"tensors: missing {sorted(w[0] for w in want - got)[:3]} and "
                        f"{len(got - want)} unexpected.")
            return checkpoint_tensors(ckpt, req.expect)

    def sync(self) -> RankAnswer:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return RankAnswer(rank=self.rank)

    def _prewarmed(self, call: str) -> Applier:
        if self.applier is None:
            raise ConfigError(f"dcr_{call} before dcr_prewarm on rank {self.rank}: the "
                              "engine has no receiver profile yet.")
        return self.applier

    def _check_storages(self) -> None:
        now = {n: storage_key(t) for n, t in self.runtime.named_tensors()}
        moved = sorted(n for n in now.keys() | self._storages.keys()
                       if now.get(n) != self._storages.get(n))
        if moved:
            self.applier = None
            raise LoaderPathError(
                f"Rank {self.rank}: the storage of {moved[:3]} ({len(moved)} tensors) changed "
                "since prewarm (the weights were reallocated); prewarm again, then refit "
                "densely.")


__all__ = ["CHECKPOINT_ROOT_ENV", "INSTANCE", "STAGING_ENV", "EngineRank", "canonical_tensors",
           "confined_checkpoint", "engine_dir", "read_staged", "uncheckable", "uncovered"]
