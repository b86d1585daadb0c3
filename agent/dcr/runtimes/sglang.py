"""DCR's plugin inside an SGLang server: the custom weight loader every TP rank runs.

:func:`dcr_weight_loader` decodes the call carried by one tensor's name (a row of
:class:`~dcr.protocol.engine_api.EngineApi`), runs it through
:class:`~dcr.runtimes.rank.EngineRank` and writes the rank's answer as a file in
``$DCR_STAGING_DIR``; it never raises into SGLang's scheduler. Nothing here imports SGLang
at module level. docs/sglang.md.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import secrets
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from dcr.errors import ConfigError, first_validation_error
from dcr.protocol.engine_api import BY_METHOD, METHODS
from dcr.runtimes.loader import VllmRuntime
from dcr.runtimes.rank import STAGING_ENV, EngineRank, engine_dir

log = logging.getLogger(__name__)

CALL_PREFIX = "dcr:"  # as dcr.drivers.sglang sends it
CALL_ID = re.compile(r"^[0-9a-f]{1,64}$")  # part of a file name; pydantic searches: anchored
MAX_CALL = 64 << 20  # characters of a call's name (a prewarm lists every tensor)
MAX_ERROR = 2000  # characters of an error answer (the agent keeps 240)


class SglangCall(BaseModel):
    """One plugin call as it arrives in the tensor's name."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    call: str = Field(pattern=CALL_ID.pattern)
    method: StrictStr  # one of the plugin's methods
    args: list[StrictStr] = Field(max_length=1)

    @field_validator("method")
    @classmethod
    def _a_plugin_method(cls, method: str) -> str:
        if method not in BY_METHOD:
            raise ValueError(f"{method[:64]!r} is not one of the plugin's methods "
                             f"{list(METHODS)}")
        return method


class SglangRuntime(VllmRuntime):
    """An SGLang model: vLLM's loader contract, except that ``load_weights`` may
    return None instead of the names it wrote."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self.model.load_weights(weights)
        return set() if loaded is None else set(loaded)


_RANKS: weakref.WeakKeyDictionary[Any, EngineRank] = weakref.WeakKeyDictionary()


def tp_rank_and_world() -> tuple[int, int]:
    """This process's TP rank and TP size, as SGLang's runtime context records them
    (or the default process group's, where SGLang's context cannot be read)."""
    try:
        parallel = importlib.import_module("sglang.srt.runtime_context").get_parallel()
        rank, world, pp = parallel.tp_rank, parallel.tp_size, parallel.pp_size
    except Exception:  # not inside SGLang, or another version's context
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if pp != 1:
        version = getattr(importlib.import_module("sglang"), "__version__", "unknown")
        raise ConfigError(f"The SGLang {version} server runs {pp} pipeline stages; DCR's "
                          "loader supports tensor parallelism only (pp_size 1): its answers "
                          "are named by TP rank, under which every stage would answer.")
    return int(rank), int(world)


def parse_call(named_tensors: Sequence[tuple[str, Any]]) -> SglangCall:
    """The call carried by the one named tensor, or :class:`ConfigError`."""
    if len(named_tensors) != 1:
        raise ConfigError(f"DCR's loader takes one named tensor carrying a call, not "
                          f"{len(named_tensors)}; send weights with another load_format.")
    name = named_tensors[0][0]
    if not isinstance(name, str) or not name.startswith(CALL_PREFIX):
        raise ConfigError(f"The tensor's name does not start with {CALL_PREFIX!r}: it is "
                          "not a DCR call.")
    if len(name) > MAX_CALL:
        raise ConfigError(f"The call is over {MAX_CALL} characters.")
    try:
        return SglangCall.model_validate_json(name[len(CALL_PREFIX):])
    except ValidationError as e:
        raise ConfigError(f"SglangCall: {first_validation_error(e, 'call')}") from e


def call_id(named_tensors: Sequence[tuple[str, Any]]) -> str | None:
    """The call's id, if one can be read where the call as a whole cannot."""
    with contextlib.suppress(Exception):
        cid = json.loads(named_tensors[0][0][len(CALL_PREFIX):]).get("call")
        if isinstance(cid, str) and CALL_ID.fullmatch(cid):
            return cid
    return None


def engine_rank(model: Any, rank: int, world: int) -> EngineRank:
    """The rank state for ``model``: made once per model object."""
    held = _RANKS.get(model)
    if held is None or (held.rank, held.world) != (rank, world):
        held = EngineRank(SglangRuntime(model), rank=rank, world=world,
                          device=next(model.parameters()).device)
        _RANKS[model] = held
    return held


def run_call(model: Any, call: SglangCall, rank: int, world: int) -> dict[str, Any]:
    row = BY_METHOD[call.method]
    takes_arg = row.request is not None
    if len(call.args) != int(takes_arg):
        raise ConfigError(f"{call.method} takes {int(takes_arg)} argument(s), not "
                          f"{len(call.args)}.")
    request = row.parse(call.args[0]) if takes_arg else None
    with torch.no_grad():
        return engine_rank(model, rank, world).serve(row, request)


def write_answer(call: str, rank: int, answer: dict[str, Any]) -> None:
    """``answer`` as ``.dcr-result-<call>-<rank>.json`` in the staging directory, written
    under a temporary name and renamed into place, never through a link."""
    raw = json.dumps(answer, separators=(",", ":")).encode()
    final = f".dcr-result-{call}-{rank}.json"
    if not CALL_ID.fullmatch(call) or os.sep in final:
        raise ValueError(f"call id {call[:80]!r} cannot be part of a file name")
    tmp = f".dcr-tmp-{secrets.token_hex(8)}"
    directory = os.open(engine_dir(STAGING_ENV), os.O_RDONLY | os.O_DIRECTORY
                        | getattr(os, "O_CLOEXEC", 0))
    try:
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0))
        fd = os.open(tmp, flags, 0o600, dir_fd=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.rename(tmp, final, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=directory)
            raise
    finally:
        os.close(directory)


def dcr_weight_loader(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader: run the DCR call named by ``named_tensors`` on this
    rank and leave the answer in the staging directory. Never raises."""
    rank = 0
    try:
        rank, world = tp_rank_and_world()
        call = parse_call(named_tensors)
    except Exception as e:
        cid = call_id(named_tensors)
        log.warning("DCR loader on rank %s refused a call %s: %s", rank, cid, e)
        _answer(cid, rank, _error(rank, e))
        return
    try:
        answer = run_call(model, call, rank, world)
        json.dumps(answer)  # an answer that cannot be sent is an error, here
    except Exception as e:
        log.warning("DCR loader on rank %s: %s failed: %s", rank, call.method, e)
        answer = _error(rank, e)
    _answer(call.call, rank, answer)


def _error(rank: int, e: Exception) -> dict[str, Any]:
    return {"rank": rank, "error": f"{type(e).__name__}: {e}"[:MAX_ERROR]}


def _answer(cid: str | None, rank: int, answer: dict[str, Any]) -> None:
    if cid is None:
        log.error("DCR loader on rank %s: the call has no usable id; no answer written.",
                  rank)
        return
    try:
        write_answer(cid, rank, answer)
    except Exception as e:  # nowhere to answer: the agent sees no answer from this rank
        log.error("DCR loader on rank %s: cannot write its answer to call %s: %s",
                  rank, cid, e)


__all__ = ["SglangCall", "SglangRuntime", "dcr_weight_loader", "parse_call",
           "tp_rank_and_world", "write_answer"]
