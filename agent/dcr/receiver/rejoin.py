"""A rejoin: an agent restores a committed version by a dense load through its engine.

The checkpoint is a path under the agent's checkpoint root or, without one, the version built
from the store's history under that root (:func:`~dcr.files.materialize.materialize`: its
last copy advanced by the committed deltas, or a snapshot and the deltas after it). It must
hold the fingerprints the history vouches for at the version (without a history: those of
the attempt the agent committed to it, where it did). Every rank checks both, reading the
whole checkpoint, before anything is written (:meth:`Driver.check_dense`): a refused load
leaves the weights and the gate as they were. Errors name the check that failed, never bytes
of the file (the engine's sentences do not quote files). docs/protocol.md argues the design.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Protocol

from dcr.drivers.base import Driver
from dcr.drivers.errors import EngineError
from dcr.protocol.agent_api import AgentStatus
from dcr.receiver.attempt import AgentConflict, Counters, FingerprintMismatch
from dcr.receiver.fromstore import FromStore, NotVouched
from dcr.receiver.group import Group, GroupError
from dcr.receiver.weights import Weights

log = logging.getLogger(__name__)


class Host(Protocol):
    """What a rejoin needs of the agent it restores (``AgentService``): its parts, and its
    state lock, gate and journal, which a rejoin keeps to as the agent's attempts do."""

    name: str
    engine: Driver
    group: Group | None
    store: FromStore | None
    trust_labels: bool  # without a store: whether an unverifiable label may load
    checkpoint_root: Path | None
    weights: Weights
    counters: Counters
    max_wait_s: float
    _cond: threading.Condition  # the state lock
    _loading: int | None  # the version a dense load is restoring
    _gate_open: bool

    def attach(self, *, prewarm: bool = True) -> str: ...
    def seen(self, instance: str) -> None: ...
    def open_gate(self) -> AgentStatus: ...
    def _between_attempts(self, what: str) -> None: ...
    def _not_loading(self, what: str) -> None: ...
    def _pause(self) -> None: ...
    def _resume(self) -> None: ...
    def _journal(self) -> None: ...
    def _label(self, version: int) -> None: ...


def restore(agent: Host, version: int, checkpoint: str | None) -> AgentStatus:
    """Restore ``version`` on ``agent`` from ``checkpoint`` (relative to its checkpoint
    root), or from the store's history without one; its status, the gate open again."""
    relative = _dense_path(agent, checkpoint) if checkpoint is not None else None
    with agent._cond:
        agent._between_attempts("a dense refit")
        agent._not_loading("another dense refit")
    instance = agent.attach()  # a restarted engine is prewarmed before it loads
    with agent._cond:
        agent._between_attempts("a dense refit")
        agent._not_loading("another dense refit")
        agent._loading, was_open = version, agent._gate_open
    relative, expect = _checked(agent, version, relative, was_open)
    _load(agent, version, relative, expect, instance)
    log.info("%s: restored version %s by a dense load of %s", agent.name, version, relative)
    agent._label(version)
    return agent.open_gate()


def _checked(agent: Host, version: int, relative: str | None, was_open: bool
             ) -> tuple[str, dict[str, str] | None]:
    """The checkpoint (built from the store if ``relative`` is None) and the fingerprints
    it must hold, once every rank has checked it with the gate closed. On failure the load
    ends and the gate opens as it was: nothing was written."""
    try:  # from here no attempt and no other dense load starts: the build is ours
        expect = _vouched(agent, version)
        if relative is None:
            relative = _dense_path(agent, _from_store(agent, version))
            if agent.group is not None:  # the worker pods' ranks read their own roots
                try:
                    agent.group.dense(version, relative, agent.max_wait_s,
                                      _digest(agent))
                except GroupError as e:
                    raise AgentConflict(f"{agent.name}: {e}") from e
        agent._pause()
        agent.engine.check_dense(relative, expect)
    except BaseException as e:
        with agent._cond:
            agent._loading = None
            reopen = was_open and not agent._gate_open
        if reopen:
            agent._resume()  # nothing was written: serve as before
        if isinstance(e, EngineError) and e.status is not None:
            raise AgentConflict(f"{agent.name}: dense load of version {version} refused: "
                                f"{e}") from e
        raise
    return relative, expect


def _load(agent: Host, version: int, relative: str, expect: dict[str, str] | None,
          instance: str) -> None:
    """Load the checked checkpoint (the weights journaled as loading first), then compare
    its fingerprints on the engine instance the rejoin began with."""
    engine = agent.engine
    try:
        with agent._cond:
            agent.weights.loading(version)
            agent._journal()
        engine.load_dense(relative, expect)
        engine.sync()
        differ = engine.check_targets(expect) if expect else {}
        if differ:
            raise FingerprintMismatch(f"{agent.name}: after a dense load of version "
                                      f"{version}, {len(differ)} tensors differ from its "
                                      f"manifest's targets: {sorted(differ)[:3]}.")
        now = engine.instance()
        with agent._cond:
            agent.seen(now)
            if now != instance:
                raise AgentConflict(f"{agent.name}: the engine restarted during the dense "
                                    f"load of version {version}.")
            agent.weights.loaded(version)
            agent.counters.dense_loads += 1
            agent._journal()
    finally:
        with agent._cond:
            agent._loading = None


def _digest(agent: Host) -> str | None:
    """The history digest the coordinator gave this agent, for its members to read by."""
    return agent.store.history.digest if agent.store is not None else None


def _vouched(agent: Host, version: int) -> dict[str, str] | None:
    """The fingerprints a dense load of ``version`` must have: the store history's,
    or while it names nothing, those of the attempt this agent committed to it (else
    None: unchecked). Without a history at all (a relay fleet that keeps none) an agent
    that committed no attempt of ``version`` refuses, unless told to trust labels
    (in-process callers): :func:`unverifiable`."""
    vouched = None
    if agent.store is not None:
        try:
            vouched = agent.store.vouched(version)
        except NotVouched as e:
            raise AgentConflict(f"{agent.name}: dense load of version {version} refused: "
                                f"{e}") from e
    expect = vouched if vouched is not None else agent.weights.expected(version)
    if expect is None and agent.store is None and not agent.trust_labels:
        raise unverifiable(agent.name, version)
    return expect


def unverifiable(name: str, version: int) -> AgentConflict:
    """The refusal of a checkpoint labelled ``version`` that nothing can check: no history
    vouches for it and this agent committed no attempt of it, so the label alone would
    decide which bits serve as ``version``."""
    return AgentConflict(f"{name}: dense load of version {version} refused: no history "
                         f"vouches for its fingerprints and this agent committed no attempt "
                         f"of it, so a checkpoint labelled {version} cannot be checked; give "
                         "the agent the fleet's store (--store, beside --relay for a relay "
                         "fleet), whose history the coordinator writes.")


def _from_store(agent: Host, version: int) -> str:
    """Build ``version`` from the store's history; the directory, relative to the
    checkpoint root."""
    if agent.store is None:
        raise AgentConflict(f"{agent.name}: a dense load without a checkpoint path needs "
                            "the store's history.")
    try:
        relative, done = agent.store.build(version)
    except NotVouched as e:
        raise AgentConflict(f"{agent.name}: {e}") from e
    with agent._cond:
        agent.counters.store_bytes_fetched += done.fetched_bytes
    return relative


def _dense_path(agent: Host, checkpoint: str) -> str:
    """``checkpoint`` relative to the checkpoint root, if it lies under it (links
    resolved); the engine resolves it under its own root."""
    root = agent.checkpoint_root
    if root is None:
        raise AgentConflict(f"{agent.name}: no checkpoint root is configured; dense loads "
                            "are refused.")
    path = (root / checkpoint).resolve()  # an absolute ``checkpoint`` replaces ``root``
    if not path.is_relative_to(root) or path == root:
        raise AgentConflict(f"{agent.name}: dense loads come from under {root}; "
                            f"{checkpoint!r} is not there.")
    return path.relative_to(root).as_posix()
