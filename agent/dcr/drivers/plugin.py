"""DCR's plugin inside the engine, as the agent calls it: one answer per rank.

:class:`PluginDriver` implements the calls of :class:`~dcr.drivers.base.Driver` that are
rows of :class:`~dcr.protocol.engine_api.EngineApi` on one primitive each adapter supplies
(``_plugin``: carry a call to every rank, return the answers), and checks the answers like
any input from a peer: one answer of the row's model per rank, ranks exactly
``0..world-1``. docs/engines.md, "The plugin".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

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
from dcr.format.profile import ReceiverProfile, merge
from dcr.http.direct import excerpt
from dcr.protocol.engine_api import EngineApi, PluginCall, RankAnswer, Request, Wait
from dcr.settings import option

M = TypeVar("M", bound=RankAnswer)
Q = TypeVar("Q", bound=Request)


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

    def of(self, wait: Wait) -> float:
        """The timeout a plugin call waits by (its row's ``wait``)."""
        return float(getattr(self, wait))


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

    def _ranked(self, call: PluginCall[Q, M], request: Mapping[str, Any] | None = None, *,
                name: str = "") -> list[M]:
        """Every rank's answer to ``call`` with ``request`` (checked against the row's
        request model before it is sent); ``name``: how errors name the call."""
        name = name or call.name
        arg = None if request is None else call.parse(request).model_dump(mode="json")
        results = self._plugin(call.method, arg, call=name,
                               timeout_s=self.timeouts.of(call.wait))
        return ranked(results, call.answer, what=self.what, call=name)

    def instance(self) -> str:
        answers = self._ranked(EngineApi.instance)
        worlds = {a.world for a in answers}
        if worlds != {len(answers)}:
            raise BadAnswer(f"{self.what}: instance: {len(answers)} ranks answered, but they "
                            f"say the world is {sorted(worlds)}.", call="instance")
        return "-".join(a.instance for a in answers)

    def prewarm(self, tensors: Iterable[TensorSpec]) -> Prewarmed:
        request = {"tensors": [[t.name, t.dtype, list(t.shape)] for t in tensors]}
        answers = self._ranked(EngineApi.prewarm, request)
        try:
            profiles = [ReceiverProfile(tensors=a.profile, regions=a.regions) for a in answers]
        except ValidationError as e:
            why = excerpt(first_validation_error(e, "regions"), 160)
            raise BadAnswer(f"{self.what}: prewarm: a rank's regions are invalid ({why}).",
                            call="prewarm") from None
        return Prewarmed(profile=merge(profiles),
                         unfilled=tuple(sorted({n for a in answers for n in a.unfilled})))

    def apply(self, payloads: Sequence[str]) -> ApplyOutcome:
        request = {"payloads": [check_staged_name(p) for p in payloads]}
        answers = self._ranked(EngineApi.apply, request)
        return ApplyOutcome(reports=tuple(a.model_dump() for a in answers))

    def sync(self) -> None:
        self._ranked(EngineApi.sync)

    def fingerprint(self) -> list[dict[str, str]]:
        return [a.tensors for a in self._ranked(EngineApi.fingerprint)]

    def check_targets(self, expect: Mapping[str, str]) -> dict[str, str]:
        answers = self._ranked(EngineApi.check_targets, {"expect": dict(expect)})
        return {n: fp for a in answers for n, fp in sorted(a.differ.items())}

    def load_dense(self, checkpoint: str, expect: Mapping[str, str] | None = None) -> None:
        self._dense(checkpoint, expect, check_only=False)

    def check_dense(self, checkpoint: str, expect: Mapping[str, str] | None = None) -> None:
        self._dense(checkpoint, expect, check_only=True)

    def _dense(self, checkpoint: str, expect: Mapping[str, str] | None, *,
               check_only: bool) -> None:
        request = {"checkpoint": check_checkpoint_path(checkpoint),
                   "expect": None if expect is None else dict(expect), "check_only": check_only}
        self._ranked(EngineApi.load_dense, request,
                     name="check_dense" if check_only else "load_dense")

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


__all__ = ["EngineTimeouts", "PluginDriver", "encode_arg", "ranked"]
