"""Warm encoders: owner handles that call a long-running ``dcr encoder`` per attempt.

When a refit's encoder profile has an ``endpoint``, owner ``k`` is :class:`EndpointOwner`,
which asks ``urls[k]`` to publish with a Job's arguments (:mod:`dcr.protocol.encoder_api`).
The token goes in the Authorization header only, no redirect is followed, and one owner's
failure stops the attempt on every endpoint. docs/publishing.md, "Warm encoder".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from dcr.format.payload import Mode
from dcr.format.profile import ReceiverProfile
from dcr.protocol.encoder_api import EncoderClient, EncoderError, PublishRequest
from dcr.protocol.records import Attempt, CommitRecord
from dcr_operator.api.rolloutfleet import EncoderEndpoint, RolloutFleetSpec
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.errors import EncoderEndpointFailed, InvalidResource
from dcr_operator.reconcile import remote_failure

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0  # how long a stop waits for an encoder's publishes of the attempt


def encoder_endpoint(spec: WeightRefitSpec, fleet: RolloutFleetSpec, fleet_name: str
                     ) -> EncoderEndpoint | None:
    """The warm encoders of the profile the refit names (None: it runs encoder Jobs).

    InvalidResource when the refit's ``spec.encoder.owners`` is not their number: each
    owner index is one URL.
    """
    wanted = spec.encoder.profile
    profile = fleet.encoder_profile(wanted)
    if profile is None or profile.endpoint is None:
        return None
    urls = len(profile.endpoint.urls)
    if spec.encoder.owners != urls:
        raise InvalidResource(f"The WeightRefit asks for {spec.encoder.owners} encoder "
                              f"owners, but encoder profile {wanted!r} of RolloutFleet "
                              f"{fleet_name} has an endpoint with {urls} URLs, one per "
                              f"owner: set spec.encoder.owners to {urls}.")
    return profile.endpoint


def store_of(fleet: RolloutFleetSpec) -> str | None:
    """The store URI the fleet's agents read (None for a relay fleet)."""
    return fleet.store.uri if fleet.store is not None else None


def _same_store(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


@dataclass(kw_only=True)
class EncoderEndpoints:
    """The warm encoders of one WeightRefit run (shared by its owner handles)."""

    profile_name: str  # the encoder profile (what status records)
    endpoint: EncoderEndpoint
    token: str = field(repr=False)
    spec: WeightRefitSpec
    base_checkpoint: str  # the committed version's checkpoint: the encoders' baseline
    base_attempt: str = ""  # the attempt that committed it ("" for the initial record)
    store: str | None  # the fleet's store; a publish that wrote elsewhere fails
    profile: ReceiverProfile | None = None  # the receivers' merged profile
    forced_mode: Mode | None = None  # "overwrite" for modePolicy Overwrite and retries
    on_started: Callable[[Attempt, str], None] | None = None
    on_finished: Callable[[Attempt, str, str | None], None] | None = None
    summaries: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.clients = [EncoderClient(url, self.token, name=f"{self.profile_name}[{k}]")
                        for k, url in enumerate(self.endpoint.urls)]
        self._lock = threading.Lock()
        self._started: set[str] = set()
        self._stopped: set[str] = set()
        self._done: dict[str, int] = {}

    def attempt_for(self, attempt: Attempt) -> Attempt:
        return replace(attempt, mode=self.forced_mode) if self.forced_mode else attempt

    def request(self, attempt: Attempt, index: int) -> PublishRequest:
        """What owner ``index`` of ``attempt`` is asked: a Job's ``dcr encode`` arguments."""
        t = attempt.transition
        return PublishRequest(
            attempt=attempt.id, mode=attempt.mode, base_version=t.base_version,
            target_version=t.target_version, owner=index, owners=len(self.clients),
            base=self.base_checkpoint, target=self.spec.source.checkpoint,
            bucket_mib=self.spec.encoder.bucket_mib, profile=self.profile,
            committed_attempt=self.base_attempt or None)

    def publish(self, attempt: Attempt, index: int) -> dict[str, Any]:
        """Have owner ``index`` publish ``attempt``; its summary. On any failure the
        attempt is stopped on every endpoint and EncoderEndpointFailed raised."""
        attempt = self.attempt_for(attempt)
        with self._lock:
            first = attempt.id not in self._started
            self._started.add(attempt.id)
        if first:
            log.info("attempt %s (%s, %d owners) publishes through the warm encoders of "
                     "profile %s", attempt.id, attempt.mode, len(self.clients),
                     self.profile_name)
            if self.on_started is not None:
                self.on_started(attempt, self.profile_name)
        client = self.clients[index]
        try:
            summary = client.publish(self.request(attempt, index),
                                     timeout_s=max(1.0, attempt.deadline - time.time()))
            wrote = str(summary.get("store", ""))
            if self.store is not None and not _same_store(wrote, self.store):
                log.warning("encoder endpoint %s wrote attempt %s to store %r", client.name,
                            attempt.id, wrote[:512])  # the endpoint's words: the log only
                raise EncoderEndpointFailed(
                    f"Encoder endpoint {client.name} wrote attempt {attempt.id} to another "
                    f"store than the fleet's {self.store!r} (the operator's log names it): "
                    "its --store must be the fleet's spec.store.uri.")
        except (EncoderError, EncoderEndpointFailed, ValueError) as e:
            if isinstance(e, EncoderError):  # its detail may be the endpoint's own text
                log.warning("owner %d of attempt %s: %s", index, attempt.id, e)
            reason = (str(e) if isinstance(e, EncoderEndpointFailed) else remote_failure(
                f"Encoder endpoint {client.name} (POST /v1/publish)", e))
            self._finished(attempt, reason)
            self.stop([attempt.id])
            if isinstance(e, EncoderEndpointFailed):
                raise
            raise EncoderEndpointFailed(f"Owner {index} of attempt {attempt.id}: "
                                        f"{reason}") from e
        self.summaries[(attempt.id, index)] = summary
        self._finished(attempt, None)
        return summary

    def _finished(self, attempt: Attempt, failure: str | None) -> None:
        with self._lock:
            self._done[attempt.id] = self._done.get(attempt.id, 0) + 1
            last = self._done[attempt.id] == len(self.clients) or failure is not None
        if last and self.on_finished is not None:
            self.on_finished(attempt, self.profile_name, failure)

    def stop(self, attempts: Iterable[str]) -> None:
        """Stop ``attempts`` on every endpoint at once, each attempt once (best effort: an
        endpoint that does not answer is logged; its publishes also stop when their
        caller has gone)."""
        with self._lock:
            todo = [a for a in dict.fromkeys(attempts) if a not in self._stopped]
            self._stopped.update(todo)
        calls = [(a, c) for a in todo for c in self.clients]
        if not calls:
            return
        with ThreadPoolExecutor(min(16, len(calls)), thread_name_prefix="encoder-stop") as pool:
            list(pool.map(lambda call: self._stop_one(*call), calls))

    @staticmethod
    def _stop_one(attempt: str, client: EncoderClient) -> None:
        try:
            answer = client.stop(attempt, timeout_s=STOP_TIMEOUT_S)
        except EncoderError as e:
            log.warning("could not stop attempt %s: %s", attempt, e)
            return
        if answer.stopped or answer.running:
            log.info("encoder endpoint %s stopped attempt %s (%d publishes ended, %d still "
                     "running)", client.name, attempt, answer.stopped, answer.running)


@dataclass(kw_only=True)
class EndpointOwner:
    """``OwnerHandle`` for owner ``index``: publishes through its warm encoder."""

    endpoints: EncoderEndpoints
    index: int

    def publish(self, attempt: Attempt) -> None:
        self.endpoints.publish(attempt, self.index)

    def advance_baseline(self, record: CommitRecord) -> None:
        log.debug("owner %d: baseline is now %s (v%s)", self.index, record.baseline_id,
                  record.committed_version)


__all__ = ["EncoderEndpoints", "EndpointOwner", "encoder_endpoint", "store_of"]
