"""How an owner encodes an attempt: the settings of ``dcr diff``, ``dcr encode`` and ``Encoder``.

:class:`EncodeSettings` is the one declaration: ``dcr.settings`` derives the options from it
and :meth:`EncodeSettings.argv` the ``dcr encode`` command line, so no starter of an encoder
spells a flag or a default. The operator builds those command lines too, so this module
imports only the standard library, ``dcr.settings``, ``dcr.cores``, ``dcr.format`` and
``dcr.errors``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dcr.cores import usable_cores
from dcr.errors import ConfigError
from dcr.format.names import EntryKind, Mode
from dcr.format.profile import ReceiverProfile
from dcr.settings import MiB, option, to_argv


@dataclass(frozen=True, kw_only=True)
class EncodeSettings:
    """How one owner diffs a baseline against a candidate and writes its payloads."""

    target_version: int = option(flag="--version", doc="target version written to the store",
                                 metavar="N")
    base_version: int = option(doc="base version the receivers must hold", metavar="M")
    mode: Mode = option("mixed", doc="mixed: XOR where allowed; overwrite: every entry "
                        "absolute (what a retry sends)")
    bucket_bytes: int = option(256 * MiB, unit=MiB, doc="dense bytes of source tensors per "
                               "payload, in MiB; 64-512 MiB amortises per-object costs "
                               "while keeping memory near two buckets")
    min_payloads: int = option(16, metavar="N", doc="cut the tensors into at least N "
                               "payloads while each still holds 16 MiB or more, so encoding, "
                               "transfer and apply overlap even for a small model")
    item_elements: int = option(1 << 24, cli=False, doc="elements in the largest item; "
                                "bounds encoder memory for huge tensors")
    level: int = option(1, doc="zstd level, 1..22; 1 is fast and within a few percent of "
                        "the best on weight deltas")
    threads: int | None = option(None, metavar="N", doc="diff threads (numpy and zstd "
                                 "release the GIL); default: the cores this process may use "
                                 "(its CPU affinity, capped by its cgroup's CPU limit)")
    overwrite: tuple[str, ...] = option((), metavar="REGEX", doc="tensors (full-match "
                                        "regex) that always travel as overwrites; repeatable")
    owner: int = option(0, metavar="K", doc="this owner's index, 0 <= K < owners")
    owners: int = option(1, metavar="N", doc="owners splitting the tensors by a stable hash "
                         "of their names")
    attempt: str | None = option(None, doc="the attempt id the coordinator gave this "
                                 "attempt")
    attempt_manifest: bool = option(False, cli=False, doc="write the manifest under the "
                                    "attempt, as protocol owners do (a late owner of an "
                                    "abandoned attempt cannot replace the current one), "
                                    "not at the version (the file-level layout dcr patch "
                                    "reads); several owners always do")
    profile_path: Path | None = option(None, flag="--profile", metavar="FILE",
                                       doc="merged receiver profile (JSON): per tensor xor, "
                                       "overwrite or dense")
    profile: ReceiverProfile | None = option(None, cli=False, doc="the receivers' merged "
                                             "profile in process (the command reads "
                                             "profile_path into it); None: all XOR")

    def __post_init__(self) -> None:
        if self.base_version == self.target_version:
            raise ConfigError(f"--base-version {self.base_version} equals --version.")
        if min(self.target_version, self.base_version) < 0:
            raise ConfigError(f"Versions must be >= 0, got {self.base_version} -> "
                              f"{self.target_version}.")
        if self.bucket_bytes < 1 * MiB:
            raise ConfigError(f"Bucket of {self.bucket_bytes} bytes is under 1 MiB.")
        if not 1 <= self.level <= 22:
            raise ConfigError(f"zstd level {self.level} is outside 1..22.")
        if not 0 <= self.owner < self.owners:
            raise ConfigError(f"Owner {self.owner} is outside 0..{self.owners - 1}.")
        if (self.threads is not None and self.threads < 1) or self.item_elements < 1 \
                or self.min_payloads < 1:
            raise ConfigError(f"threads ({self.threads}), min_payloads ({self.min_payloads}) "
                              "and item_elements must be >= 1.")
        for pattern in self.overwrite:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"Overwrite pattern {pattern!r} is not a regex: {e}.") from e

    @property
    def thread_count(self) -> int:
        """``threads``, or the cores this process may use."""
        return self.threads if self.threads is not None else usable_cores()

    @property
    def per_attempt_manifest(self) -> bool:
        """Whether the manifest part goes under the attempt rather than at the version."""
        return self.owners > 1 or self.attempt_manifest

    def entry_for(self, name: str) -> EntryKind | Literal["dense"]:
        """How a tensor travels: XOR, overwrite, or dense (every element, when any changed)."""
        cls = self.profile.tensors.get(name, "xor") if self.profile else "xor"
        if cls == "dense":
            return "dense"
        if (
            self.mode == "overwrite"
            or cls == "overwrite"
            or any(re.fullmatch(p, name) for p in self.overwrite)
        ):
            return "overwrite"
        return "xor"

    def argv(self, base: str, target: str, *, store: str, owner: str | None = None
             ) -> list[str]:
        """The arguments of ``dcr encode`` that publish with these settings.

        ``base`` and ``target`` are the checkpoints, ``store`` the destination URI;
        ``owner`` replaces the owner index by text the launcher expands (an indexed
        Job's ``$(DCR_OWNER)``). Every option is written, defaults included.
        """
        if self.attempt is None:
            raise ConfigError(f"dcr encode of version {self.target_version} needs an attempt id.")
        flags = to_argv(self, skip=("owner",))
        return ["encode", base, target, "--store", store, *flags,
                "--owner", str(self.owner) if owner is None else owner, "--json"]


__all__ = ["EncodeSettings"]
