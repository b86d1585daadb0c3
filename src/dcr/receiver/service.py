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

What reaches the weights is vouched for, and checked after:

* Only payloads the attempt's manifest lists, with their size and digest, are applied:
  the receive thread holds each owner's payloads until that owner's manifest part (which
  it writes last) has arrived and lists them (:func:`~dcr.transport.receive.receive`,
  ``release="when_listed"``); payloads of owners outside the attempt are never fetched.
* Once everything is applied, the apply thread synchronizes the device and reads back
  every tensor the attempt wrote whose path preserves bits (the ``xor`` class, on a rank
  that holds the whole tensor) and compares its fingerprint with the target the
  manifest lists (:meth:`~dcr.apply.engine.ApplyEngine.check_targets`); ``flush``
  answers only after that.
* A foreign object under the attempt's prefix (:class:`~dcr.transport.receive.
  ForeignPayload`) or a fingerprint that differs (:class:`FingerprintMismatch`) fails
  the attempt and, if it had begun writing, makes the weights ``unknown``: a dense load
  restores them, never an overwrite retry, which rewrites only the changed set.

Calls that race are ordered by the state they need: ``open_apply`` needs the gate
closed *and drained* (``close_gate`` returned), so no generation request still reads
the weights; a dense load holds ``loading`` from its first check to its last write, and
``prepare`` and ``open_apply`` refuse meanwhile; ``stop_and_wait`` is idempotent, so two
concurrent stops both answer with the stopped attempt. Waits (``wait_staged``,
``flush``) are capped (``max_wait_s``) and end early when their key's ``cancel`` event
is set (the HTTP server sets it when the client goes away).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcr.errors import CheckpointError, DcrError
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
from dcr.receiver.host import DenseRefused, RuntimeHost, Tensors
from dcr.receiver.journal import Journal, JournalEntry
from dcr.receiver.settings import AgentSettings
from dcr.transport.receive import ForeignPayload, ReceiveStopped, Source, receive

log = logging.getLogger(__name__)
S = AttemptState


class AgentConflict(DcrError):
    """The call does not fit the agent's state (wrong attempt, version or gate)."""


class AttemptFailed(DcrError):
    """The current attempt failed on this agent; the cause is in the message."""


class FingerprintMismatch(DcrError):
    """After an attempt's payloads were applied, a tensor's bits differ from the target
    fingerprint its manifest lists."""




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
    touched: set[str] = field(default_factory=set)  # canonical tensors the payloads wrote
    checked: bool = False  # all applied, the device synchronized, fingerprints compared
    error: str | None = None
    threads: list[threading.Thread] = field(default_factory=list)


SourceFor = Callable[[AttemptSpec], Source]


class AgentService:
    """A ``ReceiverHandle`` in process; the HTTP server serves its methods, one per row
    of :class:`~dcr.protocol.agent_api.AgentApi`, under the same names."""

    def __init__(self, name: str, host: RuntimeHost, source_for: SourceFor, *, version: int,
                 journal: Journal | None = None,
                 staging_bytes: int = AgentSettings.staging_bytes,
                 checkpoint_root: Path | None = None,
                 max_wait_s: float = AgentSettings.max_wait_s) -> None:
        """``checkpoint_root``: dense loads only from under it (None: any path, for a
        caller in process, which is trusted with the file system anyway)."""
        self.name = name
        self.host = host
        self.source_for = source_for
        self.journal = journal
        self.staging_bytes = staging_bytes
        self.checkpoint_root = checkpoint_root.resolve() if checkpoint_root else None
        self.max_wait_s = max_wait_s
        self.counters = Counters()
        self._cond = threading.Condition()
        self._run: _Run | None = None
        self._obsolete: set[str] = set()
        self.version: int | None = version
        self.dirty: tuple[int, int] | None = None
        self.unknown: str | None = None
        self._drained = False  # the gate closed and no request in flight since (apply needs it)
        self._gate_opens = 0  # counts openings: a drain counts only if none came between
        self._loading: int | None = None  # the version a dense load is restoring
        self._known: tuple[int, dict[str, str]] | None = None  # a version's target fingerprints
        self.waits = 0  # waits in progress (metrics)
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

    def _not_loading(self, what: str) -> None:
        """Raise while a dense load runs; hold the lock."""
        if self._loading is not None:
            raise AgentConflict(f"{self.name}: a dense load of version {self._loading} is in "
                                f"progress; {what} waits until it has ended.")

    def _wait(self, ready: Callable[[], bool], wait_s: float, attempt: AttemptKey) -> bool:
        """Wait (holding the lock) until ``ready()``; False after ``wait_s``. Raises
        :class:`AgentConflict` once the key's ``cancel`` is set (an
        :class:`~dcr.protocol.agent_api.AttemptDeadline` from the server; see :meth:`wake`)."""
        cancel: threading.Event | None = getattr(attempt, "cancel", None)
        self.waits += 1
        try:
            done = self._cond.wait_for(
                lambda: ready() or (cancel is not None and cancel.is_set()), wait_s)
        finally:
            self.waits -= 1
        if cancel is not None and cancel.is_set() and not ready():
            raise AgentConflict(f"{self.name}: the wait was cancelled (its caller left).")
        return done

    def wake(self) -> None:
        """Let every wait look at its condition again (after its ``cancel`` was set)."""
        with self._cond:
            self._cond.notify_all()

    def alive(self, timeout_s: float) -> bool:
        """Whether the state lock can be taken within ``timeout_s``: no call holds it longer
        than a journal write, so failing means the control loop is wedged."""
        if not self._cond.acquire(timeout=timeout_s):
            return False
        self._cond.release()
        return True

    def prepare(self, attempt: Attempt | AttemptSpec) -> AgentStatus:
        spec = AttemptSpec.of(attempt)
        with self._cond:
            self._between_attempts("a new attempt")
            if spec.attempt in self._obsolete:
                raise AgentConflict(f"{self.name}: attempt {spec.attempt} is obsolete.")
            self._not_loading("a new attempt")
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
        with self._cond:
            opens = self._gate_opens
        self.host.runtime.close_gate()
        if not self.host.drain(timeout_s):
            raise AgentConflict(f"{self.name}: generation requests still in flight after "
                                f"{timeout_s} s with the gate closed.")
        with self._cond:
            self._drained = opens == self._gate_opens and not self.gate_open
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
            self._gate_up()  # clean weights hold ``version``: safe to serve
            return self.status()

    def _gate_up(self) -> None:
        """Open the request gate (hold the lock); a drain that began before no longer counts."""
        self._drained = False
        self._gate_opens += 1
        self.host.runtime.open_gate()

    def open_apply(self, attempt: AttemptKey) -> AgentStatus:
        with self._cond:
            run = self._current(attempt.id)
            if run.state in FINAL:
                raise AgentConflict(f"{self.name}: attempt {attempt.id} is {run.state.value}.")
            if self.gate_open:
                raise AgentConflict(f"{self.name}: close the request gate before applying "
                                    f"attempt {attempt.id}.")
            self._not_loading("an apply")
            if not self._drained:
                raise AgentConflict(f"{self.name}: the request gate is closed but requests "
                                    "may still be in flight; apply starts once close_gate "
                                    "has returned.")
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
        wait_s = min(seconds_left(attempt), self.max_wait_s)
        with self._cond:
            run = self._current(attempt.id)
            if not self._wait(lambda: run.received or run.error is not None
                              or run.stop.is_set(), wait_s, attempt):
                raise AttemptFailed(f"{self.name}: attempt {attempt.id} not staged after "
                                    f"{wait_s:.1f} s ({len(run.staged)} payloads).")
            if run.error:
                raise AttemptFailed(run.error)
            if run.stop.is_set():
                raise AgentConflict(f"{self.name}: attempt {attempt.id} was stopped.")
            return self.status()

    def flush(self, attempt: AttemptKey) -> FlushAck:
        t0, wait_s = time.perf_counter(), min(seconds_left(attempt), self.max_wait_s)
        with self._cond:
            run = self._current(attempt.id)
            if not run.apply_open.is_set():
                raise AgentConflict(f"{self.name}: flush before open_apply of {attempt.id}.")
            done = self._wait(lambda: run.error is not None or run.stop.is_set()
                              or run.checked, wait_s, attempt)
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
                self._move(run, S.FLUSHED)  # the apply thread synchronized and checked
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
            if run.manifest is not None and run.manifest.tensors:  # checks later dense loads
                self._known = (self.version, {t.name: t.target for t in run.manifest.tensors})
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
            if run.state not in FINAL:  # else a concurrent stop has finished it: idempotent
                run.staged.clear()
                run.staged_bytes = 0
                self._move(run, S.OBSOLETE)
            return self.status()

    def rejoin(self, version: int, checkpoint: str) -> AgentStatus:
        """Restore ``version`` from a full checkpoint through the runtime's loader.

        The checkpoint must lie under ``checkpoint_root``; where this agent knows the
        version's target fingerprints (from the manifest of the attempt it committed to
        it), the checkpoint must have them. Both are checked, and the whole checkpoint
        read, before anything is written: a refused load leaves the weights and the gate
        as they were. Errors name the check that failed, never bytes of the file.
        """
        path = self._dense_path(checkpoint)
        with self._cond:
            self._between_attempts("a dense refit")
            self._not_loading("another dense refit")
            self._loading, was_open = version, self.gate_open
        try:
            self.host.runtime.close_gate()
            if not self.host.drain(DRAIN_S):
                raise AgentConflict(f"{self.name}: requests still in flight; dense load "
                                    "refused.")
            tensors = self._read_dense(version, path)
        except BaseException:
            with self._cond:
                self._loading = None
                if was_open and not self.gate_open:
                    self._gate_up()  # nothing was written: serve as before
            raise
        try:
            with self._cond:
                self.version, self.dirty, self.unknown = None, None, f"dense load of {version}"
                self._journal()
            self.host.load_tensors(tensors)
            with self._cond:
                self.version, self.unknown = version, None
                self.counters.dense_loads += 1
                self._journal()
        finally:
            with self._cond:
                self._loading = None
        log.info("%s: restored version %s by a dense load of %s", self.name, version, path)
        return self.open_gate()

    def _dense_path(self, checkpoint: str) -> Path:
        root = self.checkpoint_root
        if root is None:
            return Path(checkpoint)
        path = (root / checkpoint).resolve()  # an absolute ``checkpoint`` replaces ``root``
        if not path.is_relative_to(root):
            raise AgentConflict(f"{self.name}: dense loads come from under {root}; "
                                f"{checkpoint!r} is not there.")
        return path

    def _read_dense(self, version: int, path: Path) -> Tensors:
        known = self._known
        expect = known[1] if known is not None and known[0] == version else None
        try:
            return self.host.read_dense(path, expect=expect, root=self.checkpoint_root)
        except DenseRefused as e:
            raise AgentConflict(f"{self.name}: dense load of version {version} refused: "
                                f"{e}") from e
        except CheckpointError as e:  # its sentence may quote the file: the log has it
            log.warning("%s: dense load of %s refused: %s", self.name, path, e)
            raise AgentConflict(f"{self.name}: dense load of version {version} refused: "
                                f"{path} is not a readable safetensors checkpoint (the "
                                "agent's log says why).") from e

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
                if isinstance(e, ForeignPayload | FingerprintMismatch) and self.dirty:
                    # Bits no manifest vouches for may be in the weights, or ones that differ
                    # from its targets: an overwrite of the changed set would not repair them.
                    self.version, self.dirty = None, None
                    self.unknown = (f"attempt {run.spec.attempt} found {type(e).__name__} "
                                    "after writing; a dense load must restore a version")
                    log.warning("%s: %s", self.name, self.unknown)
                    self._journal()
                self._cond.notify_all()

    def _receive(self, run: _Run) -> None:
        spec = run.spec
        source = self.source_for(spec)
        try:
            manifest = receive(source, spec.attempt, lambda p: self._stage(run, p),
                               owners=spec.owners, release="when_listed",
                               hold_bytes=self.staging_bytes,
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
                self._cond.wait_for(lambda: run.stop.is_set() or run.error is not None
                                    or run.applied < len(run.staged) or run.received)
                if run.stop.is_set() or run.error is not None:
                    return
                if i >= len(run.staged):
                    break  # received and all applied: check, then flush finishes the attempt
                payload = run.staged[i]
            assert payload is not None
            t0 = time.perf_counter()
            report = self.host.engine.apply_payloads([payload])
            seconds = time.perf_counter() - t0
            with self._cond:
                run.staged[i] = None
                run.staged_bytes -= payload.size
                run.applied += 1
                run.applied_bytes += payload.size
                run.apply_s += seconds
                run.touched |= report.names
                self.counters.payloads_applied += 1
                self.counters.payload_bytes_applied += payload.size
                self.counters.apply_seconds += seconds
                self._cond.notify_all()
        self._check(run)

    def _check(self, run: _Run) -> None:
        """Synchronize, then compare the fingerprints of what the attempt wrote."""
        self.host.sync()
        assert run.manifest is not None
        targets = {t.name: t.target for t in run.manifest.tensors if t.name in run.touched}
        differ = self.host.engine.check_targets(targets)
        if differ:
            said = "; ".join(f"{n!r} holds {fp}, the manifest says {targets[n]}"
                             for n, fp in list(differ.items())[:3])
            raise FingerprintMismatch(f"{len(differ)} tensors differ from the manifest's "
                                      f"target after apply: {said}.")
        with self._cond:
            run.checked = True
            self._cond.notify_all()
