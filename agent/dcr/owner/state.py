"""An owner's baseline and candidate: the one rule for what it may publish and when it advances.

Every owner form inherits :class:`OwnerState`: the candidate comes after the baseline, an
attempt is published only for baseline -> candidate, and the baseline advances only for a
commit record naming the candidate and an attempt this owner published (a second call with
the same record, after a coordinator's failover, does nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from dcr.errors import BaselineError, ConfigError
from dcr.protocol.records import Attempt, CommitRecord

B = TypeVar("B")  # what a baseline or candidate is for this owner form


@dataclass(kw_only=True)
class OwnerState(Generic[B]):
    """The committed baseline, the candidate offered next, and the attempts published for it."""

    role: ClassVar[str] = "owner"  # names the owner form in messages ("rank 1: ...")

    baseline: B
    version: int  # the committed version ``baseline`` holds
    owner: int = 0
    candidate: B | None = None
    candidate_version: int | None = None
    published: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def who(self) -> str:
        return f"{self.role.capitalize()} {self.owner}"

    def set_candidate(self, candidate: B, version: int) -> None:
        """Offer ``candidate`` as version ``version``, after the committed baseline."""
        if version <= self.version:
            raise ConfigError(f"{self.who}: candidate version {version} is not after the "
                              f"baseline {self.version}.")
        self.candidate, self.candidate_version = candidate, version
        self.published = set()

    def check_publish(self, attempt: Attempt) -> B:
        """The candidate to publish ``attempt`` from; records the attempt as published.

        Raises unless the attempt's transition is baseline -> candidate.
        """
        t = attempt.transition
        if self.candidate is None or (t.base_version, t.target_version) != (
                self.version, self.candidate_version):
            raise BaselineError(
                f"{self.who}: attempt {attempt.id} is {t.base_version} -> {t.target_version}; "
                f"the committed baseline is {self.version} and the candidate "
                f"{self.candidate_version}."
            )
        self.published.add(attempt.id)
        return self.candidate

    def advance_baseline(self, record: CommitRecord) -> None:
        """Make the candidate the baseline, if ``record`` commits an attempt of ours for it."""
        if record.committed_version == self.version and self.candidate is None:
            return  # already advanced (a coordinator finishing after failover)
        if (self.candidate is None or record.committed_version != self.candidate_version
                or record.attempt not in self.published):
            raise BaselineError(
                f"{self.who}: the commit record names version {record.committed_version} by "
                f"attempt {record.attempt!r}; this {self.role} published "
                f"{sorted(self.published)} for candidate {self.candidate_version}. The "
                "baseline stays."
            )
        assert self.candidate_version is not None
        self.baseline, self.version = self.candidate, self.candidate_version
        self.candidate = self.candidate_version = None


__all__ = ["OwnerState"]
