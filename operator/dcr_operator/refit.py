"""One WeightRefit, driven to its end: the coordinator over Kubernetes parties.

:class:`RefitRun` (the WeightRefit daemon's thread) validates the refit against the commit
record, takes the fleet, runs :class:`dcr.protocol.coordinator.Coordinator` with the agents,
the encoder owners and :class:`~dcr_operator.commitstore.FleetCommitStore`, and records the
outcome. Every attempt after a refit's first runs in overwrite mode, across operator restarts
too. docs/operator.md, "What happens, and when things go wrong".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError

from dcr.errors import ConfigError, ManifestError, StoreError, first_validation_error
from dcr.format.manifest import limits_for
from dcr.format.payload import Mode
from dcr.format.profile import ReceiverProfile, dumps, merge
from dcr.protocol.agent_api import AgentApi, AgentClient
from dcr.protocol.commitstore import CommitStoreError
from dcr.protocol.coordinator import (
    CommitConflict,
    CommitUnknown,
    Coordinator,
    CoordinatorSettings,
    OwnerHandle,
    RefitAborted,
    RefitFailed,
)
from dcr.protocol.owner_endpoints import OwnerEndpointFailed, OwnerEndpoints
from dcr.protocol.records import Attempt, CommitRecord
from dcr.protocol.states import AttemptOutcome, Phase
from dcr.transport.store import Store
from dcr_operator.api.conditions import RefitCondition, RefitReason
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.commitstore import FleetCommitStore
from dcr_operator.endpoint import (
    EncoderEndpoints,
    EndpointOwner,
    encoder_endpoint,
    store_of,
)
from dcr_operator.errors import (
    ApiError,
    ApiUnreachable,
    Conflict,
    InvalidResource,
    NotFound,
    NotYet,
)
from dcr_operator.fleet import (
    AGENT_CALLS,
    check_job_secrets,
    clients,
    discover,
    encoder_token,
    fleet_path,
    refresh,
    set_active,
)
from dcr_operator.fleetrecord import commit_status, record_of
from dcr_operator.history import fleet_history, keep_history
from dcr_operator.jobs import (
    PROFILE_KEY,
    EncoderJobs,
    JobOwner,
    copy_profile,
    delete_profile_copy,
    encoder_pod,
    profile_name,
    snapshot_job_manifest,
)
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.metrics import METRICS
from dcr_operator.progress import Emit, Recorder, TrackedReceiver
from dcr_operator.ranksnap import rank_snapshot
from dcr_operator.reconcile import Verdict, agent_failure, is_final, now, parse_time, validate
from dcr_operator.settings import OperatorSettings
from dcr_operator.sites import Site, encoder_site, owner_reference

log = logging.getLogger(__name__)

_ACTIVE: dict[tuple[str, str], str] = {}
_ACTIVE_LOCK = threading.Lock()


@contextlib.contextmanager
def claim(namespace: str, fleet: str, refit: str) -> Iterator[None]:
    """Hold the fleet for ``refit``; NotYet if another refit of this operator holds it."""
    key = (namespace, fleet)
    with _ACTIVE_LOCK:
        holder = _ACTIVE.get(key)
        if holder is not None and holder != refit:
            raise NotYet(f"RolloutFleet {fleet} is busy with WeightRefit {holder}.")
        _ACTIVE[key] = refit
    try:
        yield
    finally:
        with _ACTIVE_LOCK:
            if _ACTIVE.get(key) == refit:
                del _ACTIVE[key]


def holder(namespace: str, fleet: str) -> str | None:
    """The WeightRefit this operator is running on the fleet, if any."""
    with _ACTIVE_LOCK:
        return _ACTIVE.get((namespace, fleet))


def _parse(model: type[Any], data: Any, what: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise InvalidResource(f"{what}: spec.{first_validation_error(e)}.") from e


class RefitRun:
    """Drive WeightRefit ``refit`` (the object as last read) to Committed or Failed."""

    def __init__(self, kube: KubeClient, refit: Mapping[str, Any], *,
                 settings: OperatorSettings, emit: Emit,
                 clock: Callable[[], str] = now) -> None:
        self.kube, self.refit, self.settings, self.emit, self.clock = (
            kube, refit, settings, emit, clock)
        meta = refit["metadata"]
        self.namespace, self.name = meta["namespace"], meta["name"]
        self.fleet = str((refit.get("spec") or {}).get("fleet", ""))  # as written: metrics
        self.stop_reason: str | None = None
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._coordinator: Coordinator | None = None
        self._site: Site | None = None

    def site(self, spec: WeightRefitSpec, fleet_spec: RolloutFleetSpec) -> Site:
        """Where this refit's Jobs run (read once per run: the kubeconfig is a Secret's)."""
        if self._site is None:
            self._site = encoder_site(self.kube, self.namespace,
                                      encoder_pod(spec, fleet_spec, spec.fleet, self.settings))
        return self._site

    def _snapshot(self, spec: WeightRefitSpec, fleet_spec: RolloutFleetSpec,
                  committed: CommitRecord, owners: list[OwnerHandle], store: Store) -> None:
        """Have the snapshot of the version just committed written: by the owner
        endpoints from memory where they are ranks (on a thread of its own), else by a
        Job (:mod:`dcr_operator.ranksnap`)."""
        endpoints = next((o.endpoints for o in owners if isinstance(o, EndpointOwner)), None)
        if endpoints is None:
            self._snapshot_job(spec, fleet_spec)
            return
        threading.Thread(target=self._snapshot_from_ranks, daemon=True,
                         name=f"snapshot-{self.name}",
                         args=(spec, fleet_spec, endpoints, committed, store)).start()

    def _snapshot_from_ranks(self, spec: WeightRefitSpec, fleet_spec: RolloutFleetSpec,
                             endpoints: OwnerEndpoints, committed: CommitRecord,
                             store: Store) -> None:
        try:
            if rank_snapshot(endpoints, committed, store) is not None:
                return
        except (OwnerEndpointFailed, StoreError, ManifestError) as e:
            log.warning("%s: the ranks wrote no snapshot of version %s: %s", self.name,
                        committed.committed_version, e)
            return
        self._snapshot_job(spec, fleet_spec)

    def _snapshot_job(self, spec: WeightRefitSpec, fleet_spec: RolloutFleetSpec) -> None:
        """Start the Job that writes a snapshot of the version just committed. Best
        effort: the commit stands, and a missing snapshot only makes catch-up longer."""
        site = self.site(spec, fleet_spec)
        body = snapshot_job_manifest(refit=self.refit, spec=spec, fleet=fleet_spec,
                                     fleet_name=spec.fleet, settings=self.settings, site=site)
        try:
            site.kube.create(api_path("batch", "v1", "jobs", site.namespace), body)
        except Conflict:
            return  # a refit that finishes again: its Job exists
        except (ApiError, ApiUnreachable) as e:
            log.warning("%s: the snapshot Job of version %s was not created: %s", self.name,
                        spec.target_version, e)
            return
        log.info("%s: created snapshot Job %s in %s for version %s", self.name,
                 body["metadata"]["name"], site, spec.target_version)

    def stop(self, reason: str) -> None:
        """No further attempt starts (the one running finishes or fails on its own)."""
        self.stop_reason = reason
        self._stop.set()
        if self._coordinator is not None:
            self._coordinator.abort.set()

    def run(self) -> str:
        """The refit's phase when done; raises NotYet to be called again later."""
        status = self.refit.get("status") or {}
        if is_final(status.get("phase")):
            return str(status["phase"])
        what = f"WeightRefit {self.namespace}/{self.name}"
        spec: WeightRefitSpec = _parse(WeightRefitSpec, self.refit.get("spec"), what)
        # Overwrite when the policy says so, and for every attempt after a failed one
        # (docs/protocol.md), including those a restarted operator or a retry makes.
        prior = len(status.get("attempts") or [])
        forced: Mode | None = ("overwrite" if spec.mode_policy == "Overwrite" or prior
                               else None)
        rec = Recorder(self.kube, self.refit, emit=self.emit, clock=self.clock,
                       forced_mode=forced)
        try:
            fleet = self.kube.get(fleet_path(self.namespace, spec.fleet))
        except NotFound:
            msg = f"RolloutFleet {self.namespace}/{spec.fleet} does not exist (yet)."
            rec.set(RefitCondition.VALIDATED, False, RefitReason.FLEET_NOT_FOUND, msg,
                    event="Waiting")
            rec.flush()
            raise NotYet(msg) from None
        fleet_spec: RolloutFleetSpec = _parse(RolloutFleetSpec, fleet.get("spec"),
                                              f"RolloutFleet {self.namespace}/{spec.fleet}")
        record = record_of(fleet)
        verdict = validate(self.name, spec, spec.fleet, record,
                           created=self.refit["metadata"].get("creationTimestamp"),
                           at=self.clock())
        if verdict.action == "reject":
            return self._fail(rec, verdict.reason, verdict.message, validated=False)
        if verdict.action == "wait":
            rec.set(RefitCondition.VALIDATED, False, verdict.reason, verdict.message,
                    event="Waiting")
            rec.flush()
            raise NotYet(verdict.message)
        if verdict.action == "run":
            self._admit_encoder(spec, fleet_spec, rec)
        rec.set(RefitCondition.VALIDATED, True, verdict.reason, verdict.message, event="Validated")
        rec.flush()
        with claim(self.namespace, spec.fleet, self.name):
            set_active(self.kube, self.namespace, spec.fleet, self.name)
            try:
                phase = self._drive(spec, fleet, fleet_spec, record, verdict, rec, forced)
            finally:
                self._refresh_fleet(fleet, rec)
        if self._site is not None:  # no further Job of this refit mounts it
            try:
                delete_profile_copy(self._site, self.refit)
            except (ApiError, ApiUnreachable) as e:
                log.warning("%s: the receiver profile in %s was not deleted: %s", self.name,
                            self._site, e)
        return phase

    def _admit_encoder(self, spec: WeightRefitSpec, fleet_spec: RolloutFleetSpec,
                       rec: Recorder) -> None:
        """InvalidResource, and Validated=False saying why, unless the encoder pods may run.

        What they may be (the fleet's profile, an image the operator allows) and carry
        (Secrets that opted in) is the fleet's and the operator's to say, never the
        WeightRefit's; either can be fixed without touching the refit.
        """
        reason = RefitReason.ENCODER_PROFILE_REFUSED
        try:
            endpoint = encoder_endpoint(spec, fleet_spec, spec.fleet)
            site = self.site(spec, fleet_spec)  # the operator may use its kubeconfig
            reason = RefitReason.SECRET_NOT_OPTED_IN
            check_job_secrets(site.kube, site.namespace, fleet_spec)
            if endpoint is not None:
                encoder_token(self.kube, self.namespace, endpoint.token_secret_ref)
        except InvalidResource as e:
            rec.set(RefitCondition.VALIDATED, False, reason, str(e), event=reason, warning=True)
            rec.flush()
            raise

    # --- the refit -----------------------------------------------------------------

    def _drive(self, spec: WeightRefitSpec, fleet: Mapping[str, Any],
               fleet_spec: RolloutFleetSpec, record: CommitRecord, verdict: Verdict,
               rec: Recorder, forced: Mode | None) -> str:
        found = discover(self.kube, self.namespace, fleet_spec)
        need = fleet_spec.commit_policy.receivers_needed(len(found))
        if not found or len(found) < need:
            msg = (f"RolloutFleet {spec.fleet} has {len(found)} Running receivers; "
                   f"{max(need, 1)} are required.")
            rec.set(RefitCondition.APPLYING, False, RefitReason.WAITING_FOR_RECEIVERS, msg,
                    event="Waiting")
            rec.flush()
            raise NotYet(msg)
        agents = clients(self.kube, self.namespace, fleet_spec, found)
        remaining = fleet_spec.retry_limit - rec.previous_attempts()
        if verdict.action == "run" and remaining < 1:
            return self._fail(rec, RefitReason.RETRY_LIMIT_REACHED,
                              f"{rec.previous_attempts()} attempts made; the fleet's "
                              f"retryLimit is {fleet_spec.retry_limit}.")
        owners = self._owners(spec, fleet_spec, record, verdict, rec, forced, agents, need)
        store = FleetCommitStore(self.kube, self.namespace, spec.fleet, refit=self.name,
                                 clock=self.clock)

        def dense(version: int) -> str:
            if version != record.committed_version:
                raise ConfigError(f"No dense checkpoint of version {version} is known; the "
                                  f"committed one is {record.committed_version}.")
            return record.baseline_id

        # A fleet with a store (a relay fleet's beside its relay too) rejoins its receivers
        # from the store's history, which this coordinator writes after each commit; a
        # relay fleet without one dense-loads the committed checkpoint, which its agents
        # refuse unless they committed it themselves (nothing else can check it).
        history = fleet_history(self.kube, self.namespace, fleet_spec)
        if history is not None and verdict.action == "run":
            # Manifest parts are read with what the fleet's receivers can use, never more.
            tensors = len(self._merged_profile(agents, need)[1].tensors)
            history.limits = limits_for(tensors)

        def recorded(committed: CommitRecord, owner_count: int) -> None:
            assert history is not None  # the coordinator wrote its history just before
            keep_history(self.kube, self.namespace, spec.fleet, fleet_spec, history)
            every = fleet_spec.retention.snapshot_every
            if every and committed.committed_version % every == 0:
                self._snapshot(spec, fleet_spec, committed, owners, history.store)

        def started(attempt: Attempt) -> None:
            assert self._coordinator is not None
            rec.attempt_started(attempt, self._coordinator.history)

        tracked = [TrackedReceiver(a, rec, started, forced_mode=forced) for a in agents]
        policy = fleet_spec.commit_policy
        coordinator = Coordinator(
            store, owners, tracked, dense_checkpoint=None if history else dense,
            on_commit=recorded if history else None, history=history,
            settings=CoordinatorSettings(
                max_attempts=max(1, remaining), gate="sync" if policy.gate == "Sync" else "async",
                attempt_timeout_s=float(policy.attempt_timeout_seconds), min_receivers=need))
        self._coordinator = coordinator
        if self._stop.is_set():
            coordinator.abort.set()
        timer = self._deadline_timer(spec)
        METRICS.refit_started()
        try:
            committed = coordinator.refit(spec.target_version, spec.source.checkpoint)
        except CommitConflict as e:
            return self._fail(rec, RefitReason.COMMIT_CONFLICT, str(e))
        except RefitAborted as e:
            if self.stop_reason == "deadline":
                return self._fail(rec, RefitReason.DEADLINE_EXCEEDED, str(e))
            raise NotYet(f"Refit stopped ({self.stop_reason}): {e}") from e
        except RefitFailed as e:
            if len(coordinator.history) < coordinator.settings.max_attempts:
                rec.set(RefitCondition.APPLYING, False, RefitReason.WAITING_FOR_RECEIVERS, str(e),
                        event="Waiting")
                raise NotYet(str(e)) from e  # admission: too few receivers took part
            return self._fail(rec, RefitReason.RETRY_LIMIT_REACHED, str(e))
        except (CommitStoreError, CommitUnknown, ApiError, ApiUnreachable) as e:
            raise NotYet(f"Kubernetes API: {e}") from e
        except (ManifestError, StoreError) as e:  # every gate is settled: retried later
            raise NotYet(f"The store's history: {e}") from e
        finally:
            METRICS.refit_stopped()
            if timer is not None:
                timer.cancel()
            coordinator.close()
            rec.sync(coordinator.history)
            rec.flush()
        return self._committed(rec, spec, committed, fleet)

    def _owners(self, spec: WeightRefitSpec, fleet_spec: RolloutFleetSpec,
                record: CommitRecord, verdict: Verdict, rec: Recorder, forced: Mode | None,
                agents: list[AgentClient], need: int) -> list[OwnerHandle]:
        """One owner handle per encoder index: a warm endpoint's, or an encoder Job's.

        Either way, what a previous operator left running for this refit's attempts
        stops first (its Job deleted, its publishes stopped): those attempts are obsolete.
        """
        run = verdict.action == "run"
        endpoint = encoder_endpoint(spec, fleet_spec, spec.fleet) if run else None
        if endpoint is None:
            jobs = EncoderJobs(
                site=self.site(spec, fleet_spec), refit=self.refit, spec=spec, fleet=fleet_spec,
                fleet_name=spec.fleet, base_checkpoint=record.baseline_id,
                settings=self.settings, forced_mode=forced,
                profile=self._profile(agents, need, self.site(spec, fleet_spec))[0]
                if run else None,
                on_created=rec.job_created, on_finished=rec.job_finished)
            if run:
                for job in jobs.delete_unfinished():
                    log.info("%s: deleted encoder Job %s of an obsolete attempt", self.name,
                             job)
            return [JobOwner(jobs=jobs, index=k) for k in range(spec.encoder.owners)]
        endpoints = EncoderEndpoints(
            profile_name=spec.encoder.profile, endpoint=endpoint,
            token=encoder_token(self.kube, self.namespace, endpoint.token_secret_ref),
            spec=spec, base_checkpoint=record.baseline_id, base_attempt=record.attempt,
            store=store_of(fleet_spec),
            profile=self._profile(agents, need)[1], forced_mode=forced,
            on_started=rec.endpoint_started, on_finished=rec.endpoint_finished)
        left = [a["id"] for a in (self.refit.get("status") or {}).get("attempts") or []
                if a.get("outcome") == AttemptOutcome.RUNNING]
        endpoints.stop(left)  # a previous operator's attempts: obsolete now
        return [EndpointOwner(endpoints=endpoints, index=k)
                for k in range(spec.encoder.owners)]

    def _committed(self, rec: Recorder, spec: WeightRefitSpec, record: CommitRecord,
                   fleet: Mapping[str, Any]) -> str:
        rec.committed_by(record.attempt)
        st = rec.status()
        msg = (f"RolloutFleet {spec.fleet} committed version {record.committed_version} "
               f"(attempt {record.attempt}) after {st['attemptCount']} attempts; "
               f"{st['bytes']} payload bytes applied.")
        rec.set(RefitCondition.APPLYING, False, RefitReason.COMMITTED, msg)
        rec.set(RefitCondition.ENCODING, False, RefitReason.COMMITTED, msg)
        rec.set(RefitCondition.FAILED, False, RefitReason.COMMITTED, msg)
        rec.set(RefitCondition.COMMITTED, True, RefitReason.COMMITTED, msg,
                event=RefitReason.COMMITTED)
        rec.finish(committed=commit_status(record, refit=self.name),
                   completionTime=self.clock())
        rec.flush()
        METRICS.refit_committed(namespace=self.namespace, fleet=spec.fleet,
                                version=record.committed_version,
                                seconds=time.monotonic() - self._started,
                                payload_bytes=int(st["bytes"]), at=time.time())
        self.emit(fleet, "Normal", "Committed", f"Version {record.committed_version} "
                  f"committed by WeightRefit {self.name} (attempt {record.attempt}).")
        return Phase.COMMITTED

    def _fail(self, rec: Recorder, reason: str, message: str, *,
              validated: bool = True) -> str:
        if not validated:
            rec.set(RefitCondition.VALIDATED, False, reason, message)
        rec.set(RefitCondition.APPLYING, False, reason, message)
        rec.set(RefitCondition.ENCODING, False, reason, message)
        rec.set(RefitCondition.FAILED, True, reason, message, event="RefitFailed", warning=True)
        rec.finish(completionTime=self.clock())
        rec.flush()
        METRICS.refit_failed(namespace=self.namespace, fleet=self.fleet, reason=reason)
        return Phase.FAILED

    def _profile(self, agents: list[AgentClient], need: int, site: Site | None = None
                 ) -> tuple[str, ReceiverProfile]:
        """The ConfigMap with the receivers' merged profile (made once per refit, in the
        refit's namespace, and copied to ``site`` when the Jobs that mount it run in
        another cluster), and that profile (a warm encoder gets it in its request)."""
        name, merged = self._merged_profile(agents, need)
        if site is not None:
            copy_profile(site, self.refit, dumps(merged))
        return name, merged

    def _merged_profile(self, agents: list[AgentClient], need: int
                        ) -> tuple[str, ReceiverProfile]:
        name = profile_name(self.name)
        path = api_path("", "v1", "configmaps", self.namespace)
        with contextlib.suppress(NotFound):
            found = self.kube.get(api_path("", "v1", "configmaps", self.namespace, name))
            try:
                return name, ReceiverProfile.model_validate_json(
                    (found.get("data") or {}).get(PROFILE_KEY, ""))
            except ValidationError as e:
                raise InvalidResource(f"ConfigMap {self.namespace}/{name} does not hold a "
                                      f"receiver profile: {first_validation_error(e)}; "
                                      "delete it to have it made again.") from e
        def ask(a: AgentClient) -> ReceiverProfile | str:
            try:
                return ReceiverProfile.model_validate(a.profile())
            except Exception as e:  # an agent that cannot answer does not vote
                return agent_failure(a.name, AgentApi.profile, e)

        profiles, sources, errors = [], [], []
        with ThreadPoolExecutor(max(1, min(AGENT_CALLS, len(agents)))) as pool:
            for a, got in zip(agents, pool.map(ask, agents), strict=True):
                if isinstance(got, str):
                    errors.append(got)
                else:
                    profiles.append(got)
                    sources.append(a.name)
        if len(profiles) < max(1, need):
            raise NotYet(f"Receiver profiles from {len(profiles)} of {len(agents)} agents; "
                         f"{need} needed: {'; '.join(errors)}")
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "dcr-operator"},
                             "annotations": {"dcr.dev/receivers": ",".join(sources)},
                             "ownerReferences": [owner_reference(self.refit)]},
                "data": {PROFILE_KEY: dumps(merged := merge(profiles))}}
        with contextlib.suppress(Conflict):
            self.kube.create(path, body)
        return name, merged

    def _deadline_timer(self, spec: WeightRefitSpec) -> threading.Timer | None:
        created = self.refit["metadata"].get("creationTimestamp")
        if spec.deadline_seconds is None or not created:
            return None
        left = (parse_time(created).timestamp() + spec.deadline_seconds) - time.time()
        timer = threading.Timer(max(0.0, left), self.stop, args=("deadline",))
        timer.daemon = True
        timer.start()
        return timer

    def _refresh_fleet(self, fleet: Mapping[str, Any], rec: Recorder) -> None:
        acks = {n: r["lastAck"] for n, r in rec.receivers.items() if r.get("lastAck")}
        try:
            refresh(self.kube, fleet, clock=self.clock, active=None, acks=acks)
        except Exception as e:  # the operator's fleet poll writes it again later
            log.warning("could not refresh RolloutFleet %s status: %s",
                        fleet["metadata"]["name"], e)
            set_active(self.kube, self.namespace, fleet["metadata"]["name"], None)
