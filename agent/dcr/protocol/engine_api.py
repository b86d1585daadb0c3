"""DCR's plugin inside a serving engine, declared once: one table of calls, requests, answers.

:class:`EngineApi` is the table: one :class:`PluginCall` row per ``dcr_*`` method the plugin
adds to every rank of an engine (vLLM's worker extension, SGLang's custom weight loader,
``dcr serve``'s workers). The agent's drivers build requests and check answers from it
(:mod:`dcr.drivers.plugin`); every rank parses requests and builds answers from it
(:mod:`dcr.runtimes.rank`); every list of the plugin's methods is :data:`METHODS`. A call
carries at most one argument, the request as a JSON string; every rank answers one JSON
object with its ``rank``. ``wait`` names the :class:`~dcr.drivers.plugin.EngineTimeouts`
field the agent waits by. A test keeps this list equal to :meth:`EngineApi.describe`::

    dcr_instance      -                   -> InstanceAnswer    call_s    process id, rank, world
    dcr_prewarm       PrewarmRequest      -> ProfileAnswer     prewarm_s classify canonical tensors
    dcr_apply         ApplyRequest        -> ApplyAnswer       apply_s   apply staged payloads
    dcr_fingerprint   -                   -> FingerprintAnswer call_s    xxh3-128 of every tensor
    dcr_load_dense    DenseLoadRequest    -> DenseAnswer       dense_s   load a checkpoint densely
    dcr_check_targets CheckTargetsRequest -> CheckAnswer       prewarm_s targets whose bits differ
    dcr_sync          -                   -> RankAnswer        call_s    every write has finished

Torch-free: the agent imports it. docs/engines.md, "The plugin".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, Literal, TypeVar, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from dcr.errors import ConfigError, first_validation_error
from dcr.format.profile import TensorClass

MAX_RANKS = 1 << 16  # ranks of one engine (a rank number and a world size are below it)
MAX_PAYLOADS = 1 << 16  # staged files per apply call
MAX_TENSORS = 1 << 20  # canonical tensors per prewarm, fingerprints per check
MAX_UNFILLED = 64  # derived layers a prewarm answer names
MAX_PATH = 4096  # characters of a checkpoint path
INSTANCE_ID = r"^[0-9a-f]{8,64}$"  # a rank's process id, in hex (a restart draws a new one)

Wait = Literal["call_s", "prewarm_s", "apply_s", "dense_s"]  # an EngineTimeouts field
RawRequest = str | bytes | Mapping[str, Any]  # JSON text over the wire, a dict in process

Q = TypeVar("Q", bound="Request")
A = TypeVar("A", bound="RankAnswer")


# --- requests: one JSON string argument ---------------------------------------------------

class Request(BaseModel):
    # Strict scalars; arrays may stand for tuples (JSON has no tuples).
    model_config = ConfigDict(frozen=True, extra="forbid")


class PrewarmRequest(Request):
    tensors: list[tuple[StrictStr, StrictStr, list[StrictInt]]] = Field(max_length=MAX_TENSORS)


class ApplyRequest(Request):
    payloads: list[StrictStr] = Field(min_length=1, max_length=MAX_PAYLOADS)


class DenseLoadRequest(Request):
    checkpoint: StrictStr = Field(min_length=1, max_length=MAX_PATH)
    expect: dict[StrictStr, StrictStr] | None = None
    check_only: StrictBool = False  # run every check, write nothing


class CheckTargetsRequest(Request):
    expect: dict[StrictStr, StrictStr] = Field(max_length=MAX_TENSORS)


# --- answers: one JSON object per rank ------------------------------------------------------

class RankAnswer(BaseModel):
    """What every rank's answer carries."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    rank: int = Field(ge=0, lt=MAX_RANKS)


class InstanceAnswer(RankAnswer):
    instance: str = Field(pattern=INSTANCE_ID)
    world: int = Field(ge=1, lt=MAX_RANKS)


class ProfileAnswer(RankAnswer):
    profile: dict[str, TensorClass]
    regions: dict[str, list[Any]] = {}  # checked as a ReceiverProfile's (lists, not tuples)
    derived: int = Field(default=0, ge=0)  # layers computing from a form derived after loading
    kept_bytes: int = Field(default=0, ge=0)  # the copies of their loading form DCR keeps
    # Of those, the layers whose loading form DCR holds no known bits of (no dense load
    # through DCR yet): until one, this rank can be refit only densely.
    unfilled: list[str] = Field(default=[], max_length=MAX_UNFILLED)


class ApplyAnswer(RankAnswer):
    """A rank's apply report: every field of :class:`~dcr.apply.applier.ApplyReport` (the
    canonical tensors written, counts, ``*_s`` seconds), where records were expanded and
    the derived layers rebuilt; a field this table does not know is kept as sent."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    tensors: int = 0
    records: int = 0
    writes: int = 0
    loads: int = 0
    deferred: int = 0
    decode_s: float = 0.0
    scatter_s: float = 0.0
    loader_s: float = 0.0
    intercept_s: float = 0.0
    expand: str = ""  # "host" or "device"
    upload_s: float = 0.0
    upload_bytes: int = 0
    expand_s: float = 0.0
    rebuilt: int = 0  # derived layers rebuilt after the writes
    rebuild_s: float = 0.0
    classes: dict[str, int] = {}
    names: list[str] = []


class FingerprintAnswer(RankAnswer):
    tensors: dict[str, str]


class DenseAnswer(RankAnswer):
    rebuild_s: float = Field(default=0.0, ge=0)  # rebuilding derived layers' compute form


class CheckAnswer(RankAnswer):
    differ: dict[str, str]  # name -> the fingerprint this rank holds


# --- the table --------------------------------------------------------------------------------

class PluginCall(Generic[Q, A]):
    """One row of :class:`EngineApi`: the method ``dcr_<name>``, its request (None: it
    takes no argument), every rank's answer, and the timeout the agent waits by."""

    @overload
    def __init__(self: PluginCall[Request, A], request: None, answer: type[A], *,
                 wait: Wait, doc: str) -> None: ...

    @overload
    def __init__(self, request: type[Q], answer: type[A], *, wait: Wait, doc: str) -> None: ...

    def __init__(self, request: type[Q] | None, answer: type[A], *, wait: Wait,
                 doc: str) -> None:
        self.request, self.answer, self.wait, self.doc = request, answer, wait, doc
        self.name = ""  # the attribute name in the table: the driver's and the rank's method

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @property
    def method(self) -> str:
        """The plugin method an engine calls on every rank."""
        return f"dcr_{self.name}"

    def __repr__(self) -> str:
        return f"PluginCall({self.method})"

    def parse(self, request: RawRequest) -> Q:
        """The request from its JSON text (over the wire) or a dict (a Python caller);
        :class:`~dcr.errors.ConfigError` names the field that is wrong."""
        if self.request is None:
            raise ConfigError(f"{self.method} takes no request.")
        try:
            if isinstance(request, str | bytes):
                return self.request.model_validate_json(request)
            return self.request.model_validate(dict(request))
        except ValidationError as e:
            raise ConfigError(f"{self.request.__name__}: "
                              f"{first_validation_error(e, 'request')}") from e

    def line(self) -> str:
        """The row as the module docstring lists it."""
        request = self.request.__name__ if self.request is not None else "-"
        return (f"{self.method:<17} {request:<19} -> {self.answer.__name__:<17} "
                f"{self.wait:<9} {self.doc}")


class EngineApi:
    """The plugin's calls, one row each, named after the :class:`~dcr.drivers.base.Driver`
    method that makes the call and the :class:`~dcr.runtimes.rank.EngineRank` method that
    answers it."""

    instance = PluginCall(None, InstanceAnswer, wait="call_s", doc="process id, rank, world")
    prewarm = PluginCall(PrewarmRequest, ProfileAnswer, wait="prewarm_s",
                         doc="classify canonical tensors")
    apply = PluginCall(ApplyRequest, ApplyAnswer, wait="apply_s", doc="apply staged payloads")
    fingerprint = PluginCall(None, FingerprintAnswer, wait="call_s",
                             doc="xxh3-128 of every tensor")
    load_dense = PluginCall(DenseLoadRequest, DenseAnswer, wait="dense_s",
                            doc="load a checkpoint densely")
    check_targets = PluginCall(CheckTargetsRequest, CheckAnswer, wait="prewarm_s",
                               doc="targets whose bits differ")
    sync = PluginCall(None, RankAnswer, wait="call_s", doc="every write has finished")

    @staticmethod
    def calls() -> list[PluginCall[Any, Any]]:
        """The rows, in declaration order."""
        return [v for v in vars(EngineApi).values() if isinstance(v, PluginCall)]

    @classmethod
    def describe(cls) -> str:
        """The table as text, one line per call (the module docstring lists it)."""
        return "\n".join(c.line() for c in cls.calls())


BY_METHOD: dict[str, PluginCall[Any, Any]] = {c.method: c for c in EngineApi.calls()}
METHODS: tuple[str, ...] = tuple(BY_METHOD)  # every method the plugin adds to a rank

__all__ = ["BY_METHOD", "MAX_PAYLOADS", "MAX_RANKS", "MAX_TENSORS", "MAX_UNFILLED", "METHODS",
           "ApplyAnswer", "ApplyRequest", "CheckAnswer", "CheckTargetsRequest", "DenseAnswer",
           "DenseLoadRequest", "EngineApi", "FingerprintAnswer", "InstanceAnswer",
           "PluginCall", "PrewarmRequest", "ProfileAnswer", "RankAnswer", "RawRequest",
           "Request", "Wait"]
