"""Running the applier inside vLLM's worker processes.

:class:`VllmRuntime` adapts any module with vLLM's ``load_weights`` to the
:class:`~dcr.runtimes.base.Runtime` protocol; :class:`EngineRank` is the engine-neutral code
of one rank; :class:`DcrWorkerExtension` carries it into every vLLM worker, reached through
``POST /collective_rpc`` (``dcr_*`` methods: one JSON string in, a dict with the rank out).
Nothing here imports vLLM at module level. The contract and its choices: docs/engines.md.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from dcr.apply.applier import Applier, Loader
from dcr.apply.intercept import LoaderPathError, storage_key
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.drivers.base import check_checkpoint_path, check_staged_name
from dcr.errors import CheckpointError, ConfigError, first_validation_error
from dcr.format.dtypes import DTYPES
from dcr.format.payload import NAME_RE
from dcr.runtimes.base import RequestGate
from dcr.runtimes.derived import DerivedLayer, DerivedLayers
from dcr.runtimes.weights import DenseRefused, Tensors, checkpoint_tensors, runtime_fingerprint

log = logging.getLogger(__name__)
INSTANCE = secrets.token_hex(16)  # this process's identity; a restart draws a new one
STAGING_ENV = "DCR_STAGING_DIR"
CHECKPOINT_ROOT_ENV = "DCR_CHECKPOINT_ROOT"
MAX_PAYLOADS = 1 << 16  # files per apply call
MAX_TENSORS = 1 << 20  # canonical tensors per prewarm
MAX_UNFILLED = 64  # layers a prewarm answer names


class VllmStyleModel(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class VllmRuntime:
    """A module whose ``load_weights`` follows vLLM's contract (returns loaded names).

    Layers whose compute form vLLM derived after loading are seen through
    :class:`~dcr.runtimes.derived.DerivedLayers`: their kept loading form stands in the
    layer while DCR loads, and in place of what the engine left there in
    :meth:`named_tensors`.
    """

    def __init__(self, model: VllmStyleModel) -> None:
        self.model = model
        self.gate = RequestGate()
        self.derived = DerivedLayers(model)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        with self.derived.loading():
            return set(self.model.load_weights(weights))

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.derived.named_tensors(
            itertools.chain(self.model.named_parameters(), self.model.named_buffers()))

    def close_gate(self) -> None:
        self.gate.close()

    def open_gate(self) -> None:
        self.gate.open()


# --- requests, as they arrive over /collective_rpc ----------------------------------------

class _Request(BaseModel):
    # Strict scalars; arrays may stand for tuples (JSON has no tuples).
    model_config = ConfigDict(frozen=True, extra="forbid")


class PrewarmRequest(_Request):
    tensors: list[tuple[StrictStr, StrictStr, list[StrictInt]]] = Field(max_length=MAX_TENSORS)


class ApplyRequest(_Request):
    payloads: list[StrictStr] = Field(min_length=1, max_length=MAX_PAYLOADS)


class DenseLoadRequest(_Request):
    checkpoint: StrictStr = Field(min_length=1, max_length=4096)
    expect: dict[StrictStr, StrictStr] | None = None
    check_only: StrictBool = False  # run every check, write nothing


class CheckTargetsRequest(_Request):
    expect: dict[StrictStr, StrictStr] = Field(max_length=MAX_TENSORS)


R = TypeVar("R", bound=_Request)


def parse_request(model: type[R], request: str | bytes | Mapping[str, Any]) -> R:
    """A request from its JSON text (``/collective_rpc``) or a dict (a Python caller);
    :class:`~dcr.errors.ConfigError` names the field that is wrong."""
    try:
        if isinstance(request, str | bytes):
            return model.model_validate_json(request)
        return model.model_validate(dict(request))
    except ValidationError as e:
        raise ConfigError(f"{model.__name__}: {first_validation_error(e, 'request')}") from e


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


# --- one rank, as the agent drives it -------------------------------------------------------

class EngineRank:
    """One rank of a serving engine: its runtime, the applier prewarm made, and the
    calls of the plugin contract as plain methods returning JSON-ready dicts.

    Engine-neutral: vLLM's worker extension wraps it, and any engine whose workers hold
    a :class:`~dcr.apply.applier.Loader` can. ``instance``, ``staging_dir`` and
    ``checkpoint_root`` default to the process's (its random id, ``$DCR_STAGING_DIR``,
    ``$DCR_CHECKPOINT_ROOT``); an engine that holds several in one process, each
    standing for a server of its own (:class:`dcr.serve.local.LocalDriver`), gives them.
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
        self.engine: Applier | None = None
        self.canonical: list[CanonicalTensor] = []
        self._storages: dict[str, tuple[str, int]] = {}

    def instance(self) -> dict[str, Any]:
        return {"instance": self.instance_id, "rank": self.rank, "world": self.world}

    def prewarm(self, req: PrewarmRequest) -> dict[str, Any]:
        """Classify every canonical tensor; refuse a layer DCR would write but cannot
        rebuild. The answer names the derived layers whose loading form DCR does not
        hold yet (``unfilled``): until a dense load through DCR, this rank can only be
        refit densely."""
        canonical = canonical_tensors(req)
        engine = Applier(self.runtime, device=self.device)
        profile = engine.prewarm(canonical)
        writes = {n: {w.storage for w in plan.writes} for n, plan in engine.plans.items()}
        self.derived.refuse({t.rpartition(".")[0] for ts in writes.values() for t in ts},
                            self.rank)
        self._derived_of = {n: layers for n, ts in writes.items()
                            if (layers := self.derived.of_tensors(ts))}
        self.engine, self.canonical = engine, canonical
        self._storages = {n: storage_key(t) for n, t in self.runtime.named_tensors()}
        for d in self.derived.layers:
            log.info("Rank %s: layer %s is derived (%s): %s", self.rank, d.name, d.kind, d.why)
        return {"rank": self.rank, "profile": dict(profile.tensors),
                "regions": profile.model_dump(mode="json").get("regions", {}),
                "derived": len(self.derived.layers), "kept_bytes": self.derived.kept_bytes(),
                "unfilled": [d.name for d in self.derived.unfilled][:MAX_UNFILLED]}

    def apply(self, req: ApplyRequest) -> dict[str, Any]:
        engine = self._prewarmed("apply")
        self._check_storages()
        self.derived.check_filled("apply", self.rank)
        staging = engine_dir(STAGING_ENV, self.staging_dir)
        payloads = [read_staged(staging, name) for name in req.payloads]
        try:
            report = engine.apply_payloads(payloads)
        except BaseException:
            # Writes may have begun: what the engine computes with follows what DCR
            # holds, whatever the agent decides next.
            self.derived.rebuild(self.derived.layers)
            raise
        rebuilt = {d for n in report.names for d in self._derived_of.get(n, ())}
        self.derived.rebuild(rebuilt)
        self.sync()
        return {"rank": self.rank, "tensors": report.tensors, "records": report.records,
                "writes": report.writes, "loads": report.loads, "deferred": report.deferred,
                "decode_s": report.decode_s, "scatter_s": report.scatter_s,
                "loader_s": report.loader_s, "intercept_s": report.intercept_s,
                "expand": engine.expand, "upload_s": report.upload_s,
                "upload_bytes": report.upload_bytes, "expand_s": report.expand_s,
                "rebuilt": len(rebuilt), "rebuild_s": self.derived.take_seconds(),
                "classes": dict(report.classes), "names": sorted(report.names)}

    def fingerprint(self) -> dict[str, Any]:
        self.derived.check_filled("fingerprint", self.rank)
        self.sync()
        return {"rank": self.rank, "tensors": runtime_fingerprint(self.runtime)}

    def check_targets(self, req: CheckTargetsRequest) -> dict[str, Any]:
        """The tensors among ``expect`` that this rank holds whole on a bit-preserving
        path (prewarm's readable set) and whose bits differ from their fingerprint."""
        engine = self._prewarmed("check_targets")
        self.derived.check_filled("check_targets", self.rank)
        self.sync()
        return {"rank": self.rank, "differ": engine.check_targets(req.expect)}

    def load_dense(self, req: DenseLoadRequest) -> dict[str, Any]:
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
            return {"rank": self.rank}
        try:
            self.runtime.load_weights(tensors.items())
        except BaseException:  # layers DCR holds follow what was loaded, even part of it
            self.derived.rebuild(d for d in self.derived.layers if d.filled)
            raise
        self.derived.fill()
        self.sync()
        return {"rank": self.rank, "rebuild_s": self.derived.take_seconds()}

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

    def sync(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"rank": self.rank}

    def _prewarmed(self, call: str) -> Applier:
        if self.engine is None:
            raise ConfigError(f"dcr_{call} before dcr_prewarm on rank {self.rank}: the "
                              "engine has no receiver profile yet.")
        return self.engine

    def _check_storages(self) -> None:
        now = {n: storage_key(t) for n, t in self.runtime.named_tensors()}
        moved = sorted(n for n in now.keys() | self._storages.keys()
                       if now.get(n) != self._storages.get(n))
        if moved:
            self.engine = None
            raise LoaderPathError(
                f"Rank {self.rank}: the storage of {moved[:3]} ({len(moved)} tensors) changed "
                "since prewarm (the weights were reallocated); prewarm again, then refit "
                "densely.")


# --- the vLLM worker extension --------------------------------------------------------------

class DcrWorkerExtension:
    """Mixed into vLLM's worker class; its ``dcr_*`` methods are reached through
    ``collective_rpc`` (``POST /collective_rpc`` on a dev-mode server).

    vLLM refuses an extension attribute that the worker class already has, so every
    name here starts with ``dcr_`` or ``_dcr_``.
    """

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    _dcr_state: tuple[object, EngineRank]  # the model it was made for, and the rank

    def dcr_instance(self) -> dict[str, Any]:
        return self._dcr_rank().instance()

    def dcr_prewarm(self, request: str | Mapping[str, Any]) -> dict[str, Any]:
        """Reserve scratch and classify every canonical tensor; this rank's profile."""
        req = parse_request(PrewarmRequest, request)
        with self._dcr_loading():
            return self._dcr_rank().prewarm(req)

    def dcr_apply(self, request: str | Mapping[str, Any]) -> dict[str, Any]:
        """Apply staged payloads in place, as one set; the apply report."""
        req = parse_request(ApplyRequest, request)
        with self._dcr_loading():
            return self._dcr_rank().apply(req)

    def dcr_fingerprint(self) -> dict[str, Any]:
        return self._dcr_rank().fingerprint()

    def dcr_load_dense(self, request: str | Mapping[str, Any]) -> dict[str, Any]:
        """A dense load of a checkpoint under ``DCR_CHECKPOINT_ROOT`` through the
        model's own ``load_weights``."""
        req = parse_request(DenseLoadRequest, request)
        with self._dcr_loading():
            return self._dcr_rank().load_dense(req)

    def dcr_check_targets(self, request: str | Mapping[str, Any]) -> dict[str, Any]:
        """The tensors among ``expect`` this rank can read back exactly whose bits differ
        from their fingerprint (the agent's check after an attempt's applies)."""
        req = parse_request(CheckTargetsRequest, request)
        with self._dcr_loading():
            return self._dcr_rank().check_targets(req)

    def dcr_sync(self) -> dict[str, Any]:
        return self._dcr_rank().sync()

    # --- the worker's side --------------------------------------------------------------

    def _dcr_model(self) -> Any:
        runner = self.model_runner
        get_model = getattr(runner, "get_model", None)
        return get_model() if callable(get_model) else runner.model

    def _dcr_loader(self, model: Any) -> Loader:
        """The runtime DCR loads through; a worker that hosts another kind of model
        overrides this."""
        return VllmRuntime(model)

    def _dcr_rank_options(self) -> dict[str, Any]:
        """:class:`EngineRank`'s ``instance``, ``staging_dir`` and ``checkpoint_root``
        where the worker gives its own (none: the process's)."""
        return {}

    def _dcr_rank(self) -> EngineRank:
        model = self._dcr_model()
        held: tuple[object, EngineRank] | None = getattr(self, "_dcr_state", None)
        if held is not None and held[0] is model:
            return held[1]
        # A new model object (a reload replaced it): a rank that must be prewarmed again.
        rank, world = _rank_and_world(self)
        loader = self._dcr_loader(model)
        state = EngineRank(loader, rank=rank, world=world,
                           device=next(model.parameters()).device,
                           derived=loader.derived if isinstance(loader, VllmRuntime) else None,
                           **self._dcr_rank_options())
        self._dcr_state = (model, state)
        return state

    @contextlib.contextmanager
    def _dcr_loading(self) -> Iterator[None]:
        """vLLM's config made current (as the worker does around its own weight loads),
        and no autograd."""
        config = getattr(self, "vllm_config", None)
        with contextlib.ExitStack() as stack:
            if config is not None:
                vllm_config = importlib.import_module("vllm.config")
                stack.enter_context(vllm_config.set_current_vllm_config(config))
            stack.enter_context(torch.no_grad())
            yield


def _rank_and_world(worker: object) -> tuple[int, int]:
    """This worker's rank and the number of workers: from the default process group
    vLLM set up (each worker is one rank of it), else from the worker's own ``rank`` and
    ``parallel_config.world_size`` (a server that holds every rank in one process, as
    ``dcr serve`` does), else rank 0 of 1."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = getattr(worker, "rank", 0)
    world = getattr(getattr(worker, "parallel_config", None), "world_size", 1)
    return ((rank if isinstance(rank, int) else 0),
            (world if isinstance(world, int) and world >= 1 else 1))
