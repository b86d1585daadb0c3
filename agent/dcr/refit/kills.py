"""Kills in the middle of a refit: the main job's fault injection (``--kill-receiver-every``).

The owners' publishes wait at a :class:`KillPoint` until the kill has landed, so it falls
inside the attempt however fast an owner publishes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from dcr.errors import DcrError
from dcr.protocol.coordinator import OwnerHandle
from dcr.protocol.records import Attempt, CommitRecord
from dcr.refit.launch import AgentProcess, Process


class Killer(threading.Thread):
    """Waits until ``agent`` is applying an attempt, then SIGKILLs and restarts ``victim``
    (the agent, or the server beside it); ``killed`` is set once it is dead."""

    def __init__(self, agent: AgentProcess, victim: Process) -> None:
        super().__init__(name=f"kill-{victim.name}", daemon=True)
        self.agent = agent
        self.victim = victim
        self.killed_at: float | None = None
        self.killed = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        client = self.agent.client(timeout_s=5.0)
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                try:
                    st = client.status()
                except DcrError:  # not up yet
                    time.sleep(0.01)
                    continue
                if st.state == "applying":  # journaled dirty: its bits are now in doubt
                    break
                time.sleep(0.005)
            self.killed_at = time.time()
            self.victim.kill()
            self.killed.set()
            self.victim.restart()  # the kill again is a no-op; then start, wait until ready
        finally:
            self.killed.set()
            self.done.set()


class KillPoint:
    """Where a step's kill lands: every owner's publish waits here for it.

    With the sync gate (the demo's) every admitted receiver is applying, journaled dirty,
    before the owners publish; holding the publishes until the victim is dead puts the
    kill inside the attempt however fast the owners are (a warm owner publishes in tens
    of milliseconds, less than the killer's polling may need to see ``applying``)."""

    HOLD_S = 30.0  # at most: a victim never seen applying is killed at the killer's deadline

    def __init__(self) -> None:
        self.killer: Killer | None = None

    def hold(self) -> None:
        if (k := self.killer) is not None:
            k.killed.wait(self.HOLD_S)


@dataclass(frozen=True, kw_only=True)
class Held:
    """An owner (``OwnerHandle``) whose publish first waits at the step's kill point."""

    owner: OwnerHandle
    point: KillPoint

    def publish(self, attempt: Attempt) -> None:
        self.point.hold()
        self.owner.publish(attempt)

    def advance_baseline(self, record: CommitRecord) -> None:
        self.owner.advance_baseline(record)
