"""The commit record in a RolloutFleet's status, changed only by compare-and-set.

:class:`FleetCommitStore` keeps ``(committedVersion, baselineId, attempt, historyDigest)``
in ``status.commit``, and publishes it to the fleet's pods as it writes it
(:mod:`dcr_operator.commitmap`). A CAS patches the status subresource under the
``resourceVersion`` it read, and succeeds only if the answer carries the record written; a
409 is settled by reading again. How a fleet object holds the record:
:mod:`dcr_operator.fleetrecord`.
Why: docs/operator.md, "Inside the operator".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from dcr.protocol.commitstore import CommitStoreError
from dcr.protocol.records import CommitOutcome, CommitRecord
from dcr_operator.api.common import GROUP, VERSION
from dcr_operator.api.rolloutfleet import PLURAL as FLEET_PLURAL
from dcr_operator.commitmap import publish_commit
from dcr_operator.errors import ApiError, ApiUnreachable, Conflict, InvalidResource, NotFound
from dcr_operator.fleetrecord import commit_status, initial_record, record_of
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.reconcile import now

log = logging.getLogger(__name__)


def _carries(answer: Any, record: CommitRecord) -> bool:
    """Does the API server's answer to a status patch hold ``record`` as this fleet's?"""
    return (isinstance(answer, Mapping) and bool((answer.get("status") or {}).get("commit"))
            and record_of(answer) == record)


class FleetCommitStore:
    """The commit record of RolloutFleet ``namespace/name``."""

    def __init__(self, kube: KubeClient, namespace: str, name: str, *,
                 refit: str | None = None, retries: int = 8,
                 clock: Callable[[], str] = now) -> None:
        self.kube = kube
        self.namespace, self.name = namespace, name
        self.refit = refit  # recorded beside the record: which WeightRefit committed it
        self.retries = retries
        self.clock = clock
        self.path = api_path(GROUP, VERSION, FLEET_PLURAL, namespace, name)
        self.status_path = api_path(GROUP, VERSION, FLEET_PLURAL, namespace, name, "status")

    def __repr__(self) -> str:
        return f"FleetCommitStore({self.namespace}/{self.name})"

    def read(self) -> CommitRecord:
        try:
            return record_of(self.kube.get(self.path))
        except (ApiError, ApiUnreachable) as e:
            raise CommitStoreError(f"Cannot read the commit record of RolloutFleet "
                                   f"{self.namespace}/{self.name}: {e}") from e

    def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome:
        for _ in range(self.retries):
            try:
                fleet = self.kube.get(self.path)
            except NotFound:
                log.warning("%r: the fleet is gone; the commit is refused", self)
                return CommitOutcome.FAILED
            except (ApiError, ApiUnreachable) as e:
                log.warning("%r: cannot read before the compare-and-set: %s", self, e)
                return CommitOutcome.UNKNOWN
            if record_of(fleet) != expected:
                return CommitOutcome.CONFLICT
            patch = {"metadata": {"resourceVersion": fleet["metadata"]["resourceVersion"]},
                     "status": {"commit": commit_status(new, refit=self.refit,
                                                        at=self.clock())}}
            try:
                answer = self.kube.merge_patch(self.status_path, patch)
            except Conflict:
                log.info("%r: resourceVersion moved before the compare-and-set; reading again",
                         self)
                continue
            except ApiUnreachable as e:
                log.warning("%r: the compare-and-set got no answer: %s", self, e)
                return CommitOutcome.UNKNOWN
            except ApiError as e:
                log.warning("%r: the compare-and-set was refused: %s", self, e)
                return CommitOutcome.UNKNOWN if e.status >= 500 else CommitOutcome.FAILED
            if not _carries(answer, new):
                log.warning("%r: the compare-and-set was answered without the record it "
                            "wrote; its outcome is unknown", self)
                return CommitOutcome.UNKNOWN
            log.info("%r: committed version %s (%s) by %s", self, new.committed_version,
                     new.baseline_id, new.attempt)
            self._publish()
            return CommitOutcome.SUCCESS
        return CommitOutcome.UNKNOWN

    def _publish(self) -> None:
        """Publish the record to the fleet's pods (``<fleet>-commit``). A failure changes
        no outcome: the record moved, and each fleet poll publishes it again."""
        try:
            publish_commit(self.kube, self.namespace, self.name)
        except (ApiError, ApiUnreachable, InvalidResource) as e:
            log.warning("%r: the commit is recorded, but not yet published to the fleet's "
                        "pods: %s", self, e)

    def initialize(self) -> CommitRecord:
        """Write the initial record into a fleet that has none yet; return the record."""
        for _ in range(self.retries):
            fleet = self.kube.get(self.path)
            if (fleet.get("status") or {}).get("commit"):
                return record_of(fleet)
            record = initial_record(fleet)
            patch = {"metadata": {"resourceVersion": fleet["metadata"]["resourceVersion"]},
                     "status": {"commit": commit_status(record)}}
            try:
                answer = self.kube.merge_patch(self.status_path, patch)
            except Conflict:
                continue
            if _carries(answer, record):
                self._publish()
                return record
        raise CommitStoreError(f"Could not initialize the commit record of RolloutFleet "
                               f"{self.namespace}/{self.name}: it kept changing.")
