"""``retention.snapshotEvery`` for a fleet whose owners are the trainer's ranks.

Such a fleet has no checkpoint for a snapshot Job to read: after every K-th commit the
operator asks each rank's endpoint for its part of the committed version's snapshot, from
memory (``POST /v1/snapshot``, :mod:`dcr.files.ranksnap`), and writes the index over the
parts; the next commit adopts it as it adopts any snapshot (every piece read back). An
endpoint that writes no snapshot from memory (a ``dcr encoder`` of checkpoints, 400; one
that predates the call, 404) leaves the snapshot to the Job, as before. Best effort, off
the refit's thread: the commit stands, and a missing snapshot only makes catch-up longer.
docs/retention.md, "Rank-owner fleets".
"""

from __future__ import annotations

import logging

from dcr.files.ranksnap import write_rank_index
from dcr.format.history import Snapshot
from dcr.protocol.encoder_api import EncoderError
from dcr.protocol.owner_endpoints import OwnerEndpointFailed, OwnerEndpoints
from dcr.protocol.records import CommitRecord
from dcr.transport.store import Store

log = logging.getLogger(__name__)

NOT_RANKS = frozenset({400, 404})  # the endpoint writes no snapshot from memory


def rank_snapshot(endpoints: OwnerEndpoints, record: CommitRecord, store: Store
                  ) -> Snapshot | None:
    """Have every rank write its part of the snapshot of the version ``record`` committed
    and write the index into ``store``; None where the endpoints write no snapshot from
    memory (a Job of ``dcr snapshot`` does it then). Raises :class:`OwnerEndpointFailed`
    when a rank failed."""
    try:
        parts = endpoints.snapshot(record)
    except OwnerEndpointFailed as e:
        cause = e.__cause__
        if isinstance(cause, EncoderError) and cause.status in NOT_RANKS:
            log.info("%s write no snapshot from memory (%s): a Job writes it", endpoints.name,
                     cause.status)
            return None
        raise
    snap = write_rank_index(store, record.committed_version, parts)
    log.info("%s wrote the snapshot of version %d from memory (%d bytes, %d parts); the "
             "next commit adopts it", endpoints.name, snap.version, snap.bytes, len(parts))
    return snap


__all__ = ["rank_snapshot"]
