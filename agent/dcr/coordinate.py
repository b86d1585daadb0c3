"""Refits without Kubernetes: the trainer runs the coordinator over its ranks and agents.

::

    from dcr.coordinate import LocalFleet

    fleet = LocalFleet(name="policy", store="s3://rl-weights/policy", record="commit.db",
                       owners=rank_urls, owner_token=..., agents=agent_urls, agent_token=...,
                       snapshot_every=10, keep_snapshots=2)
    fleet.refit(step)        # after every rank offered ``step``: returns at the commit

The owners are training ranks serving the warm-encoder protocol (``dcr.owner.rank.serve``)
or ``dcr encoder`` processes, one URL per owner index in order; the receivers are ``dcr
agent`` processes. Each refit runs the operator's coordinator (``dcr.protocol.coordinator``)
with the operator's owner handles (``dcr.protocol.owner_endpoints``): the commit record
is a SQLite file (compare-and-set, so two trainers cannot both commit), and the store's
history is staged before each commit and written after it, so a late ``dcr materialize``
or a restarted agent catches up from the store. With ``snapshot_every`` the ranks write a
snapshot of every K-th committed version from memory (``dcr.files.ranksnap``), and with
``keep_snapshots`` the history keeps the newest N and the deltas from the oldest of them
on, the rest removed from the store after the commit. The operator stays the production route
(retries across coordinator restarts, status, metrics); this is the same algorithm in the
trainer's process. docs/trainer.md, "Without Kubernetes".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from dcr.errors import ConfigError, StoreError
from dcr.files.history import HistoryStore
from dcr.files.ranksnap import write_rank_index
from dcr.format.history import Snapshot
from dcr.format.profile import ReceiverProfile, merge
from dcr.protocol.agent_api import AgentClient
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import (
    AttemptCache,
    AttemptResult,
    Coordinator,
    CoordinatorSettings,
)
from dcr.protocol.owner_endpoints import OwnerEndpointFailed, OwnerEndpoints
from dcr.protocol.records import CommitRecord
from dcr.transport.store import FileStore, Store, open_store

log = logging.getLogger(__name__)


def version_name(fleet: str, version: int) -> str:
    """What names ``version`` in the commit record (its ``baseline_id``) and in publish
    requests: a rank reads nothing there, the name only says which version."""
    return f"/ranks/{fleet}/v{version}"


@dataclass(frozen=True, kw_only=True)
class Refitted:
    """A committed refit: the record it left, its attempts in order, the snapshot the
    ranks wrote of its version (``snapshot_every``) and the store prefixes retention
    removed after it."""

    record: CommitRecord
    attempts: tuple[AttemptResult, ...]
    snapshot: Snapshot | None = None
    removed: tuple[str, ...] = ()


@runtime_checkable
class _Deleting(Protocol):
    def delete(self, key: str) -> None: ...


def remove_pruned(store: Store, prefixes: Sequence[str]) -> None:
    """Remove every object under ``prefixes`` (or the one object a prefix without a
    trailing slash names): what the history's retention no longer names."""
    for prefix in prefixes:
        for key in store.list(prefix) if prefix.endswith("/") else [prefix]:
            if isinstance(store, FileStore):
                (store.root / key).unlink(missing_ok=True)
            elif isinstance(store, _Deleting):
                store.delete(key)
            else:
                raise ConfigError(f"Store {store.uri} cannot remove {key}; retention needs "
                                  "a file or S3 store.")


class LocalFleet:
    """Agents refit by the trainer's own coordinator from owner endpoints it lists.

    ``record`` is the commit record's SQLite file, made at ``initial_version`` (what the
    ranks and the agents hold when they start) if absent; ``agent_timeout_s`` bounds
    each agent call but flush and waits, which last as long as the attempt may.
    """

    def __init__(self, *, name: str, store: str, record: str | Path,
                 owners: Sequence[str], owner_token: str, agents: Sequence[str],
                 agent_token: str, initial_version: int = 0,
                 settings: CoordinatorSettings | None = None,
                 agent_timeout_s: float = 30.0, snapshot_every: int | None = None,
                 keep_snapshots: int | None = None) -> None:
        if not owners or not agents:
            raise ConfigError(f"A fleet needs at least one owner URL and one agent URL; got "
                              f"{len(owners)} owners and {len(agents)} agents.")
        self.name, self.owner_urls, self._owner_token = name, tuple(owners), owner_token
        self.store = open_store(store)
        self.settings = settings or CoordinatorSettings()
        self.agents = [AgentClient(f"agent-{k}", url, agent_token, timeout_s=agent_timeout_s)
                       for k, url in enumerate(agents)]
        self.commits = SqliteCommitStore(Path(record), CommitRecord(
            committed_version=initial_version,
            baseline_id=version_name(name, initial_version), attempt=""))
        for what, value in (("snapshot_every", snapshot_every),
                            ("keep_snapshots", keep_snapshots)):
            if value is not None and value < 1:
                raise ConfigError(f"{what} is {value}; it must be at least 1 (or None).")
        self.snapshot_every = snapshot_every
        self.history = HistoryStore(self.store, keep_snapshots=keep_snapshots)

    def __repr__(self) -> str:  # never the tokens
        return f"LocalFleet({self.name!r}, {self.store.uri!r}, {len(self.owner_urls)} owners)"

    def refit(self, version: int) -> Refitted:
        """Commit ``version`` (offered by every owner) on the agents; return at the
        commit. Asking again for a committed version finishes it (agents learn the
        commit, the history is written) and returns. Raises what the coordinator raises
        (``RefitFailed``, ``CommitConflict``, ``CommitUnknown``: ``dcr.errors``)."""
        start = self.commits.read()
        endpoints = OwnerEndpoints(
            name=f"{self.name} owners", urls=self.owner_urls, token=self._owner_token,
            target=version_name(self.name, version), base_checkpoint=start.baseline_id,
            base_attempt=start.attempt, store=self.store.uri, profile=self.profile())
        cache = self.store if isinstance(self.store, AttemptCache) else None  # the relay
        coordinator = Coordinator(self.commits, endpoints.owners(), self.agents,
                                  settings=self.settings, history=self.history, cache=cache)
        try:
            record = coordinator.refit(version, version_name(self.name, version))
        finally:
            coordinator.close()
        log.info("%s: version %d committed (attempt %s)", self.name, version, record.attempt)
        removed = tuple(self.history.pruned)
        remove_pruned(self.store, removed)  # the record vouches for the pruned history
        self.history.pruned = []
        snap = None
        if self.snapshot_every and version % self.snapshot_every == 0:
            try:  # best effort: the commit stands, and catch-up only replays longer
                snap = write_rank_index(self.store, version, endpoints.snapshot(record))
            except (OwnerEndpointFailed, StoreError) as e:
                log.warning("%s: no snapshot of version %d: %s", self.name, version, e)
            else:
                log.info("%s: the ranks wrote a snapshot of version %d (%d bytes); the "
                         "next commit adopts it", self.name, version, snap.bytes)
        return Refitted(record=record, attempts=tuple(coordinator.history), snapshot=snap,
                        removed=removed)

    def profile(self) -> ReceiverProfile | None:
        """The agents' merged receiver profile (what owners encode for); agents that do
        not answer do not vote, and with no answer at all owners encode for any loader."""
        def ask(a: AgentClient) -> ReceiverProfile | None:
            try:
                return ReceiverProfile.model_validate(a.profile())
            except Exception as e:
                log.warning("%s gave no receiver profile: %s", a.name, e)
                return None

        with ThreadPoolExecutor(min(16, len(self.agents))) as pool:
            found = [p for p in pool.map(ask, self.agents) if p is not None]
        return merge(found) if found else None


__all__ = ["LocalFleet", "Refitted", "version_name"]
