"""The agent's adapter to a vLLM server (and to ``dcr serve``, which speaks its dialect).

Every call is one request to an endpoint of vLLM's own HTTP server (read in vLLM 0.33's
source; ``docs/engines.md`` has the table and the reasons):

* the plugin's calls go to ``POST /collective_rpc {"method", "args": [json], "timeout"}``
  (``vllm/entrypoints/serve/dev/rpc/api_router.py``), which runs the method on every
  worker and answers ``{"results": [one per worker]}``; the workers carry DCR's plugin
  through ``--worker-extension-cls dcr.runtimes.vllm.DcrWorkerExtension``;
* the gate is ``POST /pause?mode=abort|wait|keep`` and ``POST /resume``, the state
  ``GET /is_paused``; the version label ``POST /update_weight_version {"new_version"}``
  and ``GET /weight_info`` (``vllm/entrypoints/rl/online/api_router.py``);
* health is ``GET /health`` (200, or 503 once the engine core died).

``/collective_rpc`` and the RL routes exist only when the server runs with
``VLLM_SERVER_DEV_MODE=1``; vLLM's ``--api-key`` guards only ``/v1``-style paths, so the
rest must not be reachable from outside the pod (``docs/engines.md``). The adapter sends
the key on every call anyway: ``dcr serve`` checks it everywhere but ``/health``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dcr.drivers.base import PauseMode
from dcr.drivers.errors import BadAnswer
from dcr.drivers.http import JsonHttp
from dcr.drivers.plugin import EngineTimeouts, PluginDriver, encode_arg

RPC_MARGIN_S = 10.0  # the socket waits this much longer than the rpc's own timeout


class VllmDriver(PluginDriver):
    """A vLLM server (or ``dcr serve``) at ``url``, driven through its HTTP API."""

    def __init__(self, url: str, api_key: str | None = None, *,
                 timeouts: EngineTimeouts | None = None) -> None:
        self.http = JsonHttp("vLLM engine", url, api_key)
        self.what = f"vLLM engine at {self.http.url}"
        self.timeouts = timeouts or EngineTimeouts()

    def __repr__(self) -> str:
        return f"VllmDriver({self.http.url!r})"

    def rpc(self, method: str, arg: Mapping[str, Any] | None = None, *,
            timeout_s: float | None = None) -> list[Any]:
        """``POST /collective_rpc``: every worker's answer to ``method`` (a plugin method)
        with ``arg`` as its one JSON-string argument."""
        wait = self.timeouts.call_s if timeout_s is None else timeout_s
        return self._plugin(method, arg, call=method, timeout_s=wait)

    def _plugin(self, method: str, arg: Mapping[str, Any] | None, *, call: str,
                timeout_s: float) -> list[Any]:
        body = {"method": method, "args": encode_arg(arg), "timeout": timeout_s}
        answer = self.http.call(call, "POST", "/collective_rpc", body,
                                timeout_s=timeout_s + RPC_MARGIN_S)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise BadAnswer(f"{self.what}: {call} (POST /collective_rpc) answered without "
                            "a results list.", call=call)
        return results

    def pause(self, mode: PauseMode = "wait") -> None:
        self.http.call("pause", "POST", "/pause", query={"mode": mode},
                       timeout_s=self.timeouts.drain_s)

    def resume(self) -> None:
        self.http.call("resume", "POST", "/resume", timeout_s=self.timeouts.call_s)

    def is_paused(self) -> bool:
        answer = self.http.call("is_paused", "GET", "/is_paused",
                                timeout_s=self.timeouts.call_s)
        paused = answer.get("is_paused") if isinstance(answer, dict) else None
        if not isinstance(paused, bool):
            raise BadAnswer(f"{self.what}: is_paused (GET /is_paused) answered without a "
                            "boolean is_paused.", call="is_paused")
        return paused

    def set_version(self, label: str) -> None:
        self.http.call("set_version", "POST", "/update_weight_version",
                       {"new_version": label}, timeout_s=self.timeouts.call_s)

    def version(self) -> str | None:
        return self._read_version("/weight_info")


__all__ = ["VllmDriver"]
