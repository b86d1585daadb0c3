"""A fleet's commit ConfigMap: the committed version and history digest, for its pods.

``<fleet>-commit`` in the fleet's namespace, owned by the RolloutFleet, holds the commit
file (:mod:`dcr.format.commitfile`) of the record in ``status.commit``. Rollout pods
mount it as an ``optional`` volume and pass it to ``dcr materialize`` and ``dcr mirror``
(``--commit-file``), so they build what the record says with no API token, and whoever
writes the store cannot steer them. :class:`~dcr_operator.commitstore.FleetCommitStore`
publishes it as it writes the record; each fleet poll puts it right again (a failed
write, a compare-and-set whose answer was lost, a hand edit). A publisher reads the record
afresh before writing (the copy a poll just read shows only that nothing needs writing) and
once more after, so of two racing (a poll and a commit) the last leaves the newest record.
One it does not own is left alone.
docs/two-clusters.md, "What a pod is told".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
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


def commit_data(fleet: Mapping[str, Any]) -> dict[str, str]:
    """The ConfigMap's data for the record ``fleet`` holds."""
    record = record_of(fleet)
    return {COMMIT_FILE_KEY: CommitFile(committed_version=record.committed_version,
                                        history_digest=record.history_digest or None).pack()}


def publish_commit(kube: KubeClient, namespace: str, name: str, *, rounds: int = 8,
                   fleet: Mapping[str, Any] | None = None) -> bool:
    """Make ``<name>-commit`` hold the commit file of RolloutFleet ``namespace/name``'s
    record; whether it was written. :class:`InvalidResource` if a ConfigMap of that name is
    not the fleet's; :class:`NotFound` if the fleet is gone. ``fleet``, the fleet as the
    caller read it, settles only "nothing to change" (the ConfigMap is the fleet's and
    holds its record): anything else reads the fleet afresh, so an older copy never
    writes an older record."""
    path = api_path("", "v1", "configmaps", namespace)
    cm = commit_map_name(name)
    wrote = False
    for _ in range(rounds):
        given, fleet = fleet, None  # a caller's copy serves the first round only
        current = given if given is not None else kube.get(fleet_path(namespace, name))
        data = commit_data(current)
        try:
            there: dict[str, Any] | None = kube.get(f"{path}/{cm}")
        except NotFound:
            there = None
        if given is not None:
            if there is not None and there.get("data") == data and _owns(current, there):
                return wrote
            continue
        if there is not None and not _owns(current, there):
            raise InvalidResource(f"ConfigMap {namespace}/{cm} is not RolloutFleet {name}'s "
                                  "(no ownerReference to it): the operator leaves it alone; "
                                  "delete it to have the fleet's commit published there.")
        if there is not None and there.get("data") == data:
            return wrote
        try:
            _write(kube, path, cm, current, there, data)
        except Conflict:  # made or changed in between: read both again
            continue
        log.info("ConfigMap %s/%s: %s", namespace, cm, data[COMMIT_FILE_KEY])
        wrote = True  # and once more round: the record may have moved meanwhile
    raise Conflict(f"ConfigMap {namespace}/{cm} or its fleet's record kept changing while "
                   "the commit was published.", 409)


def _owns(fleet: Mapping[str, Any], cm: Mapping[str, Any]) -> bool:
    """Whether ConfigMap ``cm`` has an ownerReference to ``fleet``."""
    return bool(fleet["metadata"]["uid"] in [
        o.get("uid") for o in cm["metadata"].get("ownerReferences") or []])


def _write(kube: KubeClient, path: str, cm: str, fleet: Mapping[str, Any],
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
