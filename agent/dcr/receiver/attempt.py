"""One attempt's run on an agent: what it staged and applied, and the threads that do it.

A receive thread stages payloads; once the gate is closed and drained, an apply thread has the
engine apply them in order and checks every target fingerprint and region sum the manifest
carries against what every rank holds, whether the attempt wrote it or not: a rank whose
bits were wrong before the attempt fails the flush like one the attempt left wrong
(docs/protocol.md, "What is checked before and after apply"). The agent's
refusals and failures are declared here, where attempts and rejoins (``rejoin.py``) raise them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from dcr.drivers.base import Driver
from dcr.errors import AttemptError, StateConflict
from dcr.format.manifest import Manifest
from dcr.format.payload import Payload
from dcr.protocol.agent_api import AttemptSpec
from dcr.protocol.states import AttemptState
from dcr.receiver.group import Group
from dcr.receiver.staging import StagingDir
from dcr.receiver.weights import short
from dcr.transport.receive import ReceiveStopped, Source, receive

S = AttemptState


class AgentConflict(StateConflict):
    """The call does not fit the agent's state (wrong attempt, version or gate)."""


class AttemptFailed(AttemptError):
    """The current attempt failed on this agent; the cause is in the message."""


class FingerprintMismatch(AttemptError):
    """After an attempt's payloads were applied, a tensor's or region's bits on some rank
    differ from the target fingerprint its manifest lists (whether the attempt wrote
    them or not)."""


@dataclass(kw_only=True)
class Counters:
    """What ``/metrics`` exports (monotonic counts and seconds)."""

    payloads_applied: int = 0
    payload_bytes_applied: int = 0
    apply_seconds: float = 0.0
    attempts: dict[str, int] = field(default_factory=dict)  # by final outcome
    dense_loads: int = 0
    store_bytes_fetched: int = 0  # by dense loads built from the store's history


class Agent(Protocol):
    """What a run needs of the agent it runs on."""

    name: str
    engine: Driver
    group: Group | None  # the members of a replica spanning pods, on its leader's agent
    staging: StagingDir
    staging_bytes: int
    counters: Counters

    def move(self, run: Run, to: AttemptState) -> None:
        """Advance ``run`` to ``to`` and journal it; the caller holds the lock."""

    def failed(self, run: Run, error: Exception) -> None:
        """A thread of ``run`` raised ``error``; called without the lock."""

    def seen(self, instance: str) -> None:
        """The engine answered ``instance``; the caller holds the lock."""

    def region_sums(self, manifest: Manifest) -> dict[str, str]:
        """The manifest's fingerprints of regions the engine's ranks hold."""


@dataclass(frozen=True, kw_only=True)
class Staged:
    name: str  # the file in the staging directory
    size: int  # bytes, as the manifest lists them


@dataclass(eq=False, kw_only=True)
class Run:
    """An attempt on one agent. Its fields are read and written under ``cond``, the
    agent's state lock; its threads never hold it across an engine call."""

    spec: AttemptSpec
    instance: str  # the engine instance the attempt writes to
    agent: Agent
    cond: threading.Condition
    state: AttemptState = S.PREPARED
    stop: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)  # ends the receive's idle wait
    apply_open: threading.Event = field(default_factory=threading.Event)
    staged: list[Staged | None] = field(default_factory=list)  # verified, as files
    staged_bytes: int = 0  # staged, not yet applied
    received: bool = False  # the manifest closed the attempt: nothing more will be staged
    manifest: Manifest | None = None
    applied: int = 0
    applied_bytes: int = 0
    apply_s: float = 0.0
    checked: bool = False  # all applied, the engine synchronized, fingerprints compared
    error: str | None = None
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def attempt(self) -> str:
        return self.spec.attempt

    def start_receive(self, source_for: Callable[[AttemptSpec], Source]) -> None:
        self._start(lambda: self._receive(source_for(self.spec)), "receive")

    def owners_published(self) -> None:
        """The coordinator's call after publishing arrived: every manifest part is written,
        so the receive loop asks for them now instead of at its next backed-off look."""
        self.wake.set()

    def start_apply(self) -> None:
        """Let the staged payloads be applied; the caller holds the lock, the gate is
        closed and drained, and the weights are journaled dirty."""
        self.apply_open.set()
        self._start(self._apply, "apply")

    def stop_and_join(self) -> None:
        """Stop the threads and wait for them: an apply in progress finishes its payload,
        then nothing more is written. Called without the lock."""
        with self.cond:
            self.stop.set()
            self.wake.set()
            self.cond.notify_all()
            threads = list(self.threads)
        for t in threads:
            t.join()

    # --- threads -------------------------------------------------------------------

    def _start(self, target: Callable[[], None], what: str) -> None:
        t = threading.Thread(target=self._guard, args=(target,),
                             name=f"{what}-{self.attempt}", daemon=True)
        self.threads.append(t)
        t.start()

    def _guard(self, target: Callable[[], None]) -> None:
        try:
            target()
        except ReceiveStopped:
            pass
        except Exception as e:  # the attempt fails; the coordinator retries by overwrite
            self.agent.failed(self, e)

    def _receive(self, source: Source) -> None:
        spec = self.spec
        try:
            manifest = receive(source, spec.attempt, self._stage, owners=spec.owners,
                               release="when_listed", hold_bytes=self.agent.staging_bytes,
                               timeout_s=max(0.1, spec.deadline - time.time()),
                               stop=self.stop, wake=self.wake)
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a relay source holds a loop thread and a session
                close()
        with self.cond:
            self.manifest, self.received = manifest, True
            if self.state is S.STREAMING:
                self.agent.move(self, S.STAGED)
            self.cond.notify_all()

    def _stage(self, payload: Payload) -> None:
        size, budget = payload.size, self.agent.staging_bytes
        with self.cond:  # back-pressure: staged but unapplied bytes stay bounded
            def fits() -> bool:
                return self.staged_bytes == 0 or self.staged_bytes + size <= budget

            if not fits() and not self.apply_open.is_set():
                # Staging before the gate closes (asynchronous RL) must hold the whole
                # attempt: waiting for space nobody frees would only run into the deadline.
                raise AttemptFailed(
                    f"staging it needs more than the budget of {budget} bytes before "
                    "apply opens; raise --staging-mib or close the gate at the start "
                    "(sync RL).")
            self.cond.wait_for(lambda: self.stop.is_set() or fits())
            if self.stop.is_set():
                raise ReceiveStopped(f"attempt {self.attempt} stopped")
            self.staged_bytes += size  # reserved before the file is written
        name = self.agent.staging.write(payload)  # a stop joins this thread, then clears
        with self.cond:
            self.staged.append(Staged(name=name, size=size))
            self.cond.notify_all()

    def _apply(self) -> None:
        agent, counters = self.agent, self.agent.counters
        while True:
            i = self.applied
            with self.cond:
                self.cond.wait_for(lambda: self.stop.is_set() or self.error is not None
                                   or self.applied < len(self.staged) or self.received)
                if self.stop.is_set() or self.error is not None:
                    return
                if i >= len(self.staged):
                    break  # received and all applied: check, then flush ends the attempt
                staged = self.staged[i]
            assert staged is not None
            if agent.group is not None:  # every pod of the group must have the file
                agent.group.ready(self.spec, staged.name, self.stop)
                if self.stop.is_set():
                    return
            t0 = time.perf_counter()
            agent.engine.apply([staged.name])  # every rank reads the file
            seconds = time.perf_counter() - t0
            agent.staging.remove(staged.name)
            if agent.group is not None:
                agent.group.release(self.spec.attempt, staged.name)
            with self.cond:
                self.staged[i] = None
                self.staged_bytes -= staged.size
                self.applied += 1
                self.applied_bytes += staged.size
                self.apply_s += seconds
                counters.payloads_applied += 1
                counters.payload_bytes_applied += staged.size
                counters.apply_seconds += seconds
                self.cond.notify_all()
        self._check()

    def _check(self) -> None:
        """Synchronize, then compare every fingerprint the manifest carries that the
        engine's ranks can recompute (every tensor and region, written or not), on the
        engine instance the attempt began with."""
        engine = self.agent.engine
        engine.sync()
        assert self.manifest is not None
        targets = {t.name: t.target for t in self.manifest.tensors}
        targets |= self.agent.region_sums(self.manifest)
        differ = engine.check_targets(targets) if targets else {}
        if differ:
            said = "; ".join(f"{n!r} holds {fp}, the manifest says {targets[n]}"
                             for n, fp in list(differ.items())[:3])
            raise FingerprintMismatch(f"{len(differ)} tensors or regions differ from the "
                                      f"manifest's target at flush (every one a rank holds "
                                      f"is compared, written by the attempt or not): "
                                      f"{said}.")
        instance = engine.instance()
        if instance != self.instance:
            with self.cond:
                self.agent.seen(instance)
            raise AttemptFailed(f"the engine restarted during the attempt (instance "
                                f"{short(self.instance)} -> {short(instance)}).")
        with self.cond:
            self.checked = True
            self.cond.notify_all()
