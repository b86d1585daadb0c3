"""The kopf handlers: what the operator does when RolloutFleets and WeightRefits change.

Each unfinished WeightRefit is a daemon running :class:`~dcr_operator.refit.RefitRun`; each
fleet's status is refreshed by its own poll (:class:`~dcr_operator.polls.FleetPolls`). Why
daemons, why so few finalizers: docs/operator.md, "Inside the operator"; before
uninstalling: its "Uninstall".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, cast

import kopf

from dcr_operator import metrics
from dcr_operator.api.common import GROUP, VERSION
from dcr_operator.api.rolloutfleet import PLURAL as FLEET_PLURAL
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.api.weightrefit import PLURAL as REFIT_PLURAL
from dcr_operator.cleanup import clean_refit_store, delete_refit_jobs
from dcr_operator.commitmap import publish_commit
from dcr_operator.commitstore import FleetCommitStore
from dcr_operator.errors import ApiError, ApiUnreachable, InvalidResource, NotFound, NotYet
from dcr_operator.fleet import fleet_path, prune_refits, refresh
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.peers import publish_peers
from dcr_operator.polls import FleetPolls
from dcr_operator.progress import Emit
from dcr_operator.reconcile import is_final, now
from dcr_operator.refit import RefitRun, holder
from dcr_operator.settings import OperatorSettings

log = logging.getLogger(__name__)

SETTINGS = OperatorSettings.from_env(os.environ)
FINALIZER = f"{GROUP}/cleanup"
_RUNS: dict[str, RefitRun] = {}  # WeightRefit uid -> its run in this process


def connection(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    info = (kopf.login_with_service_account(settings=settings)
            or kopf.login_with_kubeconfig(settings=settings))
    if info is None:
        raise kopf.LoginError("No ServiceAccount token and no kubeconfig ($KUBECONFIG) found.")
    return info


def emit(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event on ``obj`` (kopf posts it from its event loop); best effort."""
    try:
        kopf.event(cast(kopf.Body, dict(obj)), type=type_, reason=reason,
                   message=message[:1024])
    except Exception as e:  # an Event is never worth failing a refit for
        log.warning("could not emit %s event %s on %s: %s", type_, reason,
                    obj.get("metadata", {}).get("name"), e)


def emitter(context: contextvars.Context) -> Emit:
    """``emit`` for any thread (the coordinator's pool too): kopf's context travels along.

    Each call runs in a fresh copy of ``context``: one Context cannot be entered by two
    threads at once.
    """
    def emit_anywhere(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        context.copy().run(emit, obj, type_, reason, message)

    return emit_anywhere


async def _blocking(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


def _kube(memo: Any) -> KubeClient:
    kube: KubeClient = memo.kube
    return kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.peering.lifetime = SETTINGS.peering_lifetime_seconds
    memo.kube = KubeClient()
    log.info("DCR operator settings: %s", SETTINGS)


CRDS_SERVED_WAIT_S = 300.0  # how long startup waits for the API server to list the CRDs


@kopf.on.startup()
async def wait_until_the_crds_are_served(memo: kopf.Memo, **_: Any) -> None:
    """kopf looks its resources up once, after the startup handlers, and never again
    without the right to watch CustomResourceDefinitions, which the operator does not
    have: one that started while the API server restarted, before its discovery listed
    dcr.dev, served nothing for ever. So startup waits until the discovery lists both
    resources, and past ``CRDS_SERVED_WAIT_S`` fails, so that the Pod restarts."""
    kube = _kube(memo)
    wanted, path = {FLEET_PLURAL, REFIT_PLURAL}, f"/apis/{GROUP}/{VERSION}"
    deadline = asyncio.get_running_loop().time() + CRDS_SERVED_WAIT_S
    while True:
        try:
            listed = await asyncio.to_thread(kube.get, path)
            missing = wanted - {r.get("name") for r in listed.get("resources", [])}
            why = f"{path} lists no {', '.join(sorted(missing))}"
        except (ApiError, ApiUnreachable) as e:
            missing, why = wanted, str(e)
        if not missing:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise kopf.PermanentError(f"The API server does not serve the DCR resources after "
                                      f"{CRDS_SERVED_WAIT_S:g} s: {why}.")
        log.info("waiting for the API server to serve the DCR resources: %s", why)
        await asyncio.sleep(1.0)


@kopf.on.startup()
async def start_metrics(memo: kopf.Memo, **_: Any) -> None:
    memo.metrics = (await metrics.serve("0.0.0.0", SETTINGS.metrics_port)
                    if SETTINGS.metrics_port else None)


@kopf.on.cleanup()
async def stop_metrics(memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "metrics", None) is not None:
        await memo.metrics.cleanup()


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    return connection(settings)


# --- RolloutFleet ---------------------------------------------------------------------


@kopf.on.create(GROUP, VERSION, FLEET_PLURAL, id="fleet")
@kopf.on.resume(GROUP, VERSION, FLEET_PLURAL, id="fleet")
@kopf.on.update(GROUP, VERSION, FLEET_PLURAL, id="fleet", field="spec")
async def fleet_changed(body: kopf.Body, memo: Any, namespace: str | None, name: str,
                        **_: Any) -> None:
    assert namespace is not None  # the CRDs are namespaced
    kube = _kube(memo)
    try:
        RolloutFleetSpec.model_validate(dict(body["spec"]))
    except ValueError as e:
        emit(body, "Warning", "InvalidSpec", f"RolloutFleet {name}: {e}")
        raise kopf.PermanentError(f"RolloutFleet {namespace}/{name}: {e}") from e
    try:
        store = FleetCommitStore(kube, namespace, name)
        had = (body.get("status") or {}).get("commit")
        record = await _blocking(store.initialize)
        if not had:
            emit(body, "Normal", "Initialized", f"Commit record at version "
                 f"{record.committed_version} ({record.baseline_id}).")
        # After the refresh in flight, if any: updates never pile threads up on one fleet.
        await _polls(memo).run_one((namespace, name), lambda: _refresh_fleet(kube, body))
    except (ApiError, ApiUnreachable) as e:
        raise kopf.TemporaryError(str(e), delay=SETTINGS.retry_seconds) from e


def _refresh_fleet(kube: KubeClient, fleet: Mapping[str, Any], *, fresh: bool = False) -> None:
    """The fleet's status, refits, commit ConfigMap and peers put right; ``fresh``: ``fleet``
    was read just now, so none of them reads it again (:func:`~dcr_operator.fleet.refresh`)."""
    meta = fleet["metadata"]
    refresh(kube, fleet, clock=now, active=holder(meta["namespace"], meta["name"]),
            fresh=fresh)
    prune_refits(kube, fleet, at=now())
    try:  # what a failed or lost publish at the commit left behind
        publish_commit(kube, meta["namespace"], meta["name"], fleet=fleet)
    except (ApiError, ApiUnreachable, InvalidResource) as e:
        log.warning("RolloutFleet %s/%s: its commit is not published to its pods: %s",
                    meta["namespace"], meta["name"], e)
    try:  # spec.catchUp.peers: the peer token Secret and the peers' Service
        publish_peers(kube, fleet)
    except (ApiError, ApiUnreachable, InvalidResource) as e:
        log.warning("RolloutFleet %s/%s: its pods are not given their peers: %s",
                    meta["namespace"], meta["name"], e)


@kopf.index(GROUP, VERSION, FLEET_PLURAL)
def fleets(namespace: str | None, name: str, **_: Any) -> dict[tuple[str, str], bool]:
    """Every RolloutFleet kopf serves here (an index needs no finalizer; a timer would)."""
    assert namespace is not None
    return {(namespace, name): True}


def _polls(memo: Any) -> FleetPolls:
    polls: FleetPolls = memo.polls
    return polls


def _poll_fleet(kube: KubeClient, namespace: str, name: str) -> None:
    """One poll of a fleet: read it (once) and refresh its status."""
    try:
        fleet = kube.get(fleet_path(namespace, name))
    except NotFound:  # deleted since it was indexed
        metrics.METRICS.fleet_deleted(namespace=namespace, fleet=name)
        return
    _refresh_fleet(kube, fleet, fresh=True)


@kopf.on.startup()
async def start_fleet_polls(memo: kopf.Memo, **kwargs: Any) -> None:
    """Poll every indexed fleet on its own schedule, every ``fleet_status_seconds``.

    The index fills while kopf serves, so a standby paused from its start polls nothing.
    One that served and was then paused behind a peer of higher priority keeps polling
    the fleets it knew, reporting no refit running on them (it runs none), until it
    restarts; the chart runs one replica. A fleet gone from the index stops being polled
    and its metrics go with it; one fleet's failure or slowness never holds another's.
    """
    index: kopf.Index[tuple[str, str], bool] = kwargs["fleets"]  # kopf passes indices by id
    kube = _kube(memo)
    memo.polls = FleetPolls(functools.partial(_poll_fleet, kube),
                            interval_s=SETTINGS.fleet_status_seconds,
                            forget=metrics.METRICS.keep_fleets)
    memo.fleet_polls = asyncio.create_task(memo.polls.run(lambda: list(index)))


@kopf.on.cleanup()
async def stop_fleet_polls(memo: kopf.Memo, **_: Any) -> None:
    task: asyncio.Task[None] | None = getattr(memo, "fleet_polls", None)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- WeightRefit ----------------------------------------------------------------------


def _unfinished(status: Mapping[str, Any], **_: Any) -> bool:
    return not is_final(status.get("phase"))


def _has_cleanup(status: Mapping[str, Any], **_: Any) -> bool:
    """Work for the finalizer: a run to stop, or attempts whose objects the store may hold."""
    return _unfinished(status) or (SETTINGS.cleanup_store and bool(status.get("attempts")))


@kopf.daemon(GROUP, VERSION, REFIT_PLURAL, id="refit", when=_unfinished,
             cancellation_timeout=10.0)
async def refit_daemon(memo: Any, namespace: str | None, name: str, uid: str,
                       stopped: kopf.DaemonStopped, **_: Any) -> str:
    assert namespace is not None
    kube = _kube(memo)
    path = api_path(GROUP, VERSION, REFIT_PLURAL, namespace, name)
    try:
        fresh = await _blocking(kube.get, path)
    except NotFound:
        return "Deleted"
    except (ApiError, ApiUnreachable) as e:
        raise kopf.TemporaryError(str(e), delay=SETTINGS.retry_seconds) from e
    context = contextvars.copy_context()  # kopf.event needs kopf's context vars
    run = RefitRun(kube, fresh, settings=SETTINGS, emit=emitter(context))
    _RUNS[uid] = run
    loop = asyncio.get_running_loop()
    done: asyncio.Future[str] = loop.create_future()

    def target() -> None:
        try:
            result = context.copy().run(run.run)
        except BaseException as e:
            loop.call_soon_threadsafe(_settle, done, None, e)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    # A daemon thread: an operator that exits mid-attempt leaves it, as a crash would;
    # the next operator resumes from the commit record.
    threading.Thread(target=target, name=f"refit-{namespace}-{name}", daemon=True).start()
    stop: asyncio.Future[Any] = asyncio.ensure_future(stopped.wait())
    waiting: set[asyncio.Future[Any]] = {done, stop}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            run.stop(str(stopped.reason))
            # A run that just reached Committed or Failed (which stops the daemon through
            # its filter) is only writing its last status: let it finish.
            await asyncio.wait({done}, timeout=5.0)
        if not done.done():
            log.info("%s/%s: stopping (%s); the attempt in flight ends on its own",
                     namespace, name, stopped.reason)
            return "Stopped"
        return _result(done, name)
    finally:
        stop.cancel()
        if _RUNS.get(uid) is run and done.done():
            del _RUNS[uid]


def _settle(fut: asyncio.Future[str], result: str | None, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result or "")


def _result(done: asyncio.Future[str], name: str) -> str:
    try:
        return done.result()
    except NotYet as e:
        raise kopf.TemporaryError(str(e), delay=SETTINGS.retry_seconds) from e
    except (InvalidResource, ApiError, ApiUnreachable) as e:
        raise kopf.TemporaryError(str(e), delay=3 * SETTINGS.retry_seconds) from e
    except Exception as e:
        log.exception("WeightRefit %s: unexpected failure", name)
        raise kopf.TemporaryError(f"{type(e).__name__}: {e}",
                                  delay=3 * SETTINGS.retry_seconds) from e


@kopf.on.delete(GROUP, VERSION, REFIT_PLURAL, id="cleanup", when=_has_cleanup)
async def refit_deleted(body: kopf.Body, memo: Any, namespace: str | None, name: str,
                        uid: str, runtime: dt.timedelta, **_: Any) -> None:
    assert namespace is not None
    run = _RUNS.pop(uid, None)
    if run is not None:
        run.stop("deleted")
    kube = _kube(memo)
    try:
        await _blocking(delete_refit_jobs, kube, dict(body), emit=emit)
        if SETTINGS.cleanup_store:
            await _blocking(clean_refit_store, kube, dict(body), emit=emit)
    except Exception as e:
        if runtime.total_seconds() > SETTINGS.cleanup_give_up_seconds:
            emit(body, "Warning", "CleanupAbandoned", f"Gave up cleaning up after "
                 f"{runtime.total_seconds():.0f} s: {e}")
            return
        raise kopf.TemporaryError(f"Cleanup of WeightRefit {name}: {e}",
                                  delay=SETTINGS.retry_seconds) from e
