"""A fleet's commit ConfigMap: the committed version and history digest, for its pods.

``<fleet>-commit`` in the fleet's namespace, owned by the RolloutFleet, holds the commit
file (:mod:`dcr.format.commitfile`) of the record in ``status.commit``. Rollout pods
mount it as an ``optional`` volume and pass it to ``dcr materialize`` and ``dcr mirror``
(``--commit-file``), so they build what the record says with no API token, and whoever
writes the store cannot steer them. :class:`~dcr_operator.commitstore.FleetCommitStore`
publishes it as it writes the record; each fleet poll puts it right again (a failed
write, a compare-and-set whose answer was lost, a hand edit). A publisher reads the record
afresh and reads it once more after writing, so of two racing (a poll and a commit) the
last leaves the newest record. One it does not own is left alone.
docs/two-clusters.md, "What a pod is told".
"""

from __future__ import annotations

import logging
from typing import Any

from dcr.format.commitfile import COMMIT_FILE_KEY, CommitFile
from dcr_operator.errors import Conflict, InvalidResource, NotFound
from dcr_operator.fleet import fleet_path
from dcr_operator.fleetrecord import record_of
from dcr_operator.jobs import short_name
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.sites import owner_reference

log = logging.getLogger(__name__)
MANAGED = {"app.kubernetes.io/managed-by": "dcr-operator"}


def commit_map_name(fleet: str) -> str:
    """The ConfigMap of RolloutFleet ``fleet``'s commit (a DNS subdomain: 253 at most)."""
    return short_name(f"{fleet}-commit", 253)


def commit_data(fleet: dict[str, Any]) -> dict[str, str]:
    """The ConfigMap's data for the record ``fleet`` holds."""
    record = record_of(fleet)
    return {COMMIT_FILE_KEY: CommitFile(committed_version=record.committed_version,
                                        history_digest=record.history_digest or None).pack()}


def publish_commit(kube: KubeClient, namespace: str, name: str, *, rounds: int = 8) -> bool:
    """Make ``<name>-commit`` hold the commit file of RolloutFleet ``namespace/name``'s
    record; whether it was written. :class:`InvalidResource` if a ConfigMap of that name is
    not the fleet's; :class:`NotFound` if the fleet is gone."""
    path = api_path("", "v1", "configmaps", namespace)
    cm = commit_map_name(name)
    wrote = False
    for _ in range(rounds):
        fleet = kube.get(fleet_path(namespace, name))
        data = commit_data(fleet)
        try:
            there: dict[str, Any] | None = kube.get(f"{path}/{cm}")
        except NotFound:
            there = None
        if there is not None and fleet["metadata"]["uid"] not in [
                o.get("uid") for o in there["metadata"].get("ownerReferences") or []]:
            raise InvalidResource(f"ConfigMap {namespace}/{cm} is not RolloutFleet {name}'s "
                                  "(no ownerReference to it): the operator leaves it alone; "
                                  "delete it to have the fleet's commit published there.")
        if there is not None and there.get("data") == data:
            return wrote
        try:
            _write(kube, path, cm, fleet, there, data)
        except Conflict:  # made or changed in between: read both again
            continue
        log.info("ConfigMap %s/%s: %s", namespace, cm, data[COMMIT_FILE_KEY])
        wrote = True  # and once more round: the record may have moved meanwhile
    raise Conflict(f"ConfigMap {namespace}/{cm} or its fleet's record kept changing while "
                   "the commit was published.", 409)


def _write(kube: KubeClient, path: str, cm: str, fleet: dict[str, Any],
           there: dict[str, Any] | None, data: dict[str, str]) -> None:
    if there is None:
        meta = fleet["metadata"]
        kube.create(path, {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
                           "metadata": {"name": cm, "namespace": meta["namespace"],
                                        "labels": MANAGED,
                                        "ownerReferences": [owner_reference(fleet)]}})
    else:
        kube.merge_patch(f"{path}/{cm}", {
            "metadata": {"resourceVersion": there["metadata"]["resourceVersion"]},
            "data": data})
