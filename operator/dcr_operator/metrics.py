"""The operator's Prometheus metrics: refits, attempts, bytes and the committed versions.

One process-wide registry, fed by refit runs on any thread (docs/operations.md, "Metrics").
"""

from __future__ import annotations

import threading
from collections import Counter

from aiohttp import web

from dcr.http.prometheus import Family, render


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.refits: Counter[str] = Counter()  # by outcome: Committed, Failed
        self.attempts: Counter[tuple[str, str]] = Counter()  # by (mode, outcome)
        self.payload_bytes = 0  # applied by receivers, summed over committed refits
        self.refit_seconds = 0.0  # first attempt to commit, summed over committed refits
        self.running = 0
        self.committed: dict[tuple[str, str], int] = {}  # (namespace, fleet) -> version

    def refit_started(self) -> None:
        with self._lock:
            self.running += 1

    def refit_stopped(self) -> None:
        with self._lock:
            self.running -= 1

    def refit_ended(self, outcome: str, *, seconds: float = 0.0, payload_bytes: int = 0,
                    namespace: str = "", fleet: str = "", version: int | None = None) -> None:
        with self._lock:
            self.refits[outcome] += 1
            if outcome == "Committed":
                self.refit_seconds += seconds
                self.payload_bytes += payload_bytes
                if version is not None:
                    self.committed[namespace, fleet] = version

    def attempt_ended(self, mode: str, outcome: str) -> None:
        with self._lock:
            self.attempts[mode, outcome] += 1

    def render(self) -> str:
        with self._lock:
            return render([
                Family("dcr_operator_refits_total", "counter", "WeightRefits ended, by outcome.",
                       [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.refits.items())]),
                Family("dcr_operator_attempts_total", "counter",
                       "Attempts ended, by mode and outcome.",
                       [(f'{{mode="{m}",outcome="{o}"}}', v)
                        for (m, o), v in sorted(self.attempts.items())]),
                Family("dcr_operator_refit_seconds_total", "counter", "Seconds from a refit's "
                       "start to its commit, summed over committed refits.",
                       [("", round(self.refit_seconds, 6))]),
                Family("dcr_operator_payload_bytes_total", "counter", "Payload bytes "
                       "receivers applied, summed over committed refits.",
                       [("", self.payload_bytes)]),
                Family("dcr_operator_refits_running", "gauge",
                       "Refits this operator is driving.", [("", self.running)]),
                Family("dcr_operator_committed_version", "gauge", "The version each fleet's "
                       "commit record names, as this operator last committed it.",
                       [(f'{{namespace="{ns}",fleet="{f}"}}', v)
                        for (ns, f), v in sorted(self.committed.items())]),
            ])


METRICS = Metrics()


async def serve(address: str, port: int) -> web.AppRunner:
    """Start ``GET /metrics`` on ``address:port``; the caller cleans the runner up."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, address, port).start()
    return runner
