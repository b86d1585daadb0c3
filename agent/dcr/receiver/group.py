"""A group's leader agent and its members: a replica whose ranks span pods.

The leader's agent drives the engine (its HTTP server reaches every rank of the replica)
and tells each member agent (a worker pod's, :mod:`dcr.receiver.member`) what to stage; a
payload is applied only once every member has staged it, so every rank finds it in its own
pod's staging directory, and then released there. A member that failed, restarted (it no
longer holds the attempt) or does not answer fails the attempt, naming it; the engine's
instance id covers the worker pods' ranks, so a worker pod's restart makes the weights
unknown. docs/replica-groups.md, "Replicas across pods".
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from dcr.errors import AttemptError
from dcr.protocol.agent_api import AttemptSpec
from dcr.receiver.member_api import MemberClient, MemberError

log = logging.getLogger(__name__)

POLL_S = (0.01, 0.25)  # first and longest wait between two looks at a member's staging


class GroupError(AttemptError):
    """A member cannot stage, hold or build what the leader needs: the attempt (or the
    dense load) fails, naming the member and why."""


@dataclass(eq=False)
class Group:
    """The leader agent's members (their clients), and what each was last seen holding."""

    members: tuple[MemberClient, ...]
    _seen: dict[str, set[str]] = field(default_factory=dict)  # url -> staged names

    def stage(self, spec: AttemptSpec) -> None:
        """Tell every member to stage ``spec``'s payloads (the attempt before it ends)."""
        self._seen.clear()
        for m in self.members:
            try:
                m.stage(spec)
            except MemberError as e:
                raise GroupError(f"attempt {spec.attempt}: {e}") from e

    def ready(self, spec: AttemptSpec, name: str, stop: threading.Event) -> None:
        """Return once every member has staged ``name``; raise naming a member that
        failed, lost the attempt or ran past the attempt's deadline."""
        for m in self.members:
            wait = POLL_S[0]
            while name not in self._seen.get(m.url, ()):
                if stop.is_set():
                    return  # the caller sees the stop and writes nothing
                try:
                    status = m.status(spec.attempt)
                except MemberError as e:
                    raise GroupError(f"attempt {spec.attempt}: {e}") from e
                if status.error is not None:
                    raise GroupError(f"attempt {spec.attempt}: member {m.url} ({status.name}) "
                                     f"failed: {status.error}")
                self._seen[m.url] = set(status.staged)
                if name in self._seen[m.url]:
                    break
                if status.received:
                    raise GroupError(f"attempt {spec.attempt}: member {m.url} "
                                     f"({status.name}) received the attempt without {name}.")
                if time.time() > spec.deadline:
                    raise GroupError(f"attempt {spec.attempt}: member {m.url} had not staged "
                                     f"{name} by the attempt's deadline.")
                stop.wait(wait)
                wait = min(POLL_S[1], wait * 2)

    def release(self, attempt: str, name: str) -> None:
        """``name`` was applied: the members may remove it (best effort: a member that
        misses it removes the file when the attempt ends)."""
        for m in self.members:
            self._seen.get(m.url, set()).discard(name)
            try:
                m.release(attempt, [name])
            except MemberError as e:
                log.warning("attempt %s: %s", attempt, e)

    def end(self, attempt: str) -> None:
        """The attempt is over: every member stops and clears it (best effort)."""
        for m in self.members:
            try:
                m.end(attempt)
            except MemberError as e:
                log.warning("attempt %s: %s", attempt, e)

    def dense(self, version: int, relative: str, timeout_s: float,
              history_digest: str | None = None) -> None:
        """Have every member build ``version`` under its checkpoint root, at the same
        relative path as the leader's (``relative``), from the history ``history_digest``
        names (the leader's, as the coordinator gave it), before the engine loads it."""
        for m in self.members:
            try:
                built = m.dense(version, timeout_s, history_digest)
            except MemberError as e:
                raise GroupError(f"dense load of version {version}: {e}") from e
            if built != relative:
                raise GroupError(f"dense load of version {version}: member {m.url} built "
                                 f"{built!r}, the leader {relative!r}.")


__all__ = ["Group", "GroupError"]
