"""The agent's protocol calls, one attempt at a time, over an engine it drives.

The engine is behind :class:`~dcr.drivers.base.Driver`; the state lock is never held across
an engine call. docs/protocol.md argues the design.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dcr.drivers.base import Driver, PauseMode, TensorSpec, merge_fingerprints
from dcr.drivers.errors import EngineError
from dcr.format.manifest import Manifest
from dcr.format.profile import ReceiverProfile
from dcr.format.regions import region_key, whole
from dcr.protocol.agent_api import (
    AgentStatus,
    AttemptKey,
    AttemptSpec,
    FlushAck,
    seconds_left,
)
from dcr.protocol.records import Attempt
from dcr.protocol.state import FINAL, advance
from dcr.protocol.states import AttemptState
from dcr.receiver.attempt import (
    AgentConflict,
    AttemptFailed,
    Counters,
    FingerprintMismatch,
    Run,
)
from dcr.receiver.fromstore import FromStore
from dcr.receiver.group import Group, GroupError
from dcr.receiver.journal import Journal
from dcr.receiver.rejoin import restore
from dcr.receiver.settings import AgentSettings
from dcr.receiver.staging import StagingDir
from dcr.receiver.weights import Weights, short
from dcr.transport.receive import ForeignPayload, Source

__all__ = ["AgentConflict", "AgentService", "AttemptFailed", "Counters",
           "FingerprintMismatch", "SourceFor"]

log = logging.getLogger(__name__)
S = AttemptState


SourceFor = Callable[[AttemptSpec], Source]
LABEL_RETRY_S = (0.2, 1.0, 3.0)  # pauses between tries to set the engine's version label


class AgentService:
    """A ``ReceiverHandle`` in process; the HTTP server serves its methods, one per row
    of :class:`~dcr.protocol.agent_api.AgentApi`, under the same names."""

    def __init__(self, name: str, engine: Driver, source_for: SourceFor, *,
                 canonical: Sequence[TensorSpec], staging_dir: Path, version: int,
                 journal: Journal | None = None,
                 staging_bytes: int = AgentSettings.staging_bytes,
                 checkpoint_root: Path | None = None,
                 store: FromStore | None = None,
                 max_wait_s: float = AgentSettings.max_wait_s,
                 pause_mode: PauseMode = AgentSettings.pause_mode,
                 group: Group | None = None, trust_labels: bool = True) -> None:
        """``canonical``: the tensors the engine's ranks are prewarmed with.
        ``staging_dir``: the directory shared with the engine, as this process sees it.
        ``checkpoint_root``: dense loads only from under it, passed to the engine
        relative to it (the engine resolves them under its own checkpoint root).
        ``store``: the store's history; with it every dense load is checked against
        the fingerprints it vouches for, and a rejoin needs no checkpoint path (the
        version is built under ``checkpoint_root`` from the store). ``group``: the member
        agents of a replica spanning pods, whose engine this agent drives as its leader.
        ``trust_labels``: without ``store``, whether a checkpoint's version label alone may
        decide a dense load nothing can check (in-process callers that made the checkpoint;
        ``dcr agent`` refuses: :func:`dcr.receiver.rejoin.unverifiable`)."""
        self.name = name
        self.engine = engine
        self.group = group
        self.source_for = source_for
        self.canonical = list(canonical)
        self.staging = StagingDir(staging_dir)
        self.staging_bytes = staging_bytes
        self.checkpoint_root = checkpoint_root.resolve() if checkpoint_root else None
        self.store = store
        self.trust_labels = trust_labels
        self.max_wait_s = max_wait_s
        self.pause_mode = pause_mode
        self.counters = Counters()
        self._cond = threading.Condition()
        self._gate_lock = threading.Lock()  # orders pause and resume calls to the engine
        self._engine_lock = threading.Lock()  # orders instance reads and prewarms
        self._run: Run | None = None
        self._obsolete: set[str] = set()
        self.weights = Weights(name, version, journal, AgentConflict)
        self._prewarmed: tuple[str, ReceiverProfile] | None = None  # instance, profile
        self._checkable: frozenset[str] = frozenset()  # its region keys (region_sums)
        self._prewarming = False
        # The engine serves until the agent first pauses it; after a restart with unsettled
        # writes it may still be paused, and a dense load opens it.
        self._gate_open = self.weights.unknown is None
        self._drained = False  # the gate closed and no request in flight since (apply needs it)
        self._gate_opens = 0  # counts openings: a drain counts only if none came between
        self._loading: int | None = None  # the version a dense load is restoring
        # The label the engine must carry before it serves. An agent restarted from its
        # journal cannot know whether it set the label before it stopped (it may have
        # died between a commit and reopening the gate), so it sets it again first.
        self._label_due: int | None = self.weights.version if self.weights.restored else None
        self._label_error: str | None = None  # why the gate stays closed without it
        self.label_retry_s: Sequence[float] = LABEL_RETRY_S
        self.waits = 0  # waits in progress (metrics)
        removed = self.staging.clear()
        if removed:
            log.info("%s: removed %d staged files an earlier run left", name, removed)
        self._journal()

    # --- state ---------------------------------------------------------------------

    def _journal(self) -> None:
        run = self._run
        self.weights.save(run.spec.attempt if run else None, run.state.value if run else None)

    def move(self, run: Run, to: AttemptState) -> None:
        run.state = advance(run.spec.attempt, run.state, to)
        if to in FINAL:
            outcome = to.value
            self.counters.attempts[outcome] = self.counters.attempts.get(outcome, 0) + 1
        self._journal()
        log.info("%s: attempt %s -> %s", self.name, run.spec.attempt, to.value)

    def _current(self, attempt: str) -> Run:
        run = self._run
        if run is None or run.spec.attempt != attempt:
            have = f"{run.spec.attempt} ({run.state.value})" if run else "none"
            raise AgentConflict(f"{self.name}: attempt {attempt} is not current; current: {have}.")
        return run

    def _busy(self) -> bool:
        """An attempt has not ended, or a dense load runs; hold the lock."""
        run = self._run
        return (run is not None and run.state not in FINAL) or self._loading is not None

    def status(self) -> AgentStatus:
        """The agent's state; between attempts it first reads the engine's instance id
        (admission happens there), so a restarted engine shows as unknown weights.
        Raises :class:`~dcr.drivers.errors.EngineError` while the engine does not
        answer, or is being prewarmed: such a receiver is not admitted. Never waits for
        a prewarm, so the status threads stay free for the liveness probe."""
        with self._cond:
            busy, prewarming = self._busy(), self._prewarming
        if prewarming:
            raise EngineError(f"{self.name}: the engine is being prewarmed; not ready yet.",
                              503, call="prewarm")
        if not busy:
            self.attach(prewarm=False)
        return self.snapshot()

    def snapshot(self) -> AgentStatus:
        """The agent's state as it knows it, without asking the engine."""
        with self._cond:
            run = self._run
            return AgentStatus(
                name=self.name, version=self.weights.held, dirty=self.weights.dirty,
                unknown=self.weights.unknown, attempt=run.spec.attempt if run else None,
                state=run.state.value if run else None,
                error=(run.error if run else None) or self._label_error,
                gate_open=self._gate_open,
                payloads_staged=len(run.staged) if run else 0,
                payloads_applied=run.applied if run else 0,
                bytes_staged=run.staged_bytes if run else 0,
            )

    @property
    def gate_open(self) -> bool:
        return self._gate_open

    # --- the engine ----------------------------------------------------------------

    def attach(self, *, prewarm: bool = True) -> str:
        """Read the engine's instance id and take note of a restart; with ``prewarm``,
        prewarm an instance not prewarmed yet (never during an attempt or a dense load).
        The id."""
        with self._engine_lock:
            instance = self.engine.instance()
            with self._cond:
                self.seen(instance)
                fresh = self._prewarmed is None or self._prewarmed[0] != instance
                if not (prewarm and fresh) or self._busy():
                    return instance
                self._prewarming = True
            try:
                prewarmed = self.engine.prewarm(self.canonical)
            finally:
                with self._cond:
                    self._prewarming = False
            profile = prewarmed.profile
            checkable = self._regions_of(profile)  # once per prewarm, not per flush
            with self._cond:
                self._prewarmed = (instance, profile)
                self._checkable = checkable
                if prewarmed.unfilled and self.weights.forget(
                        f"the engine computes {', '.join(prewarmed.unfilled[:3])} and other "
                        "layers from a form it derived after loading, whose loading form DCR "
                        "keeps only from a dense load through it"):
                    self._journal()
            log.info("%s: engine %s prewarmed (%d tensors)", self.name, short(instance),
                     len(profile.tensors))
            return instance

    def seen(self, instance: str) -> None:
        """The engine answered ``instance``; hold the lock. Another id than before means
        the engine restarted: its weights are unknown, and an attempt in progress fails."""
        if instance == self.weights.instance:
            return
        if self.weights.seen(instance) is not None:
            run = self._run
            if run is not None and run.state not in FINAL and run.error is None:
                run.error = (f"{self.name}: attempt {run.spec.attempt}: the engine "
                             "restarted during the attempt.")
            self._cond.notify_all()
        self._journal()

    def _pause(self) -> None:
        """Close the engine's gate (``pause_mode``); returns once it is closed."""
        with self._gate_lock:
            with self._cond:
                self._gate_open = False
            self.engine.pause(self.pause_mode)

    def _resume(self) -> None:
        """Open the gate: the weights hold a version, and the engine labels it so first."""
        with self._gate_lock:
            with self._cond:
                due = self._servable()
            if due is not None:
                self._set_label(due)  # raises, the gate closed, where it cannot be set
            with self._cond:  # under the lock: open_apply cannot start writes meanwhile
                if self._servable() is not None:
                    raise AgentConflict(f"{self.name}: another version label became due "
                                        "while the gate was opening; open it again.")
                self._drained = False
                self._gate_opens += 1
                self._gate_open = True  # clean weights hold ``version``: safe to serve
            try:
                self.engine.resume()
            except BaseException:
                with self._cond:
                    self._gate_open = False
                raise

    def _servable(self) -> int | None:
        """Raise unless the weights may serve now; the label still to set first, if any.
        Hold the lock."""
        w = self.weights
        if not w.servable:
            raise AgentConflict(f"{self.name}: will not serve weights that hold no "
                                f"version (dirty {w.dirty}, unknown {w.unknown}).")
        run = self._run
        if run is not None and run.state not in FINAL and run.apply_open.is_set():
            raise AgentConflict(f"{self.name}: attempt {run.spec.attempt} is "
                                "applying; the gate opens after its commit or stop.")
        return self._label_due

    def _set_label(self, version: int) -> None:
        """Set the engine's label to ``version``, retried after each pause of
        ``label_retry_s`` (every call bounded by the driver's own timeout); where it cannot
        be set, :class:`AgentConflict` says why and the status reports it."""
        error: EngineError | None = None
        for pause in (0.0, *self.label_retry_s):
            time.sleep(pause)
            try:
                self._same_engine(version)  # a retry may meet an engine that restarted
                self.engine.set_version(str(version))
                self._same_engine(version, labelled=True)
            except EngineError as e:
                error = e
                continue
            with self._cond:
                if self._label_due == version:
                    self._label_due, self._label_error = None, None
            return
        why = (f"{self.name}: the request gate stays closed: the weights hold version "
               f"{version}, but the engine's version label could not be set to it in "
               f"{1 + len(self.label_retry_s)} tries ({error}); they would serve under "
               "an older label.")
        with self._cond:
            self._label_error = why
        log.warning("%s", why)
        raise AgentConflict(why)

    def _same_engine(self, version: int, labelled: bool = False) -> None:
        """Raise unless the engine is still the instance the weights were written to: a
        restarted one holds what it loaded at start, and ``version``'s label would lie
        about its outputs. One that restarted during the label call (``labelled``) got
        the label: its gate is closed, so it serves nothing until a dense load."""
        now = self.engine.instance()
        with self._cond:
            self.seen(now)
            if self.weights.servable:
                return
            why = (f"{self.name}: the engine restarted before its version label was set to "
                   f"{version}: {self.weights.unknown}; the gate stays closed until a dense "
                   "load.")
            self._label_due, self._label_error = None, why
        log.warning("%s", why)
        if labelled:
            with contextlib.suppress(EngineError):
                self.engine.pause(self.pause_mode)
        raise AgentConflict(why)

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
        if self.store is not None:
            self.store.vouch(spec.history_digest, spec.target_version, spec.owners)
        with self._cond:
            self._between_attempts("a new attempt")
            self._not_loading("a new attempt")
        instance = self.attach()  # a restarted engine makes the weights unknown first
        if self.group is not None:
            try:
                self.group.stage(spec)
            except GroupError as e:
                raise AgentConflict(f"{self.name}: {e}") from e
        with self._cond:
            self._between_attempts("a new attempt")
            if spec.attempt in self._obsolete:
                raise AgentConflict(f"{self.name}: attempt {spec.attempt} is obsolete.")
            self._not_loading("a new attempt")
            self.weights.admit(spec)
            if self.weights.instance != instance:  # it restarted again since attach read it
                raise AgentConflict(f"{self.name}: the engine restarted while attempt "
                                    f"{spec.attempt} was being prepared.")
            run = Run(spec=spec, instance=instance, agent=self, cond=self._cond)
            self._run = run
            self._journal()
            self.move(run, S.STREAMING)
            run.start_receive(self.source_for)
            return self.snapshot()

    def close_gate(self) -> AgentStatus:
        """Pause the engine (``pause_mode``: ``wait`` lets requests in flight finish);
        returns once it has."""
        with self._cond:
            opens = self._gate_opens
        self._pause()
        with self._cond:
            self._drained = opens == self._gate_opens and not self._gate_open
            run = self._run
            if run is not None and run.state in (S.PREPARED, S.STREAMING, S.STAGED):
                self.move(run, S.GATE_CLOSED)
        return self.snapshot()

    def open_gate(self) -> AgentStatus:
        self._resume()
        return self.snapshot()

    def open_apply(self, attempt: AttemptKey) -> AgentStatus:
        with self._cond:
            run = self._current(attempt.id)
            if run.state in FINAL:
                raise AgentConflict(f"{self.name}: attempt {attempt.id} is {run.state.value}.")
            if self._gate_open:
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
                    self.move(run, S.GATE_CLOSED)
                self.weights.writing(run.spec)
                self.move(run, S.APPLYING)  # journaled dirty before the first write
                run.start_apply()
            return self.snapshot()

    def wait_staged(self, attempt: AttemptKey) -> AgentStatus:
        wait_s = min(seconds_left(attempt), self.max_wait_s)
        with self._cond:
            run = self._current(attempt.id)
            run.owners_published()  # the coordinator asks once the owners have published
            if not self._wait(lambda: run.received or run.error is not None
                              or run.stop.is_set(), wait_s, attempt):
                raise AttemptFailed(f"{self.name}: attempt {attempt.id} not staged after "
                                    f"{wait_s:.1f} s ({len(run.staged)} payloads).")
            if run.error:
                raise AttemptFailed(run.error)
            if run.stop.is_set():
                raise AgentConflict(f"{self.name}: attempt {attempt.id} was stopped.")
        return self.snapshot()

    def flush(self, attempt: AttemptKey) -> FlushAck:
        t0, wait_s = time.perf_counter(), min(seconds_left(attempt), self.max_wait_s)
        with self._cond:
            run = self._current(attempt.id)
            if not run.apply_open.is_set():
                raise AgentConflict(f"{self.name}: flush before open_apply of {attempt.id}.")
            run.owners_published()  # the coordinator asks once the owners have published
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
                self.move(run, S.FLUSHED)  # the apply thread synchronized and checked
            return FlushAck(attempt=attempt.id, payloads=run.applied, bytes=run.applied_bytes,
                            apply_s=run.apply_s, wait_s=time.perf_counter() - t0)

    def committed(self, attempt: str, history_digest: str | None = None) -> AgentStatus:
        """The record names ``attempt``; from now on the store's history is the one
        ``history_digest`` names (the new record's), so a later dense load of the committed
        version is checked against a history that names it."""
        with self._cond:
            run = self._current(attempt)
            if run.state not in (S.FLUSHED, S.COMMITTED):
                raise AgentConflict(f"{self.name}: attempt {attempt} is "
                                    f"{run.state.value}, not flushed; it cannot be committed.")
            if self.store is not None and history_digest is not None:
                self.store.vouch(history_digest, run.spec.target_version)
            if run.state is S.COMMITTED:
                return self.snapshot()
            version = run.spec.target_version
            manifest = run.manifest  # its targets check later dense loads of ``version``
            self.weights.committed(version, {t.name: t.target for t in manifest.tensors}
                                   if manifest is not None else {})
            self.move(run, S.COMMITTED)
        self.staging.clear(attempt)
        if self.group is not None:
            self.group.end(attempt)
        now = self._instance_now()  # a restart since the flush: the label must not lie
        with self._cond:
            if now is not None:
                self.seen(now)
        if now == run.instance:
            self._label(version)
        return self.snapshot()

    def _label(self, version: int) -> None:
        """The engine's weight-version label (what it reports with its outputs) must be
        ``version`` before the gate next opens: :meth:`_resume` sets it, and keeps the gate
        closed until it has, so new weights never serve under an old label."""
        with self._cond:
            self._label_due, self._label_error = version, None

    def stop_and_wait(self, attempt: str) -> AgentStatus:
        with self._cond:
            self._obsolete.add(attempt)
            run = self._run
            if run is None or run.spec.attempt != attempt or run.state in FINAL:
                return self.snapshot()
        run.stop_and_join()  # an apply in progress finishes its payload, then nothing more
        with self._cond:
            if run.state not in FINAL:  # else a concurrent stop has finished it: idempotent
                run.staged.clear()
                run.staged_bytes = 0
                self.move(run, S.OBSOLETE)
        self.staging.clear(attempt)
        if self.group is not None:
            self.group.end(attempt)
        return self.snapshot()

    def rejoin(self, version: int, checkpoint: str | None = None,
               history_digest: str | None = None) -> AgentStatus:
        """Restore ``version`` from a full checkpoint through the engine's loader: one
        under ``checkpoint_root``, or without ``checkpoint`` the version built from the
        store's history, the one ``history_digest`` names where the coordinator gave it
        (:func:`~dcr.receiver.rejoin.restore` says how it is checked)."""
        if self.store is not None:
            self.store.vouch(history_digest, version)
        return restore(self, version, checkpoint)

    def committed_in_store(self) -> int | None:
        """The newest version the store's history names, if the agent has one."""
        return self.store.committed() if self.store is not None else None

    # --- inspection ----------------------------------------------------------------

    def profile(self) -> dict[str, Any]:
        """The engine's class of every canonical tensor, its ranks' merged (what the
        sender encodes for)."""
        self.attach()
        with self._cond:
            prewarmed = self._prewarmed
        if prewarmed is None:
            raise AgentConflict(f"{self.name}: the engine has not been prewarmed yet (an "
                                "attempt or a dense load is in progress).")
        return prewarmed[1].model_dump(mode="json", include={"tensors", "regions"})

    def region_sums(self, manifest: Manifest) -> dict[str, str]:
        """The manifest's region fingerprints (key -> ``sum64:...``) that this engine's
        ranks may hold, as its prewarm found them: the regions its profile names, and
        the whole of each ``xor`` tensor (a rank that holds it whole checks that)."""
        with self._cond:
            held = self._checkable
        return {k: v for k, v in manifest.region_sums().items() if k in held}

    def _regions_of(self, profile: ReceiverProfile) -> frozenset[str]:
        """The region keys a prewarm's ranks may check (:meth:`region_sums`)."""
        held = {region_key(n, spans) for n, rs in profile.regions.items() for spans in rs}
        held |= {region_key(t.name, whole(t.shape)) for t in self.canonical
                 if profile.tensors.get(t.name) == "xor"}
        return frozenset(held)

    def fingerprint(self) -> dict[str, str]:
        """xxh3-128 of every parameter and buffer's integer view, per rank of the engine
        (:func:`~dcr.drivers.base.merge_fingerprints`), for bit-exact checks."""
        return merge_fingerprints(self.engine.fingerprint())

    # --- what runs report -----------------------------------------------------------

    def failed(self, run: Run, error: Exception) -> None:
        """A thread of ``run`` raised ``error``: the attempt fails (the coordinator retries
        by overwrite), and bits a manifest does not vouch for make the weights unknown."""
        instance = self._instance_now() if isinstance(error, EngineError) else None
        with self._cond:
            if run.error is None and not run.stop.is_set():
                run.error = f"{self.name}: attempt {run.attempt}: {error}"
                log.warning("%s", run.error)
            # Bits no manifest vouches for may be in the weights, or ones that differ
            # from its targets: an overwrite of the changed set would not repair them.
            if isinstance(error, ForeignPayload | FingerprintMismatch) and self.weights.foreign(
                    f"attempt {run.attempt} found {type(error).__name__} after writing; "
                    "a dense load must restore a version"):
                self._journal()
            if instance is not None:
                self.seen(instance)
            self._cond.notify_all()

    def _instance_now(self) -> str | None:
        """The engine's instance id after a failed call, or None if it does not answer."""
        try:
            return self.engine.instance()
        except Exception:  # down or restarting: the next admission reads it again
            return None
