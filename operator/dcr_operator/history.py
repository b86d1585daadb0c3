"""The store's history of a fleet, as the operator writes it after each commit.

The operator is the fleet's coordinator, so it is the history's one writer
(:class:`dcr.files.history.HistoryStore`); it reaches the store with the fleet's own
credentials Secret. A relay fleet keeps its history in the store beside its relay
(docs/relay.md, "History and catch-up"); one without a store keeps none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import unquote, urlparse

from dcr.files.history import HistoryStore
from dcr.transport.store import FileStore, Store
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.api.weightrefit import MAX_REFIT_OWNERS
from dcr_operator.fleet import fleet_path, store_credentials
from dcr_operator.kube import KubeClient
from dcr_operator.prefixes import remove_prefixes

log = logging.getLogger(__name__)


def fleet_store(kube: KubeClient, namespace: str, spec: RolloutFleetSpec) -> Store | None:
    """The fleet's object store, opened with its credentials; None without one."""
    if spec.store is None:
        return None
    uri = spec.store.uri
    if uri.startswith("file://"):
        return FileStore(Path(unquote(urlparse(uri).path)))
    from dcr.transport.s3 import S3Store  # boto3 loads only for an S3 fleet

    return S3Store(uri, endpoint=spec.store.endpoint, region=spec.store.region,
                   credentials=store_credentials(kube, namespace, spec))


def fleet_history(kube: KubeClient, namespace: str, spec: RolloutFleetSpec
                  ) -> HistoryStore | None:
    """The fleet's history as its coordinator keeps it: retention applied as each commit's
    history is staged, so the commit record vouches for the pruned one."""
    store = fleet_store(kube, namespace, spec)
    return HistoryStore(store, keep_snapshots=spec.retention.keep_snapshots,
                        owners=MAX_REFIT_OWNERS) if store is not None else None


def committed_attempt(kube: KubeClient, namespace: str, spec: RolloutFleetSpec,
                      version: int) -> str | None:
    """The attempt the store's history says committed ``version`` (never status, which
    others may write), or None where none did. Raises :class:`DcrError` while the history
    cannot be read: cleanup then removes nothing."""
    history = fleet_history(kube, namespace, spec)
    if history is None:
        return None
    return next((c.attempt for c in history.read().versions if c.version == version), None)


def keep_history(kube: KubeClient, namespace: str, fleet: str, spec: RolloutFleetSpec,
                 history: HistoryStore) -> None:
    """After a commit's history is written: remove the objects it no longer names (the
    fleet's retention pruned them as it was staged) and show what is kept in the fleet's
    status. Best effort: the commit stands whatever happens here."""
    pruned: list[str] = []
    try:
        kept = history.read()
        if history.pruned and spec.store is not None:
            pruned = remove_prefixes(spec.store.uri, history.pruned,
                                     endpoint=spec.store.endpoint, region=spec.store.region,
                                     credentials=store_credentials(kube, namespace, spec))
            history.pruned = []
        kube.merge_patch(fleet_path(namespace, fleet, "status"), {"status": {"history": {
            "oldestVersion": kept.versions[0].version if kept.versions else None,
            "committedVersion": kept.committed if kept.versions else None,
            "snapshots": [s.version for s in kept.snapshots],
            "pruned": pruned[:64]}}})
    except Exception as e:  # the detail to the log: store errors stay out of status
        log.warning("fleet %s/%s: retention after the commit failed: %s", namespace, fleet, e)
