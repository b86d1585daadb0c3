"""Owners over HTTP: owner handles that ask warm-encoder endpoints to publish each attempt.

Owner ``k`` of a refit is :class:`EndpointOwner`, which asks ``urls[k]`` to publish with
an encoder Job's arguments (:mod:`dcr.protocol.encoder_api`): a ``dcr encoder`` beside the
checkpoints, or a training rank serving its shards (``dcr.owner.rank``). The token goes in
the Authorization header only, no redirect is followed, and one owner's failure stops the
attempt on every endpoint. The operator builds these from a WeightRefit
(``dcr_operator.endpoint``), ``dcr.coordinate`` from a trainer's list of ranks: one code
path for both. docs/publishing.md, "Warm encoder"; docs/trainer.md, "Without Kubernetes".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from dcr.errors import ExternalError
from dcr.format.history import RankPart
from dcr.format.payload import Mode
from dcr.format.profile import ReceiverProfile
from dcr.protocol.encoder_api import (
    EncoderClient,
    EncoderError,
    PublishRequest,
    SnapshotRequest,
)
from dcr.protocol.records import Attempt, CommitRecord

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0  # how long a stop waits for an encoder's publishes of the attempt
SNAPSHOT_TIMEOUT_S = 1800.0  # a rank's part of a snapshot: its shards written to the store


class OwnerEndpointFailed(ExternalError):
    """An owner endpoint refused or failed a publish, did not answer by the attempt's
    deadline, or wrote to another store than the receivers read."""


def said(what: str, e: BaseException) -> str:
    """How a failed publish is described by default: the error's own sentence (the
    trainer's log is the only reader)."""
    return str(e) if isinstance(e, EncoderError) else f"{what}: {e}"


def same_store(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


@dataclass(kw_only=True)
class OwnerEndpoints:
    """The owner endpoints of one refit (shared by its owner handles), one URL per owner
    index, in order."""

    name: str  # what logs and callbacks call them (the operator: the encoder profile)
    urls: Sequence[str]
    token: str = field(repr=False)
    target: str  # the candidate's checkpoint (a rank reads nothing: it names the version)
    bucket_mib: int | None = None
    base_checkpoint: str  # the committed version's checkpoint: the encoders' baseline
    base_attempt: str = ""  # the attempt that committed it ("" for the initial record)
    store: str | None  # the receivers' store; a publish that wrote elsewhere fails
    profile: ReceiverProfile | None = None  # the receivers' merged profile
    forced_mode: Mode | None = None  # "overwrite" for a forced overwrite and retries
    on_started: Callable[[Attempt, str], None] | None = None
    on_finished: Callable[[Attempt, str, str | None], None] | None = None
    describe: Callable[[str, BaseException], str] = said  # a failure, as reported
    error: type[OwnerEndpointFailed] = OwnerEndpointFailed  # what a failure raises
    summaries: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.clients = [EncoderClient(url, self.token, name=f"{self.name}[{k}]")
                        for k, url in enumerate(self.urls)]
        self._lock = threading.Lock()
        self._started: set[str] = set()
        self._stopped: set[str] = set()
        self._done: dict[str, int] = {}

    def owners(self) -> list[EndpointOwner]:
        """One owner handle per URL, in owner order."""
        return [EndpointOwner(endpoints=self, index=k) for k in range(len(self.clients))]

    def attempt_for(self, attempt: Attempt) -> Attempt:
        return replace(attempt, mode=self.forced_mode) if self.forced_mode else attempt

    def request(self, attempt: Attempt, index: int) -> PublishRequest:
        """What owner ``index`` of ``attempt`` is asked: a Job's ``dcr encode`` arguments."""
        t = attempt.transition
        return PublishRequest(
            attempt=attempt.id, mode=attempt.mode, base_version=t.base_version,
            target_version=t.target_version, owner=index, owners=len(self.clients),
            base=self.base_checkpoint, target=self.target, bucket_mib=self.bucket_mib,
            profile=self.profile, committed_attempt=self.base_attempt or None)

    def publish(self, attempt: Attempt, index: int) -> dict[str, Any]:
        """Have owner ``index`` publish ``attempt``; its summary. On any failure the
        attempt is stopped on every endpoint and ``error`` raised."""
        attempt = self.attempt_for(attempt)
        with self._lock:
            first = attempt.id not in self._started
            self._started.add(attempt.id)
        if first:
            log.info("attempt %s (%s, %d owners) publishes through the endpoints of %s",
                     attempt.id, attempt.mode, len(self.clients), self.name)
            if self.on_started is not None:
                self.on_started(attempt, self.name)
        client = self.clients[index]
        try:
            summary = client.publish(self.request(attempt, index),
                                     timeout_s=max(1.0, attempt.deadline - time.time()))
            self._check_store(client, attempt, str(summary.get("store", "")))
        except (EncoderError, OwnerEndpointFailed, ValueError) as e:
            if isinstance(e, EncoderError):  # its detail may be the endpoint's own text
                log.warning("owner %d of attempt %s: %s", index, attempt.id, e)
            reason = (str(e) if isinstance(e, OwnerEndpointFailed) else self.describe(
                f"Encoder endpoint {client.name} (POST /v1/publish)", e))
            self._finished(attempt, reason)
            self.stop([attempt.id])
            if isinstance(e, OwnerEndpointFailed):
                raise
            raise self.error(f"Owner {index} of attempt {attempt.id}: {reason}") from e
        self.summaries[(attempt.id, index)] = summary
        self._finished(attempt, None)
        return summary

    def _check_store(self, client: EncoderClient, attempt: Attempt, wrote: str) -> None:
        if self.store is None or same_store(wrote, self.store):
            return
        log.warning("encoder endpoint %s wrote attempt %s to store %r", client.name,
                    attempt.id, wrote[:512])  # the endpoint's words: the log only
        raise self.error(f"Encoder endpoint {client.name} wrote attempt {attempt.id} to "
                         f"another store than the fleet's {self.store!r} (the log names "
                         "it): its --store must be the fleet's spec.store.uri.")

    def _finished(self, attempt: Attempt, failure: str | None) -> None:
        with self._lock:
            self._done[attempt.id] = self._done.get(attempt.id, 0) + 1
            last = self._done[attempt.id] == len(self.clients) or failure is not None
        if last and self.on_finished is not None:
            self.on_finished(attempt, self.name, failure)

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

    def snapshot(self, record: CommitRecord, *, timeout_s: float = SNAPSHOT_TIMEOUT_S
                 ) -> list[RankPart]:
        """Have every rank write its part of the snapshot of the version ``record``
        committed, from memory (a rank advances to it first by the record's attempt); the
        parts, in owner order. Raises ``error`` naming the first endpoint that failed."""
        def one(k: int) -> RankPart:
            req = SnapshotRequest(version=record.committed_version, owner=k,
                                  owners=len(self.clients),
                                  committed_attempt=record.attempt or None)
            try:
                return self.clients[k].snapshot(req, timeout_s=timeout_s)
            except EncoderError as e:
                raise self.error(f"Owner {k}'s part of the snapshot of version "
                                 f"{record.committed_version}: " + self.describe(
                                     f"Encoder endpoint {self.clients[k].name} "
                                     "(POST /v1/snapshot)", e)) from e

        with ThreadPoolExecutor(min(16, len(self.clients)),
                                thread_name_prefix="encoder-snapshot") as pool:
            return list(pool.map(one, range(len(self.clients))))

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
    """``OwnerHandle`` for owner ``index``: publishes through its endpoint. A rank owner
    advances when the next request carries the commit record (``committed_attempt``)."""

    endpoints: OwnerEndpoints
    index: int

    def publish(self, attempt: Attempt) -> None:
        self.endpoints.publish(attempt, self.index)

    def advance_baseline(self, record: CommitRecord) -> None:
        log.debug("owner %d: baseline is now %s (v%s)", self.index, record.baseline_id,
                  record.committed_version)


__all__ = ["EndpointOwner", "OwnerEndpointFailed", "OwnerEndpoints", "said", "same_store"]
