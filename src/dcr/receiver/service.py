"""The agent's protocol logic (docs/protocol.md), one attempt at a time.

``prepare`` admits an attempt and starts a receive thread that pulls the attempt's
payloads from the source (object store or relay node), verifies them and stages them
compressed in host memory, so a server in asynchronous RL keeps serving the old
version meanwhile. ``open_apply`` (only with the request gate closed) starts the apply
thread, which applies staged payloads through the runtime's loader in the attempt's
declared order while later payloads still arrive. ``flush`` waits until every payload
the manifest lists has been applied and the device is synchronized; ``committed`` then
moves the held version forward. ``stop_and_wait`` makes the attempt obsolete and
returns only after both threads have ended, so no write of it can still happen.

What the weights hold is tracked exactly: ``version`` while they hold one, ``dirty =
(base, target)`` from just before the first write of an attempt until a commit or a
dense load settles it. Dirty weights only accept an overwrite attempt of the same
transition (absolute values repair any mix of old and new bits) or a dense load, and
the gate will not reopen on them. The journal records all of it before it happens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcr.errors import DcrError
from dcr.format.manifest import Manifest
from dcr.format.payload import Payload
from dcr.protocol.agent_api import (
    DRAIN_S,
    AgentStatus,
    AttemptKey,
    AttemptSpec,
    FlushAck,
    seconds_left,
)
from dcr.protocol.records import Attempt
from dcr.protocol.state import FINAL, AttemptState, advance
from dcr.receiver.host import RuntimeHost
from dcr.receiver.journal import Journal, JournalEntry
from dcr.receiver.settings import AgentSettings
from dcr.transport.receive import ReceiveStopped, Source, receive

log = logging.getLogger(__name__)
S = AttemptState


class AgentConflict(DcrError):
    """The call does not fit the agent's state (wrong attempt, version or gate)."""


class AttemptFailed(DcrError):
    """The current attempt failed on this agent; the cause is in the message."""


@dataclass(kw_only=True)
class Counters:
    """What ``/metrics`` exports (monotonic counts and seconds)."""

    payloads_applied: int = 0
    payload_bytes_applied: int = 0
    apply_seconds: float = 0.0
    attempts: dict[str, int] = field(default_factory=dict)  # by final outcome
    dense_loads: int = 0


@dataclass(eq=False, kw_only=True)
class _Run:
    spec: AttemptSpec
    state: AttemptState = S.PREPARED
    stop: threading.Event = field(default_factory=threading.Event)
    apply_open: threading.Event = field(default_factory=threading.Event)
    staged: list[Payload | None] = field(default_factory=list)  # verified once, on receipt
    staged_bytes: int = 0  # staged, not yet applied
    received: bool = False  # the manifest closed the attempt: nothing more will be staged
    manifest: Manifest | None = None
    applied: int = 0
    applied_bytes: int = 0
    apply_s: float = 0.0
    error: str | None = None
    threads: list[threading.Thread] = field(default_factory=list)


SourceFor = Callable[[AttemptSpec], Source]


class AgentService:
    """A ``ReceiverHandle`` in process; the HTTP server serves its methods, one per row
    of :class:`~dcr.protocol.agent_api.AgentApi`, under the same names."""

    def __init__(self, name: str, host: RuntimeHost, source_for: SourceFor, *, version: int,
                 journal: Journal | None = None,
                 staging_bytes: int = AgentSettings.staging_bytes) -> None:
        self.name = name
        self.host = host
        self.source_for = source_for
        self.journal = journal
        self.staging_bytes = staging_bytes
        self.counters = Counters()
        self._cond = threading.Condition()
        self._run: _Run | None = None
        self._obsolete: set[str] = set()
        self.version: int | None = version
        self.dirty: tuple[int, int] | None = None
        self.unknown: str | None = None
        last = journal.load() if journal else None
        if last is not None and (last.dirty is not None or last.state in ("applying", "flushed")
                                 or last.version is None):
            # Unknown stays unknown across restarts (the journal says version None) until
            # a dense load settles it.
            self.version = None
            self.unknown = (f"restarted while attempt {last.attempt} was {last.state} with "
                            f"writes of {last.dirty} unsettled" if last.version is not None
                            or last.dirty is not None else
                            "restarted while the version was unknown")
            log.warning("%s: %s; a dense refit must restore a version", name, self.unknown)
        self._journal()

    # --- state ---------------------------------------------------------------------

    def _journal(self) -> None:
        if self.journal is None:
            return
        run = self._run
        self.journal.save(JournalEntry(
            version=self.version, dirty=self.dirty,
            attempt=run.spec.attempt if run else None,
            state=run.state.value if run else None,
        ))

    def _move(self, run: _Run, to: AttemptState) -> None:
        run.state = advance(run.spec.attempt, run.state, to)
        if to in FINAL:
            outcome = to.value
            self.counters.attempts[outcome] = self.counters.attempts.get(outcome, 0) + 1
        self._journal()
        log.info("%s: attempt %s -> %s", self.name, run.spec.attempt, to.value)

    def _current(self, attempt: str) -> _Run:
        run = self._run
        if run is None or run.spec.attempt != attempt:
            have = f"{run.spec.attempt} ({run.state.value})" if run else "none"
            raise AgentConflict(f"{self.name}: attempt {attempt} is not current; current: {have}.")
        return run

    def status(self) -> AgentStatus:
        with self._cond:
            run = self._run
            return AgentStatus(
                name=self.name, version=None if self.dirty else self.version, dirty=self.dirty,
                unknown=self.unknown, attempt=run.spec.attempt if run else None,
                state=run.state.value if run else None, error=run.error if run else None,
                gate_open=self.gate_open,
                payloads_staged=len(run.staged) if run else 0,
                payloads_applied=run.applied if run else 0,
                bytes_staged=run.staged_bytes if run else 0,
            )

    @property
    def gate_open(self) -> bool:
        gate = getattr(self.host.runtime, "gate", None)
        return bool(gate.is_open) if gate is not None else False

    # --- protocol calls ------------------------------------------------------------

    def _between_attempts(self, what: str) -> None:
        """Raise unless the last attempt has ended (committed or stopped); hold the lock."""
        run = self._run
        if run is not None and run.state not in FINAL:
            raise AgentConflict(f"{self.name}: attempt {run.spec.attempt} is "
                                f"{run.state.value}; {what} happens between attempts "
                                "(stop it first).")

    def prepare(self, attempt: Attempt | AttemptSpec) -> AgentStatus:
        spec = AttemptSpec.of(attempt)
        with self._cond:
            self._between_attempts("a new attempt")
            if spec.attempt in self._obsolete:
                raise AgentConflict(f"{self.name}: attempt {spec.attempt} is obsolete.")
            transition = (spec.base_version, spec.target_version)
            if self.unknown is not None:
                raise AgentConflict(f"{self.name}: version unknown ({self.unknown}); a dense "
                                    "refit must restore the committed version first.")
            if self.dirty is not None and (self.dirty != transition or spec.mode != "overwrite"):
                raise AgentConflict(
                    f"{self.name}: weights hold a mix of {self.dirty[0]} and {self.dirty[1]}; "
                    f"only an overwrite attempt of {self.dirty[0]} -> {self.dirty[1]} or a "
                    f"dense refit can repair them, not {spec.mode} {transition}."
                )
            if self.dirty is None and self.version != spec.base_version:
                raise AgentConflict(f"{self.name}: holds version {self.version}; attempt "
                                    f"{spec.attempt} is for base {spec.base_version}.")
            run = _Run(spec=spec)
            self._run = run
            self._journal()
            self._move(run, S.STREAMING)
            self._start(run, self._receive, "receive")
            return self.status()

    def close_gate(self, timeout_s: float = DRAIN_S) -> AgentStatus:
        self.host.runtime.close_gate()
        if not self.host.drain(timeout_s):
            raise AgentConflict(f"{self.name}: generation requests still in flight after "
                                f"{timeout_s} s with the gate closed.")
        with self._cond:
            run = self._run
            if run is not None and run.state in (S.PREPARED, S.STREAMING, S.STAGED):
                self._move(run, S.GATE_CLOSED)
            return self.status()

    def open_gate(self) -> AgentStatus:
        with self._cond:  # under the lock: open_apply cannot start writes meanwhile
            if self.dirty is not None or self.unknown is not None:
                raise AgentConflict(f"{self.name}: will not serve weights that hold no version "
                                    f"(dirty {self.dirty}, unknown {self.unknown}).")
            run = self._run
            if run is not None and run.state not in FINAL and run.apply_open.is_set():
                raise AgentConflict(f"{self.name}: attempt {run.spec.attempt} is applying; "
                                    "the gate opens after its commit or stop.")
            self.host.runtime.open_gate()  # clean weights hold ``version``: safe to serve
            return self.status()

    def open_apply(self, attempt: AttemptKey) -> AgentStatus:
        with self._cond:
            run = self._current(attempt.id)
            if run.state in FINAL:
                raise AgentConflict(f"{self.name}: attempt {attempt.id} is {run.state.value}.")
            if self.gate_open:
                raise AgentConflict(f"{self.name}: close the request gate before applying "
                                    f"attempt {attempt.id}.")
            if run.error:
                raise AttemptFailed(run.error)
            if run.stop.is_set():
                raise AgentConflict(f"{self.name}: attempt {attempt.id} is being stopped.")
            if not run.apply_open.is_set():
                if run.state in (S.STREAMING, S.STAGED):  # the gate closed before prepare
                    self._move(run, S.GATE_CLOSED)
                self.dirty = (run.spec.base_version, run.spec.target_version)
                self._move(run, S.APPLYING)  # journaled dirty before the first write
                run.apply_open.set()
                self._start(run, self._apply, "apply")
            return self.status()

    def wait_staged(self, attempt: AttemptKey) -> AgentStatus:
        wait_s = seconds_left(attempt)
        with self._cond:
            run = self._current(attempt.id)
            if not self._cond.wait_for(lambda: run.received or run.error is not None
                                       or run.stop.is_set(), wait_s):
                raise AttemptFailed(f"{self.name}: attempt {attempt.id} not staged after "
                                    f"{wait_s:.1f} s ({len(run.staged)} payloads).")
            if run.error:
                raise AttemptFailed(run.error)
            if run.stop.is_set():
                raise AgentConflict(f"{self.name}: attempt {attempt.id} was stopped.")
            return self.status()

    def flush(self, attempt: AttemptKey) -> FlushAck:
        t0, wait_s = time.perf_counter(), seconds_left(attempt)
        with self._cond:
            run = self._current(attempt.id)
            if not run.apply_open.is_set():
                raise AgentConflict(f"{self.name}: flush before open_apply of {attempt.id}.")
            done = self._cond.wait_for(
                lambda: run.error is not None or run.stop.is_set() or run.state is S.FLUSHED
                or (run.received and run.applied == len(run.staged)), wait_s)
            if run.error:
                raise AttemptFailed(run.error)
            if run.stop.is_set() or run.state is S.OBSOLETE:
                raise AgentConflict(f"{self.name}: attempt {attempt.id} was stopped.")
            if not done:
                raise AttemptFailed(
                    f"{self.name}: attempt {attempt.id} not flushed after {wait_s:.1f} s "
                    f"({run.applied}/{len(run.staged)} staged payloads applied, manifest "
                    f"{'in' if run.received else 'not in'}).")
            if run.state is S.APPLYING:  # else already flushed (or committed): idempotent
                self.host.sync()
                self._move(run, S.FLUSHED)
            return FlushAck(attempt=attempt.id, payloads=run.applied, bytes=run.applied_bytes,
                            apply_s=run.apply_s, wait_s=time.perf_counter() - t0)

    def committed(self, attempt: str) -> AgentStatus:
        with self._cond:
            run = self._current(attempt)
            if run.state is S.COMMITTED:
                return self.status()
            if run.state is not S.FLUSHED:
                raise AgentConflict(f"{self.name}: attempt {attempt} is "
                                    f"{run.state.value}, not flushed; it cannot be committed.")
            self.version, self.dirty = run.spec.target_version, None
            self._move(run, S.COMMITTED)
            return self.status()

    def stop_and_wait(self, attempt: str) -> AgentStatus:
        with self._cond:
            self._obsolete.add(attempt)
            run = self._run
            if run is None or run.spec.attempt != attempt or run.state in FINAL:
                return self.status()
            run.stop.set()
            self._cond.notify_all()
            threads = list(run.threads)
        for t in threads:  # an apply in progress finishes its payload, then nothing more
            t.join()
        with self._cond:
            run.staged.clear()
            run.staged_bytes = 0
            self._move(run, S.OBSOLETE)
            return self.status()

    def rejoin(self, version: int, checkpoint: str) -> AgentStatus:
        """Restore ``version`` from a full checkpoint through the runtime's loader."""
        with self._cond:
            self._between_attempts("a dense refit")
            self.host.runtime.close_gate()
        if not self.host.drain(DRAIN_S):
            raise AgentConflict(f"{self.name}: requests still in flight; dense load refused.")
        with self._cond:
            self.version, self.dirty, self.unknown = None, None, f"dense load of {version}"
            self._journal()
        self.host.load_dense(Path(checkpoint))
        with self._cond:
            self.version, self.unknown = version, None
            self.counters.dense_loads += 1
            self._journal()
        log.info("%s: restored version %s by a dense load of %s", self.name, version,
                 checkpoint)
        return self.open_gate()

    # --- inspection ----------------------------------------------------------------

    def profile(self) -> dict[str, Any]:
        """The loader's class of every canonical tensor (what the sender encodes for)."""
        return {"tensors": self.host.profile.tensors}

    def fingerprint(self) -> dict[str, str]:
        """xxh3-128 of every parameter and buffer's integer view (bit-exact checks)."""
        return self.host.fingerprint()

    # --- threads -------------------------------------------------------------------

    def _start(self, run: _Run, target: Callable[[_Run], None], what: str) -> None:
        t = threading.Thread(target=self._guard, args=(run, target),
                             name=f"{what}-{run.spec.attempt}", daemon=True)
        run.threads.append(t)
        t.start()

    def _guard(self, run: _Run, target: Callable[[_Run], None]) -> None:
        try:
            target(run)
        except ReceiveStopped:
            pass
        except Exception as e:  # the attempt fails; the coordinator retries by overwrite
            with self._cond:
                if run.error is None and not run.stop.is_set():
                    run.error = f"{self.name}: attempt {run.spec.attempt}: {e}"
                    log.warning("%s", run.error)
                self._cond.notify_all()

    def _receive(self, run: _Run) -> None:
        spec = run.spec
        source = self.source_for(spec)
        try:
            manifest = receive(source, spec.attempt, lambda p: self._stage(run, p),
                               timeout_s=max(0.1, spec.deadline - time.time()), stop=run.stop)
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a relay source holds a loop thread and a session
                close()
        with self._cond:
            run.manifest, run.received = manifest, True
            if run.state is S.STREAMING:
                self._move(run, S.STAGED)
            self._cond.notify_all()

    def _stage(self, run: _Run, payload: Payload) -> None:
        size = payload.size
        with self._cond:  # back-pressure: staged but unapplied bytes stay bounded
            def fits() -> bool:
                return run.staged_bytes == 0 or (
                    run.staged_bytes + size <= self.staging_bytes)

            if not fits() and not run.apply_open.is_set():
                # Staging before the gate closes (asynchronous RL) must hold the whole
                # attempt: waiting for space nobody frees would only run into the deadline.
                raise AttemptFailed(
                    f"staging it needs more than the budget of {self.staging_bytes} bytes "
                    "before apply opens; raise --staging-mib or close the gate at the start "
                    "(sync RL).")
            self._cond.wait_for(lambda: run.stop.is_set() or fits())
            if run.stop.is_set():
                raise ReceiveStopped(f"attempt {run.spec.attempt} stopped")
            run.staged.append(payload)  # kept verified: the apply thread does not parse again
            run.staged_bytes += size
            self._cond.notify_all()

    def _apply(self, run: _Run) -> None:
        while True:
            i = run.applied
            with self._cond:
                self._cond.wait_for(lambda: run.stop.is_set() or run.applied < len(run.staged)
                                    or run.received)
                if run.stop.is_set():
                    return
                if i >= len(run.staged):
                    return  # received and all applied: flush finishes the attempt
                payload = run.staged[i]
            assert payload is not None
            t0 = time.perf_counter()
            self.host.engine.apply_payloads([payload])
            seconds = time.perf_counter() - t0
            with self._cond:
                run.staged[i] = None
                run.staged_bytes -= payload.size
                run.applied += 1
                run.applied_bytes += payload.size
                run.apply_s += seconds
                self.counters.payloads_applied += 1
                self.counters.payload_bytes_applied += payload.size
                self.counters.apply_seconds += seconds
                self._cond.notify_all()
