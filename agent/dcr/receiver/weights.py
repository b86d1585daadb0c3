"""What the agent knows of its engine's weights: a version, unsettled writes, or unknown.

Every change is journaled before the step it guards (docs/protocol.md, "What the weights
hold"). No threads or locks: ``AgentService`` calls it under its state lock.
"""

from __future__ import annotations

import logging

from dcr.protocol.agent_api import AttemptSpec
from dcr.protocol.states import AttemptState
from dcr.receiver.journal import Journal, JournalEntry

log = logging.getLogger(__name__)
# Journaled attempt states in which the engine's weights may hold the attempt's writes.
_WRITING = (AttemptState.APPLYING.value, AttemptState.FLUSHED.value)


def short(instance: str | None) -> str:
    """An instance id short enough for a sentence."""
    return (instance or "none")[:12]


class Weights:
    """The agent's knowledge of its engine's weights; ``conflict`` is the error class its
    refusals raise (the agent's ``AgentConflict``)."""

    def __init__(self, name: str, version: int | None, journal: Journal | None,
                 conflict: type[Exception]) -> None:
        self.name = name
        self.journal = journal
        self.conflict = conflict
        self.version: int | None = version
        self.dirty: tuple[int, int] | None = None  # (base, target) of unsettled writes
        self.unknown: str | None = None  # why no version is known, if none is
        self.instance: str | None = None  # the engine instance ``version`` holds under
        self._known: tuple[int, dict[str, str]] | None = None  # a version's targets
        last = journal.load() if journal else None
        self.restored = last is not None  # the journal said what the weights held
        if last is None:
            return
        self.instance = last.instance
        if last.dirty is not None or last.state in _WRITING or last.version is None:
            # Unknown stays unknown across restarts (the journal says version None) until
            # a dense load settles it.
            self.version = None
            self.unknown = (f"restarted while attempt {last.attempt} was {last.state} with "
                            f"writes of {last.dirty} unsettled" if last.version is not None
                            or last.dirty is not None else
                            "restarted while the version was unknown")
            log.warning("%s: %s; a dense refit must restore a version", name, self.unknown)
        else:
            self.version = last.version

    @property
    def held(self) -> int | None:
        """The version the weights hold, or None while writes are unsettled or it is unknown."""
        return None if self.dirty else self.version

    @property
    def servable(self) -> bool:
        """Whether the weights hold a version, so the engine may serve them."""
        return self.dirty is None and self.unknown is None

    def save(self, attempt: str | None = None, state: str | None = None) -> None:
        """Journal what the weights hold, with the current attempt and its state."""
        if self.journal is not None:
            self.journal.save(JournalEntry(version=self.version, dirty=self.dirty,
                                           attempt=attempt, state=state,
                                           instance=self.instance))

    def seen(self, instance: str) -> str | None:
        """The engine answered ``instance``. A first id is adopted; another means the
        engine restarted, so its weights are unknown: the reason, or None if nothing
        changed. The caller journals."""
        if instance == self.instance:
            return None
        old, self.instance = self.instance, instance
        if old is None:
            return None
        self.version, self.dirty = None, None
        self.unknown = (f"the engine restarted (instance {short(old)} -> {short(instance)}): "
                        "its weights are what it loaded at start")
        log.warning("%s: %s; a dense refit must restore a version", self.name, self.unknown)
        return self.unknown

    def forget(self, why: str) -> bool:
        """The weights hold a version DCR cannot patch (``why``): unknown, until a dense
        load settles them. Whether that changed anything; the caller journals."""
        if self.unknown is not None:
            return False
        self.version, self.dirty, self.unknown = None, None, why
        log.warning("%s: %s; a dense refit must restore a version", self.name, why)
        return True

    def admit(self, spec: AttemptSpec) -> None:
        """Raise ``conflict`` unless an attempt of ``spec`` may write these weights: they
        hold its base, or exactly its transition half-written and it is an overwrite."""
        transition = (spec.base_version, spec.target_version)
        if self.unknown is not None:
            raise self.conflict(f"{self.name}: version unknown ({self.unknown}); a dense "
                                "refit must restore the committed version first.")
        if self.dirty is not None and (self.dirty != transition or spec.mode != "overwrite"):
            raise self.conflict(
                f"{self.name}: weights hold a mix of {self.dirty[0]} and {self.dirty[1]}; "
                f"only an overwrite attempt of {self.dirty[0]} -> {self.dirty[1]} or a "
                f"dense refit can repair them, not {spec.mode} {transition}."
            )
        if self.dirty is None and self.version != spec.base_version:
            raise self.conflict(f"{self.name}: holds version {self.version}; attempt "
                                f"{spec.attempt} is for base {spec.base_version}.")

    def writing(self, spec: AttemptSpec) -> None:
        """The attempt is about to write: the weights hold a mix until commit."""
        self.dirty = (spec.base_version, spec.target_version)

    def committed(self, version: int, targets: dict[str, str]) -> None:
        """The attempt to ``version`` committed; ``targets`` are its manifest's target
        fingerprints, which a later dense load of that version must match."""
        self.version, self.dirty = version, None
        if targets:
            self._known = (version, targets)

    def expected(self, version: int) -> dict[str, str] | None:
        """The target fingerprints this agent knows for ``version``, if any."""
        known = self._known
        return known[1] if known is not None and known[0] == version else None

    def loading(self, version: int) -> None:
        """A dense load of ``version`` is about to write."""
        self.version, self.dirty, self.unknown = None, None, f"dense load of {version}"

    def loaded(self, version: int) -> None:
        """A dense load restored ``version``."""
        self.version, self.unknown = version, None

    def foreign(self, reason: str) -> bool:
        """An attempt that wrote found bits no manifest vouches for: unknown until a dense
        load. Whether anything changed (nothing does if it had not written)."""
        if not self.dirty:
            return False
        self.version, self.dirty, self.unknown = None, None, reason
        log.warning("%s: %s", self.name, reason)
        return True
