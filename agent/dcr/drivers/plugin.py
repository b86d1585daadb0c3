"""DCR's plugin inside the engine, as the agent calls it: seven methods, one answer per rank.

:class:`PluginDriver` implements those calls of :class:`~dcr.drivers.base.Driver` on one
primitive each adapter supplies (``_plugin``: carry a call to every rank, return the
answers) and checks the answers like any input from a peer: one JSON object of the
documented shape per rank, ranks exactly ``0..world-1``. docs/engines.md, "The plugin".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr.drivers.base import (
    ApplyOutcome,
    Prewarmed,
    TensorSpec,
    check_checkpoint_path,
    check_staged_name,
)
from dcr.drivers.errors import BadAnswer
from dcr.drivers.http import JsonHttp
from dcr.errors import first_validation_error
from dcr.format.profile import ReceiverProfile, TensorClass, merge
from dcr.http.direct import excerpt
from dcr.settings import option

M = TypeVar("M", bound="RankAnswer")


class RankAnswer(BaseModel):
    """What every rank's answer carries."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    rank: int = Field(ge=0, lt=1 << 16)


class InstanceAnswer(RankAnswer):
    instance: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    world: int = Field(ge=1, lt=1 << 16)


class ProfileAnswer(RankAnswer):
    profile: dict[str, TensorClass]
    regions: dict[str, list[Any]] = {}  # checked as a ReceiverProfile's (lists, not tuples)
    derived: int = Field(default=0, ge=0)  # layers computing from a form derived after loading
    kept_bytes: int = Field(default=0, ge=0)  # the copies of their loading form DCR keeps
    unfilled: list[str] = Field(default=[], max_length=64)  # of those, not loaded through DCR


class DenseAnswer(RankAnswer):
    rebuild_s: float = Field(default=0.0, ge=0)  # rebuilding derived layers' compute form


class FingerprintAnswer(RankAnswer):
    tensors: dict[str, str]


class CheckAnswer(RankAnswer):
    differ: dict[str, str]  # name -> the fingerprint this rank holds


class ApplyAnswer(RankAnswer):
    """A rank's apply report: the canonical tensors it wrote, and whatever else the
    plugin reports (counts, ``*_s`` seconds), kept as sent."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    names: list[str] = []


@dataclass(frozen=True, kw_only=True)
class EngineTimeouts:
    """How long the agent waits for each kind of engine call, in seconds. A call that
    runs longer fails with an :class:`~dcr.drivers.errors.EngineError`; generous,
    because a failed call costs a retry attempt."""

    call_s: float = option(30.0, metavar="S", doc="quick calls: instance, health, version, "
                           "resume, fingerprint, sync")
    prewarm_s: float = option(600.0, metavar="S", doc="prewarm, and the check of targets "
                              "after an attempt: every canonical tensor once through every "
                              "rank's loader")
    apply_s: float = option(600.0, metavar="S", doc="one apply call (a set of payloads)")
    dense_s: float = option(1800.0, metavar="S", doc="a dense load of a whole checkpoint "
                            "from the engine's disk")
    drain_s: float = option(600.0, metavar="S", doc="pause: in-flight generation finishing "
                            "(wait) or parking (keep)")


def ranked(results: object, model: type[M], *, what: str, call: str) -> list[M]:
    """The answers of every rank, validated with ``model`` and sorted by rank, or
    :class:`BadAnswer` naming what is wrong (never quoting more than a field name)."""
    if not isinstance(results, list) or not results:
        raise BadAnswer(f"{what}: {call} answered {type(results).__name__}, not one "
                        "answer per rank.", call=call)
    out = []
    for i, r in enumerate(results):
        try:
            out.append(model.model_validate(r))
        except ValidationError as e:
            why = excerpt(first_validation_error(e, "answer"), 160)  # keys are the peer's
            raise BadAnswer(f"{what}: {call}: answer {i} is not a {model.__name__} "
                            f"({why}).", call=call) from None
    out.sort(key=lambda a: a.rank)
    ranks = [a.rank for a in out]
    if ranks != list(range(len(out))):
        raise BadAnswer(f"{what}: {call} answered for ranks {ranks[:16]}, not 0.."
                        f"{len(out) - 1} once each.", call=call)
    return out


class PluginDriver:
    """The plugin's calls as :class:`~dcr.drivers.base.Driver` methods; a subclass
    carries a call to every rank (``_plugin``) and adds the gate and version calls."""

    what = "engine"  # how sentences name it; a subclass sets "vLLM engine at URL" etc.
    http: JsonHttp
    timeouts: EngineTimeouts

    def _plugin(self, method: str, arg: Mapping[str, Any] | None, *, call: str,
                timeout_s: float) -> list[Any]:
        """Every rank's answer to plugin ``method`` with ``arg`` (JSON-encoded), as
        parsed JSON; the engine's own errors as :class:`EngineError`."""
        raise NotImplementedError

    def _ranked(self, method: str, arg: Mapping[str, Any] | None, model: type[M], *,
                call: str, timeout_s: float) -> list[M]:
        results = self._plugin(method, arg, call=call, timeout_s=timeout_s)
        return ranked(results, model, what=self.what, call=call)

    def instance(self) -> str:
        answers = self._ranked("dcr_instance", None, InstanceAnswer, call="instance",
                               timeout_s=self.timeouts.call_s)
        worlds = {a.world for a in answers}
        if worlds != {len(answers)}:
            raise BadAnswer(f"{self.what}: instance: {len(answers)} ranks answered, but they "
                            f"say the world is {sorted(worlds)}.", call="instance")
        return "-".join(a.instance for a in answers)

    def prewarm(self, tensors: Iterable[TensorSpec]) -> Prewarmed:
        arg = {"tensors": [[t.name, t.dtype, list(t.shape)] for t in tensors]}
        answers = self._ranked("dcr_prewarm", arg, ProfileAnswer, call="prewarm",
                               timeout_s=self.timeouts.prewarm_s)
        try:
            profiles = [ReceiverProfile(tensors=a.profile, regions=a.regions) for a in answers]
        except ValidationError as e:
            why = excerpt(first_validation_error(e, "regions"), 160)
            raise BadAnswer(f"{self.what}: prewarm: a rank's regions are invalid ({why}).",
                            call="prewarm") from None
        return Prewarmed(profile=merge(profiles),
                         unfilled=tuple(sorted({n for a in answers for n in a.unfilled})))

    def apply(self, payloads: Sequence[str]) -> ApplyOutcome:
        arg = {"payloads": [check_staged_name(p) for p in payloads]}
        answers = self._ranked("dcr_apply", arg, ApplyAnswer, call="apply",
                               timeout_s=self.timeouts.apply_s)
        return ApplyOutcome(reports=tuple(a.model_dump() for a in answers))

    def sync(self) -> None:
        self._ranked("dcr_sync", None, RankAnswer, call="sync", timeout_s=self.timeouts.call_s)

    def fingerprint(self) -> list[dict[str, str]]:
        answers = self._ranked("dcr_fingerprint", None, FingerprintAnswer,
                               call="fingerprint", timeout_s=self.timeouts.call_s)
        return [a.tensors for a in answers]

    def check_targets(self, expect: Mapping[str, str]) -> dict[str, str]:
        answers = self._ranked("dcr_check_targets", {"expect": dict(expect)}, CheckAnswer,
                               call="check_targets", timeout_s=self.timeouts.prewarm_s)
        return {n: fp for a in answers for n, fp in sorted(a.differ.items())}

    def load_dense(self, checkpoint: str, expect: Mapping[str, str] | None = None) -> None:
        self._dense(checkpoint, expect, check_only=False)

    def check_dense(self, checkpoint: str, expect: Mapping[str, str] | None = None) -> None:
        self._dense(checkpoint, expect, check_only=True)

    def _dense(self, checkpoint: str, expect: Mapping[str, str] | None, *,
               check_only: bool) -> None:
        arg = {"checkpoint": check_checkpoint_path(checkpoint),
               "expect": None if expect is None else dict(expect), "check_only": check_only}
        self._ranked("dcr_load_dense", arg, DenseAnswer,
                     call="check_dense" if check_only else "load_dense",
                     timeout_s=self.timeouts.dense_s)

    def health(self) -> bool:
        return self.http.ok("/health", timeout_s=self.timeouts.call_s)

    def _read_version(self, path: str) -> str | None:
        """The ``weight_version`` field of ``GET path`` (both engines spell it so)."""
        answer = self.http.call("version", "GET", path, timeout_s=self.timeouts.call_s)
        label = answer.get("weight_version") if isinstance(answer, dict) else None
        if label is not None and not isinstance(label, str):
            raise BadAnswer(f"{self.what}: version (GET {path}) answered a "
                            f"{type(label).__name__} weight_version.", call="version")
        return label


def encode_arg(arg: Mapping[str, Any] | None) -> list[str]:
    """A plugin argument as the one JSON string the engine passes on (none: no args)."""
    return [] if arg is None else [json.dumps(arg, separators=(",", ":"))]


__all__ = ["ApplyAnswer", "CheckAnswer", "EngineTimeouts", "FingerprintAnswer", "InstanceAnswer",
           "PluginDriver", "ProfileAnswer", "RankAnswer", "encode_arg", "ranked"]
