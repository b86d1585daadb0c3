"""The agent's adapter to a vLLM server (and to ``dcr serve``, which speaks its dialect).

Every call is one request to vLLM's own HTTP server (docs/engines.md, "The calls"): plugin
calls to ``POST /collective_rpc``, the gate to ``/pause`` and ``/resume``, the label to the
weight-version routes. The adapter sends the API key on every call, though vLLM checks it
only on ``/v1`` paths: ``dcr serve`` checks it on all but ``/health``. Behind the engine's
client guard (:mod:`dcr.http.engine_guard`) it sends the engine admin token instead: every
call it makes is outside ``/v1``, and the guard lets only that token through to them.
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
    """A vLLM server (or ``dcr serve``) at ``url``, driven through its HTTP API;
    ``admin_token``: the engine admin token its client guard asks for."""

    def __init__(self, url: str, api_key: str | None = None, *,
                 timeouts: EngineTimeouts | None = None, admin_token: str | None = None
                 ) -> None:
        self.http = JsonHttp("vLLM engine", url, admin_token or api_key)
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
