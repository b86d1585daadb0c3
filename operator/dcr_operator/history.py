"""The store's history of a fleet, as the operator writes it after each commit.

The operator is the fleet's coordinator, so it is the history's one writer
(:class:`dcr.files.history.HistoryStore`); it reaches the store with the fleet's own
credentials Secret. A relay fleet keeps no history: its receivers rejoin from a
checkpoint path (docs/operations.md, "Two clusters").
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from dcr.files.history import HistoryStore
from dcr.transport.store import FileStore, Store
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.fleet import store_credentials
from dcr_operator.kube import KubeClient


def fleet_store(kube: KubeClient, namespace: str, spec: RolloutFleetSpec) -> Store | None:
    """The fleet's object store, opened with its credentials; None for a relay fleet."""
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
    store = fleet_store(kube, namespace, spec)
    return HistoryStore(store) if store is not None else None


def committed_attempt(kube: KubeClient, namespace: str, spec: RolloutFleetSpec,
                      version: int) -> str | None:
    """The attempt the store's history says committed ``version`` (never status, which
    others may write), or None where none did. Raises :class:`DcrError` while the history
    cannot be read: cleanup then removes nothing."""
    history = fleet_history(kube, namespace, spec)
    if history is None:
        return None
    return next((c.attempt for c in history.read().versions if c.version == version), None)
