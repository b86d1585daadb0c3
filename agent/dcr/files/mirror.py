"""``dcr mirror``: one dense copy of the committed version per rollout cluster, kept current.

A mirror directory on a volume local to the rollout cluster holds generations
``v<10 digits>/``, each a whole checkpoint at one committed version, and a symlink
``current`` to the newest. A sync builds the next generation beside the others (hard
links of the current one's files, then the committed deltas through the file-level patch
path, which writes every patched file anew, so the generation linked from is never
touched), and only then moves ``current`` with one rename. A reader resolves ``current``
once and reads one whole version; the ``keep`` newest generations stay, so a reader that
started on the previous one can finish. Pods start and rejoin from it
(``dcr materialize --seed <mirror>/current``, the agent's ``--mirror``): every tensor is
checked against the history's fingerprints there, as from any seed, and only tensor files
and the seed's allow-listed files pass from one generation to the next.
docs/two-clusters.md, "A rollout-side mirror".
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dcr.errors import CheckpointError
from dcr.files.history import HistoryStore
from dcr.files.materialize import VERSION_FILE, Materialized, materialize, recorded_version
from dcr.files.patch import fsync_dir, reader_limits
from dcr.files.vouched import copy_vouched
from dcr.format.manifest import DEFAULT_MANIFEST_LIMITS
from dcr.transport.store import Store

log = logging.getLogger(__name__)
CURRENT = "current"
_GENERATION = re.compile(r"v(\d{10})")  # fullmatch


@dataclass(frozen=True)
class Generation:
    version: int
    path: Path


@dataclass(frozen=True)
class Synced:
    """What a sync did: the current generation, and the build (None: it was current)."""

    current: Generation
    built: Materialized | None
    removed: tuple[Path, ...] = ()


def generation_dir(root: Path, version: int) -> Path:
    return root / f"v{version:010d}"


def generations(root: Path) -> list[Generation]:
    """The whole generations under ``root``, oldest first (a build in progress is not one)."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _GENERATION.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and recorded_version(p) == int(m[1]):
            found.append(Generation(int(m[1]), p))
    return sorted(found, key=lambda g: g.version)


def current(root: Path) -> Generation | None:
    """The generation ``root/current`` points at, resolved once (None: no sync finished)."""
    link = root / CURRENT
    if not link.is_symlink():
        return None
    path = link.resolve()
    m = _GENERATION.fullmatch(path.name)
    if not m or path.parent != root.resolve() or recorded_version(path) != int(m[1]):
        raise CheckpointError(f"{link} points at {path}, which is no generation of the "
                              "mirror.")
    return Generation(int(m[1]), path)


def sync(store: Store, root: Path, *, version: int | None = None,
         seed: tuple[int, Path] | None = None, digest: str | None = None,
         keep: int = 2) -> Synced:
    """Bring the mirror at ``root`` to ``version`` (default: the newest committed);
    ``seed``: a version and a checkpoint of it to start from when the mirror holds nothing
    yet (else the newest snapshot). A failed build is removed; ``current`` and every
    generation stay whole."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    root.mkdir(parents=True, exist_ok=True)
    target = HistoryStore(store, digest).read().committed if version is None else version
    now = current(root)
    if now is not None and now.version >= target:
        return Synced(current=now, built=None)
    work = root / f".v{target:010d}.building"
    shutil.rmtree(work, ignore_errors=True)  # a leftover of a killed sync
    held, from_seed = seed if seed is not None and now is None else (None, None)
    if now is not None:
        _link_tree(now.path, work)  # its recorded version makes materialize replay from it
    start = now.path if now is not None else from_seed
    limits = reader_limits(start) if start is not None else DEFAULT_MANIFEST_LIMITS
    try:
        built = materialize(store, work, version=target, held=held, seed=from_seed,
                            digest=digest, limits=limits)
        gen = generation_dir(root, target)
        shutil.rmtree(gen, ignore_errors=True)  # not whole, or current would point there
        work.rename(gen)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    tmp = root / f".{CURRENT}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(gen.name)
    os.replace(tmp, root / CURRENT)
    fsync_dir(root)
    removed = tuple(g.path for g in generations(root)[:-keep] if g.path != gen)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    log.info("mirror %s: version %s current (by %s from %s, %d bytes fetched); removed %s",
             root, target, built.plan.route, built.plan.start, built.fetched_bytes,
             [p.name for p in removed])
    return Synced(current=Generation(target, gen), built=built, removed=removed)


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as ``src``'s tensor files and carried files (:mod:`dcr.files.vouched`),
    each hard-linked (the patch path replaces the files it changes, never writing into
    them), and its recorded version, copied. Nothing else on the volume is carried on."""
    copy_vouched(src, dst, copy=os.link)
    shutil.copy2(src / VERSION_FILE, dst / VERSION_FILE)
