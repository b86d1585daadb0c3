"""The operator's Prometheus metrics: refits, attempts and their stages, bytes, and where
each fleet stands (docs/monitoring.md, "Metrics").

One process-wide registry of ``prometheus_client`` instruments, fed by refit runs and fleet
polls on any thread (the instruments lock themselves). The alerts in the chart
(``charts/dcr/files/prometheus-rules.yaml``) and its dashboard read these names.

Every series labelled with a fleet is made through :meth:`Metrics._of`, which remembers it
under its fleet, so that a deleted fleet's series (counters and histograms of its refits
too) leave the scrape with it (:meth:`Metrics.fleet_deleted`, :meth:`Metrics.keep_fleets`):
fleets come and go, and a registry that kept them all would grow without bound.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterable
from typing import TypeVar, get_args

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from dcr.format.names import Mode
from dcr.protocol.coordinator import AttemptResult
from dcr.protocol.states import AttemptOutcome, Phase
from dcr_operator.reconcile import OUTCOMES

# No *_created series: the counters restart with the process anyway.
disable_created_metrics()  # type: ignore[no-untyped-call]

# A refit is its attempts, each a few seconds to minutes; past 30 min the deadline governs.
REFIT_BUCKETS = (1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800)
STAGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
FLEET = ("namespace", "fleet")
REFIT_OUTCOMES = (Phase.COMMITTED, Phase.FAILED)
ATTEMPT_OUTCOMES = tuple(o for o in OUTCOMES.values() if o != AttemptOutcome.RUNNING)  # ended
MODES = get_args(Mode)
Instrument = Counter | Gauge | Histogram
M = TypeVar("M", Counter, Gauge, Histogram)
FleetKey = tuple[str, str]  # (namespace, fleet)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.refits = Counter("dcr_operator_refits", "WeightRefits ended, by outcome "
                              "(Committed, Failed).", [*FLEET, "outcome"], registry=r)
        self.refit_failures = Counter(
            "dcr_operator_refit_failures", "Failed WeightRefits by the reason of their Failed "
            "condition (e.g. RetryLimitReached).", [*FLEET, "reason"], registry=r)
        self.attempts = Counter("dcr_operator_attempts", "Attempts ended, by mode (mixed, "
                                "overwrite) and outcome (Committed, Failed, Conflict).",
                                [*FLEET, "mode", "outcome"], registry=r)
        self.attempt_failures = Counter(
            "dcr_operator_attempt_failures", "Attempts that did not commit, by the kind of "
            "error that ended them (e.g. AgentError, FingerprintMismatch).",
            [*FLEET, "reason"], registry=r)
        self.refit_seconds = Histogram(
            "dcr_operator_refit_duration_seconds", "Seconds from a refit's start to its "
            "commit, committed refits only.", FLEET, buckets=REFIT_BUCKETS, registry=r)
        self.stage_seconds = Histogram(
            "dcr_operator_attempt_stage_duration_seconds", "Wall seconds of each stage of an "
            "ended attempt (prepare, publish, stage, gate, flush, commit, finish).", ["stage"],
            buckets=STAGE_BUCKETS, registry=r)
        self.payload_bytes = Counter("dcr_operator_payload_bytes", "Payload bytes receivers "
                                     "applied, summed over committed refits.", FLEET,
                                     registry=r)
        self.running = Gauge("dcr_operator_refits_running", "Refits this operator is "
                             "driving.", registry=r)
        self.committed = Gauge("dcr_operator_committed_version", "The version each fleet's "
                               "commit record names.", FLEET, registry=r)
        self.last_commit = Gauge(
            "dcr_operator_last_commit_timestamp_seconds", "Unix time of each fleet's last "
            "commit (its creation while it has none).", FLEET, registry=r)
        self.receivers = Gauge("dcr_operator_fleet_receivers", "Receivers the last fleet "
                               "poll found.", FLEET, registry=r)
        self.behind = Gauge(
            "dcr_operator_fleet_receivers_behind", "Receivers the last fleet poll found not "
            "serving the committed version (another version, none, or no answer).", FLEET,
            registry=r)
        self.unfinished = Gauge("dcr_operator_fleet_refits_unfinished", "WeightRefits of "
                                "the fleet neither committed nor failed.", FLEET, registry=r)
        self._lock = threading.Lock()
        self._series: dict[FleetKey, set[tuple[Instrument, tuple[str, ...]]]] = {}

    def _of(self, instrument: M, namespace: str, fleet: str, *rest: str) -> M:
        """The child of ``instrument`` for one fleet's series, remembered under the fleet."""
        labels = (namespace, fleet, *rest)
        with self._lock:
            self._series.setdefault((namespace, fleet), set()).add((instrument, labels))
        child: M = instrument.labels(*labels)
        return child

    def refit_started(self) -> None:
        self.running.inc()

    def refit_stopped(self) -> None:
        self.running.dec()

    def refit_committed(self, *, namespace: str, fleet: str, version: int, seconds: float,
                        payload_bytes: int, at: float) -> None:
        self._of(self.refits, namespace, fleet, Phase.COMMITTED).inc()
        self._of(self.refit_seconds, namespace, fleet).observe(seconds)
        self._of(self.payload_bytes, namespace, fleet).inc(payload_bytes)
        self._of(self.committed, namespace, fleet).set(version)
        self._of(self.last_commit, namespace, fleet).set(at)

    def refit_failed(self, *, namespace: str, fleet: str, reason: str) -> None:
        self._of(self.refits, namespace, fleet, Phase.FAILED).inc()
        self._of(self.refit_failures, namespace, fleet, reason).inc()

    def attempt_ended(self, result: AttemptResult, *, namespace: str, fleet: str, mode: str,
                      outcome: str) -> None:
        self._of(self.attempts, namespace, fleet, mode, outcome).inc()
        if outcome != AttemptOutcome.COMMITTED:
            self._of(self.attempt_failures, namespace, fleet, result.error or "Unknown").inc()
        for stage, seconds in result.stages.items():
            self.stage_seconds.labels(stage).observe(seconds)

    def fleet_polled(self, *, namespace: str, fleet: str, version: int,
                     committed_at: float | None, receivers: int, behind: int) -> None:
        """Where the fleet stands; its outcome counters start at 0 here, so that alerts on
        their increase see the first failure (a series born at 1 shows no increase)."""
        for phase in REFIT_OUTCOMES:
            self._of(self.refits, namespace, fleet, phase)
        for mode, outcome in itertools.product(MODES, ATTEMPT_OUTCOMES):
            self._of(self.attempts, namespace, fleet, mode, outcome)
        self._of(self.payload_bytes, namespace, fleet)
        self._of(self.committed, namespace, fleet).set(version)
        if committed_at is not None:
            self._of(self.last_commit, namespace, fleet).set(committed_at)
        self._of(self.receivers, namespace, fleet).set(receivers)
        self._of(self.behind, namespace, fleet).set(behind)

    def fleet_refits(self, *, namespace: str, fleet: str, unfinished: int) -> None:
        self._of(self.unfinished, namespace, fleet).set(unfinished)

    def fleet_deleted(self, *, namespace: str, fleet: str) -> None:
        """Drop every series of a deleted fleet: gauges, counters and histograms."""
        with self._lock:
            series = self._series.pop((namespace, fleet), set())
        for instrument, labels in series:
            with contextlib.suppress(KeyError):  # removed already
                instrument.remove(*labels)

    def fleets(self) -> set[FleetKey]:
        """The fleets that have series."""
        with self._lock:
            return set(self._series)

    def keep_fleets(self, fleets: Iterable[FleetKey]) -> list[FleetKey]:
        """Drop the series of every fleet not in ``fleets`` (those that exist); the fleets
        dropped. A refit that ends after its fleet's deletion leaves none behind."""
        gone = sorted(self.fleets() - set(fleets))
        for namespace, fleet in gone:
            self.fleet_deleted(namespace=namespace, fleet=fleet)
        return gone

    def render(self) -> str:
        return generate_latest(self.registry).decode()


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
