"""The agent's adapter to an SGLang server, through SGLang's own HTTP API.

Plugin calls ride ``POST /update_weights_from_tensor`` to the custom weight loader
(:mod:`dcr.runtimes.sglang`) inside a ``begin``/``end_weight_update`` session: one empty
tensor per rank whose name carries the call, pickled without torch (:func:`call_pickle`)
from globals on SGLang's allow-list. Each rank answers with a file in the staging directory,
which this adapter reads and removes. :func:`weight_versions` reads SGLang's per-token
version spans in vLLM's shape. docs/sglang.md.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dcr.drivers.base import PauseMode
from dcr.drivers.errors import BadAnswer, EngineError
from dcr.drivers.http import MAX_ANSWER, JsonHttp
from dcr.drivers.plugin import EngineTimeouts, PluginDriver, encode_arg
from dcr.http.direct import excerpt
from dcr.protocol.engine_api import MAX_RANKS, EngineApi

LOADER = "dcr.runtimes.sglang.dcr_weight_loader"  # --custom-weight-loader and load_format
CALL_PREFIX = "dcr:"  # the name of the one named tensor that carries a call
PAUSE_MODES: dict[str, str] = {"abort": "abort", "keep": "in_place"}  # no drain in SGLang


def result_name(call: str, rank: int | str) -> str:
    """The file in the staging directory where ``rank`` leaves its answer to ``call``
    (``rank="*"``: the glob of every rank's)."""
    return f".dcr-result-{call}-{rank}.json"


# --- a pickle of [(name, empty uint8 tensor)] without torch ----------------------------
# What torch.multiprocessing's ForkingPickler writes for an empty CPU tensor, spelled
# with opcodes: rebuild_tensor(Tensor, rebuild_typed_storage(rebuild_storage_empty(
# UntypedStorage), uint8), (0, (0,), (1,), False)). Every global is on SGLang's
# SafeUnpickler allow-list; protocol 2, so any Python reads it.

def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


_REDUCTIONS = "torch.multiprocessing.reductions"
_EMPTY_TENSOR = b"".join((
    _global(_REDUCTIONS, "rebuild_tensor"),
    _global("torch", "Tensor"),
    _global(_REDUCTIONS, "rebuild_typed_storage"),
    _global(_REDUCTIONS, "rebuild_storage_empty"),
    _global("torch.storage", "UntypedStorage"),
    b"\x85R",  # rebuild_storage_empty((UntypedStorage,))
    _global("torch", "uint8"),
    b"\x86R",  # rebuild_typed_storage((storage, uint8))
    b"(K\x00K\x00\x85K\x01\x85\x89t",  # (offset 0, size (0,), stride (1,), False)
    b"\x87R",  # rebuild_tensor((Tensor, typed storage, metadata))
))
PICKLE_GLOBALS = frozenset({(_REDUCTIONS, "rebuild_tensor"), ("torch", "Tensor"),
                            (_REDUCTIONS, "rebuild_typed_storage"),
                            (_REDUCTIONS, "rebuild_storage_empty"),
                            ("torch.storage", "UntypedStorage"), ("torch", "uint8")})


def call_pickle(name: str) -> bytes:
    """The pickle of ``[(name, <empty uint8 tensor>)]`` that SGLang unpickles on each rank."""
    raw = name.encode()
    return b"".join((b"\x80\x02]", b"X" + struct.pack("<I", len(raw)) + raw, _EMPTY_TENSOR,
                     b"\x86a."))


def _read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file, never through a final symlink."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read(limit)


def weight_versions(answer: Any) -> list[dict[str, Any]] | None:
    """SGLang's per-token spans in vLLM's shape: the ``weight_versions`` of the answer's one
    choice, ``[{version, start, end}]`` over its output tokens, from ``meta_info`` (``/generate``
    and each of its stream chunks) or ``metadata`` (``/v1/completions``); None where the
    answer carries none. SGLang's spans already have vLLM's fields; they are copied as
    they are, and :mod:`dcr.client` checks them as it checks vLLM's. docs/sglang.md."""
    if not isinstance(answer, Mapping):
        return None
    for holder in ("meta_info", "metadata"):
        info = answer.get(holder)
        if isinstance(info, Mapping) and isinstance(info.get("weight_versions"), list):
            return [dict(s) if isinstance(s, Mapping) else {"span": s}
                    for s in info["weight_versions"]]
    return None


def output_tokens(answer: Any) -> int | None:
    """How many tokens an SGLang ``/generate`` answer's spans cover, where it says."""
    info = answer.get("meta_info") if isinstance(answer, Mapping) else None
    count = info.get("completion_tokens") if isinstance(info, Mapping) else None
    return count if type(count) is int else None


class SglangDriver(PluginDriver):
    """An SGLang server at ``url`` whose TP ranks run DCR's custom weight loader.

    ``staging_dir`` is this process's mount of the volume the engine reads payloads
    from (its ``DCR_STAGING_DIR``): the ranks' answers come back there. ``api_key`` is
    the server's admin API key if it has one, else its API key. ``tp_size`` is read
    from ``GET /server_info`` when not given.
    """

    def __init__(self, url: str, staging_dir: Path, api_key: str | None = None, *,
                 tp_size: int | None = None, loader: str = LOADER,
                 timeouts: EngineTimeouts | None = None) -> None:
        self.http = JsonHttp("SGLang engine", url, api_key)
        self.what = f"SGLang engine at {self.http.url}"
        self.staging_dir = staging_dir
        self.loader = loader
        self.timeouts = timeouts or EngineTimeouts()
        self._tp_size = tp_size
        self._paused: PauseMode | None = None

    def __repr__(self) -> str:
        return f"SglangDriver({self.http.url!r})"

    @property
    def tp_size(self) -> int:
        if self._tp_size is None:
            info = self.http.call("tp_size", "GET", "/server_info",
                                  timeout_s=self.timeouts.call_s)
            size = info.get("tp_size") if isinstance(info, dict) else None
            if type(size) is not int or not 1 <= size < MAX_RANKS:
                raise BadAnswer(f"{self.what}: tp_size (GET /server_info) answered no "
                                "usable tp_size; give it to the adapter.", call="tp_size")
            self._tp_size = size
        return self._tp_size

    def _plugin(self, method: str, arg: Mapping[str, Any] | None, *, call: str,
                timeout_s: float) -> list[Any]:
        cid = secrets.token_hex(8)
        name = CALL_PREFIX + json.dumps({"call": cid, "method": method,
                                         "args": encode_arg(arg)}, separators=(",", ":"))
        entry = base64.b64encode(call_pickle(name)).decode()
        # A weight change makes the prefix cache stale; SGLang cannot flush it while
        # requests sit frozen in place (pause mode in_place).
        flush = (method in (EngineApi.apply.method, EngineApi.load_dense.method)
                 and self._paused != "keep")
        body = {"serialized_named_tensors": [entry] * self.tp_size, "load_format": self.loader,
                "flush_cache": flush, "abort_all_requests": False}
        try:
            self._session("begin_weight_update", call, timeout_s)
            try:
                self._checked(call, "/update_weights_from_tensor", body, timeout_s)
            except BaseException:
                with contextlib.suppress(EngineError):  # the update's error is the one
                    self._session("end_weight_update", call, timeout_s)
                raise
            self._session("end_weight_update", call, timeout_s)
            return self._answers(cid, call)
        finally:
            for stale in self.staging_dir.glob(result_name(cid, "*")):
                with contextlib.suppress(OSError):
                    stale.unlink()

    def _session(self, path: str, call: str, timeout_s: float) -> None:
        self._checked(call, "/" + path, {}, timeout_s)

    def _checked(self, call: str, path: str, body: Any, timeout_s: float) -> Any:
        """POST ``body``; SGLang's ``{"success": false, "message"}`` as an error."""
        answer = self.http.call(call, "POST", path, body, timeout_s=timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(f"{self.what}: {call} (POST {path}) failed: "
                              f"{excerpt(str(answer.get('message', '')))}", call=call)
        return answer

    def _answers(self, cid: str, call: str) -> list[Any]:
        out = []
        for rank in range(self.tp_size):
            path = self.staging_dir / result_name(cid, rank)
            try:
                raw = _read_regular(path, MAX_ANSWER + 1)
                answer = json.loads(raw)
            except (OSError, ValueError) as e:
                raise BadAnswer(f"{self.what}: {call}: rank {rank} left no readable answer "
                                f"in {path} ({type(e).__name__}).", call=call) from None
            if len(raw) > MAX_ANSWER:
                raise BadAnswer(f"{self.what}: {call}: rank {rank}'s answer is over "
                                f"{MAX_ANSWER} bytes.", call=call)
            if isinstance(answer, dict) and "error" in answer:
                raise EngineError(f"{self.what}: {call} failed on rank {rank}: "
                                  f"{excerpt(str(answer['error']))}", call=call)
            out.append(answer)
        return out

    def pause(self, mode: PauseMode = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"{self.what}: pause mode {mode!r}: SGLang cannot let requests "
                              "in flight finish before a pause (its modes are abort, retract "
                              "and in_place); use abort or keep.", call="pause")
        self._checked("pause", "/pause_generation", {"mode": PAUSE_MODES[mode]},
                      self.timeouts.drain_s)
        self._paused = mode

    def resume(self) -> None:
        self._checked("resume", "/continue_generation", {}, self.timeouts.call_s)
        self._paused = None

    def set_version(self, label: str) -> None:
        self._checked("set_version", "/update_weight_version",
                      {"new_version": label, "abort_all_requests": False},
                      self.timeouts.call_s)

    def version(self) -> str | None:
        return self._read_version("/model_info")


__all__ = ["CALL_PREFIX", "LOADER", "PICKLE_GLOBALS", "SglangDriver", "call_pickle",
           "output_tokens", "result_name", "weight_versions"]
