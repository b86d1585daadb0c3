"""The agent's HTTP control API (:mod:`dcr.protocol.agent_api`) on aiohttp.

One route per row of :class:`~dcr.protocol.agent_api.AgentApi`. Blocking calls never run on
the event loop, and each kind of call has its own pool (:data:`POOLS`), so waits cannot
starve ``status`` or ``stop`` (docs/agent-api.md, "Threads, locks and waits").
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiohttp import web

from dcr.drivers.errors import EngineError
from dcr.errors import Busy
from dcr.http.edge import Statuses, guard
from dcr.http.prometheus import Family, render
from dcr.protocol.agent_api import AgentApi, AttemptDeadline, Call, parse_body
from dcr.protocol.peer_api import PATHS as PEER_PATHS
from dcr.receiver.donor import Donor, peer_routes
from dcr.receiver.service import AgentService, AttemptFailed
from dcr.receiver.settings import AgentSettings
from dcr.versions import AGENT_API

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Which pool runs a call (by its row's name; "control" otherwise), and each pool's threads.
POOLS = {"status": "status", "stop_and_wait": "stop", "wait_staged": "wait", "flush": "wait"}
POOL_THREADS = {"status": 2, "stop": 2, "control": 4}  # "wait": max_waits
DISCONNECT_POLL_S = 0.2  # how often a wait looks whether its client is still there
# Beside each Refused's own status (BadRequest 400, AgentConflict and IllegalTransition 409,
# Busy 503): an attempt that failed here, and an engine that failed or did not answer.
STATUS = Statuses(rows=((AttemptFailed, 422), (EngineError, 503)))


if TYPE_CHECKING:
    from dcr.protocol.coordinator import ReceiverHandle

    def _in_process(service: AgentService) -> ReceiverHandle:
        """mypy holds the service to the seam that these routes serve over HTTP."""
        return service


def make_app(service: AgentService, token: str, *, max_waits: int = AgentSettings.max_waits,
             liveness_timeout_s: float = AgentSettings.liveness_timeout_s,
             more_metrics: Callable[[], list[Family]] | None = None,
             donor: tuple[Donor, str] | None = None) -> web.Application:
    """The agent's routes; ``more_metrics``: families its ``/metrics`` adds (the client
    door's); ``donor``: what it lends peers, and the peer read token those routes ask
    for instead of ``token``."""
    sizes = {**POOL_THREADS, "wait": max_waits}
    pools: dict[str, Executor] = {
        name: ThreadPoolExecutor(n, thread_name_prefix=f"agent-{name}")
        for name, n in sizes.items()}
    waits = asyncio.Semaphore(max_waits)

    async def run(pool: str, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pools[pool], fn, *args)

    async def wait(request: web.Request, fn: Callable[..., Any], key: AttemptDeadline) -> Any:
        """Run a waiting call; set its key's ``cancel`` when the client goes away."""
        if waits.locked():
            raise Busy(f"{service.name}: {max_waits} waits are in progress; try again when "
                       "one has ended.")
        cancel = threading.Event()
        async with waits:
            job = asyncio.ensure_future(run("wait", fn, dataclasses.replace(key,
                                                                            cancel=cancel)))
            try:
                while not (await asyncio.wait({job}, timeout=DISCONNECT_POLL_S))[0]:
                    if request.transport is None or request.transport.is_closing():
                        break
            finally:
                if not job.done():  # the client left, or this handler was cancelled
                    cancel.set()
                    pools["stop"].submit(service.wake)
            return await job

    def route(call: Call[..., Any, Any]) -> web.RouteDef:
        fn: Callable[..., Any] = getattr(service, call.name)
        pool = POOLS.get(call.name, "control")

        async def handler(request: web.Request) -> web.StreamResponse:
            args: tuple[Any, ...] = ()
            if call.request is not None:
                args = call.decode(parse_body(call.request, await request.read()))
            result = await (wait(request, fn, *args) if pool == "wait"
                            else run(pool, fn, *args))
            return web.Response(body=call.adapter.dump_json(result),
                                content_type="application/json")

        return web.route(call.method, call.path, handler)

    async def healthz(_: web.Request) -> web.StreamResponse:
        try:
            alive = await asyncio.wait_for(run("status", service.alive, liveness_timeout_s),
                                           liveness_timeout_s + 1.0)
        except TimeoutError:
            alive = False
        if not alive:
            return web.Response(status=503, text="wedged: the agent's state has been locked "
                                f"for more than {liveness_timeout_s} s\n")
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.StreamResponse:
        st = await run("status", service.status)
        if st.version is None:
            return web.Response(status=503, text=f"no version: {st.unknown or st.dirty}\n")
        committed = await run("status", service.committed_in_store)
        if committed is not None and st.version < committed:  # a pod started on old weights
            return web.Response(status=503, text=f"version {st.version}; the committed "
                                f"version is {committed}\n")
        return web.Response(text=f"version {st.version}\n")

    async def metrics(_: web.Request) -> web.StreamResponse:
        text = await run("status", render_metrics, service, more_metrics)
        return web.Response(text=text, content_type="text/plain")

    async def shutdown(_: web.Application) -> None:
        for pool in pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    open_paths = OPEN_PATHS | (PEER_PATHS if donor is not None else frozenset())
    app = web.Application(middlewares=[guard(token, STATUS, open_paths=open_paths,
                                             wire=AGENT_API)], client_max_size=1 << 20)
    app.on_cleanup.append(shutdown)
    app.add_routes([
        *(route(call) for call in AgentApi.calls()),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
    ])
    if donor is not None:
        app.add_routes(peer_routes(*donor))
    return app


def render_metrics(service: AgentService,
                   more: Callable[[], list[Family]] | None = None) -> str:
    """Prometheus text exposition of the agent's counters and gauges, and ``more``'s."""
    st, c = service.snapshot(), service.counters
    return render([*(more() if more else ()),
        Family("dcr_agent_version", "gauge", "Version the weights hold (-1: none).",
               [({}, -1 if st.version is None else st.version)]),
        Family("dcr_agent_gate_open", "gauge", "1 while generation requests may pass.",
               [({}, int(st.gate_open))]),
        Family("dcr_agent_staged_bytes", "gauge", "Payload bytes staged and not yet applied.",
               [({}, st.bytes_staged)]),
        Family("dcr_agent_payloads_applied_total", "counter", "Payloads applied in place.",
               [({}, c.payloads_applied)]),
        Family("dcr_agent_payload_bytes_applied_total", "counter", "Payload bytes applied.",
               [({}, c.payload_bytes_applied)]),
        Family("dcr_agent_apply_seconds_total", "counter", "Seconds inside the applier.",
               [({}, round(c.apply_seconds, 6))]),
        Family("dcr_agent_attempts_total", "counter", "Attempts ended, by outcome.",
               [({"outcome": k}, v) for k, v in sorted(c.attempts.items())]),
        Family("dcr_agent_dense_loads_total", "counter", "Dense refits (rejoins).",
               [({}, c.dense_loads)]),
        Family("dcr_agent_store_bytes_fetched_total", "counter", "Bytes read from the store "
               "to build versions for dense refits (history, manifests, payloads, snapshots).",
               [({}, c.store_bytes_fetched)]),
        Family("dcr_agent_peer_bytes_fetched_total", "counter", "Bytes of peers' copies "
               "taken into builds (checked by the history's fingerprints).",
               [({}, service.store.peer_bytes if service.store else 0)]),
        Family("dcr_agent_peer_refusals_total", "counter", "Peers' copies refused: not "
               "lent, or not what the history vouches for.",
               [({}, service.store.peer_refusals if service.store else 0)]),
        Family("dcr_agent_waits", "gauge", "Staged and flush waits in progress.",
               [({}, service.waits)]),
    ])
