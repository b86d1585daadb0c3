"""``dcr patch``: bring a checkpoint from the base version to the target version in place.

Nothing is written until every input is verified (docs/cli.md). Each file is then patched in
a ``mkstemp`` copy beside it, checked against the target fingerprints, fsynced and renamed
over the original, so a file is always wholly old or wholly new; a file failing its target
check leaves those renamed before it at the target, and a re-run finishes the rest.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import mmap
import os
import shutil
import stat
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dcr.checkpoint import Checkpoint, TensorInfo, UInt, fingerprint, read_header
from dcr.codec.decode import DecodedItem, Target, apply_items, decode
from dcr.codec.sums import fingerprint_as
from dcr.errors import (
    CheckpointError,
    MalformedPayload,
    ManifestError,
    TargetMismatch,
    WrongBaseVersion,
)
from dcr.files.prints import held_prints
from dcr.files.snapshot import differing
from dcr.format.layout import manifest_key
from dcr.format.manifest import (
    DEFAULT_MANIFEST_LIMITS,
    Manifest,
    ManifestLimits,
    TensorEntry,
    limits_for,
)
from dcr.format.names import object_digest
from dcr.format.payload import (
    DEFAULT_LIMITS,
    DecodeLimits,
    Payload,
    check_disjoint,
    read_payload,
)
from dcr.transport.store import Store

Progress = Callable[[int], None]
TEMP_SUFFIX = "dcr-patch"  # temporary files are .<file>.<random>.dcr-patch beside <file>


@dataclass(frozen=True, kw_only=True)
class PatchResult:
    manifest: Manifest
    files_patched: int
    files_already_at_target: int
    records_applied: int


def load_manifest(store: Store, version: int,
                  limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS) -> Manifest:
    key = manifest_key(version)
    m = Manifest.parse(store.get(key), f"{store.uri}/{key}", limits)
    if m.target_version != version:
        raise ManifestError(f"Manifest {key} is for version {m.target_version}, not {version}.")
    return m


def fetch_items(store: Store, manifest: Manifest, limits: DecodeLimits) -> list[DecodedItem]:
    """Fetch, verify and decode every payload the manifest lists, in manifest order.

    Items are checked against the manifest's tensors, and decoded under ``limits``
    narrowed to them, so a small payload cannot decompress to more than they hold.
    """
    tensors = {t.name: (t.dtype, t.shape) for t in manifest.tensors}
    limits = DecodeLimits.for_tensors(tensors.values(), limits)
    payloads: list[Payload] = []
    for e in manifest.payloads:
        data = store.get(e.key)
        if len(data) != e.size:
            raise ManifestError(f"Payload {e.key} is {len(data)} bytes; manifest says {e.size}.")
        digest = object_digest(data)
        if digest != e.digest:
            raise ManifestError(
                f"Payload {e.key} digest mismatch (expected {e.digest}, got {digest})."
            )
        payload = read_payload(data, limits)
        h = payload.header
        got = (h.base_version, h.target_version, h.attempt, h.owner, h.seq, h.mode)
        want = (manifest.base_version, manifest.target_version, manifest.attempt, e.owner, e.seq,
                manifest.mode)
        if got != want:
            raise ManifestError(
                f"Payload {e.key} says (base, target, attempt, owner, seq, mode) = {got}; "
                f"the manifest expects {want}."
            )
        for it in h.items:
            if tensors.get(it.name) != (it.dtype, it.shape):
                raise TargetMismatch(f"Item {it.where} of {e.key} does not match the "
                                     "manifest's tensors.")
        payloads.append(payload)
    try:
        check_disjoint(it for p in payloads for it in p.header.items)
    except ValueError as err:
        raise MalformedPayload(f"Payloads of {manifest.attempt} conflict: {err}.") from err
    return [item for p in payloads for item in decode(p)]


def _check_layout(ckpt: Checkpoint, manifest: Manifest) -> None:
    want = {t.name: (t.dtype, t.shape) for t in manifest.tensors}
    have = {n: (i.dtype.name, i.shape) for n, i in ckpt.tensors.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[:5]
        raise TargetMismatch(
            f"Checkpoint {ckpt.root} does not hold the manifest's tensors: {diff}."
        )


def _classify(ckpt: Checkpoint, manifest: Manifest) -> tuple[list[Path], list[Path]]:
    """Files to patch (all tensors at base) and files already done (all at target)."""
    entries = {t.name: t for t in manifest.tensors}
    by_file: dict[Path, list[TensorInfo]] = defaultdict(list)
    for info in ckpt:
        by_file[info.file].append(info)
    todo, done = [], []
    for path, infos in sorted(by_file.items()):
        prints = {i.name: fingerprint_as(entries[i.name].base, ckpt.bits(i.name), fingerprint)
                  for i in infos}
        at_base = all(prints[n] == entries[n].base for n in prints)
        at_target = all(prints[n] == entries[n].target for n in prints)
        if at_target:  # includes files no tensor of which changes
            done.append(path)
        elif at_base:
            todo.append(path)
        else:
            strays = [n for n in prints if prints[n] not in (entries[n].base, entries[n].target)]
            mixed = [n for n in prints if prints[n] == entries[n].target != entries[n].base]
            raise WrongBaseVersion(
                f"{path} is not at base version {manifest.base_version}: tensors "
                f"{(strays or mixed)[:5]} hold "
                f"{'other' if strays else 'target-version'} bits. Nothing was changed."
            )
    return todo, done


def _print(t: Target, want: str) -> str:
    return fingerprint_as(want, t.bits, fingerprint)


def _view(mm: mmap.mmap, info: TensorInfo) -> UInt:
    if info.numel == 0:
        return np.empty(0, dtype=info.dtype.bits)
    return np.frombuffer(mm, dtype=info.dtype.bits, count=info.numel, offset=info.offset)


def _remove_leftovers(path: Path) -> None:
    """Unlink (never follow) temporary files of ``path`` that a killed run left."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*{TEMP_SUFFIX}"):
        stale.unlink(missing_ok=True)


def _copy_beside(path: Path) -> Path:
    """A fresh temporary copy of ``path`` in its directory, with its mode bits."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                suffix=f".{TEMP_SUFFIX}")
    tmp = Path(name)
    try:
        with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
            os.fchmod(dst.fileno(), stat.S_IMODE(os.fstat(src.fileno()).st_mode))
            shutil.copyfileobj(src, dst, 16 << 20)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"{path}: cannot make the patched copy beside it: {e}.") from e
    return tmp


def _patch_file(
    path: Path, items: list[DecodedItem], entries: dict[str, TensorEntry]
) -> int:
    _remove_leftovers(path)
    tmp = _copy_beside(path)
    try:
        infos = read_header(tmp)
        with tmp.open("r+b") as f:
            # Not closed explicitly: views into it may outlive an exception's traceback,
            # and closing a mapping with live views raises. It goes with its last view.
            mm = mmap.mmap(f.fileno(), 0)
            targets = {
                name: Target(dtype=i.dtype.name, shape=i.shape, bits=_view(mm, i))
                for name, i in infos.items()
            }
            applied = apply_items(items, targets)
            wrong = [n for n, t in targets.items()
                     if fingerprint_as(entries[n].target, t.bits, fingerprint) != entries[n].target]
            if wrong:
                raise TargetMismatch(
                    f"{path}: after applying, tensors {wrong[:5]} do not match the target "
                    "fingerprints. The original file is unchanged."
                )
            mm.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return applied


def fsync_dir(path: Path) -> None:
    """Make the renames in directory ``path`` durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def patch_checkpoint(
    root: Path,
    store: Store,
    version: int,
    *,
    limits: DecodeLimits = DEFAULT_LIMITS,
    progress: Progress | None = None,
) -> PatchResult:
    return patch_to(root, store, load_manifest(store, version, reader_limits(root)),
                    limits=limits, progress=progress)


def reader_limits(root: Path) -> ManifestLimits:
    """The manifest limits of a reader holding checkpoint ``root``: as many tensors as
    it has (:func:`~dcr.format.manifest.limits_for`)."""
    with Checkpoint(root) as ckpt:
        return limits_for(len(ckpt.names()))


def patch_to(
    root: Path,
    store: Store,
    manifest: Manifest,
    *,
    limits: DecodeLimits = DEFAULT_LIMITS,
    progress: Progress | None = None,
) -> PatchResult:
    """Patch ``root`` by ``manifest``'s payloads, fetched from ``store`` (what
    :func:`patch_checkpoint` does once it has read the version's manifest)."""
    with Checkpoint(root) as ckpt:
        _check_layout(ckpt, manifest)
        items = fetch_items(store, manifest, limits)
        todo, done = _classify(ckpt, manifest)
        file_of = {n: i.file for n, i in ckpt.tensors.items()}
        sizes = {p: p.stat().st_size for p in todo}
    entries = {t.name: t for t in manifest.tensors}
    per_file: dict[Path, list[DecodedItem]] = defaultdict(list)
    for it in items:
        per_file[file_of[it.header.name]].append(it)
    applied = 0
    for path in todo:
        applied += _patch_file(path, per_file[path], entries)
        if progress:
            progress(sizes[path])
    return PatchResult(
        manifest=manifest, files_patched=len(todo), files_already_at_target=len(done),
        records_applied=applied,
    )


def patch_chain(root: Path, store: Store, manifests: list[Manifest], *,
                limits: DecodeLimits = DEFAULT_LIMITS, base_checked: bool = False) -> int:
    """Patch ``root`` through consecutive versions in one pass: each file is copied once,
    every step's payloads are applied to the copies in order (each step's tensors checked
    against its targets), and each copy replaces its file only after the last step, so
    a file is wholly at the first base or wholly at the last target. Every tensor must
    be at the first manifest's base (``base_checked``: the caller has just compared them
    all, so they are not read twice); the records applied."""
    for a, b in itertools.pairwise(manifests):
        ends = {t.name: t.target for t in a.tensors}
        if b.base_version != a.target_version or {t.name: t.base for t in b.tensors} != ends:
            raise ManifestError(f"Manifests {a.target_version} and {b.base_version}.. do not "
                                "chain: one's targets are not the next one's bases.")
    with Checkpoint(root) as ckpt:
        for m in manifests:
            _check_layout(ckpt, m)
        first = {t.name: t.base for t in manifests[0].tensors}
        wrong = [] if base_checked else differing(held_prints(ckpt, first), first)
        if wrong:
            raise WrongBaseVersion(f"{root} is not at version {manifests[0].base_version}: "
                                   f"tensors {wrong[:5]} hold other bits. Nothing was changed.")
        paths = sorted({i.file for i in ckpt})
    for path in paths:
        _remove_leftovers(path)
    tmps: dict[Path, Path] = {}
    try:
        targets: dict[str, Target] = {}
        for path in paths:
            tmps[path] = tmp = _copy_beside(path)
            with tmp.open("r+b") as f:
                mm = mmap.mmap(f.fileno(), 0)  # lives as long as its views (see _patch_file)
            targets |= {name: Target(dtype=i.dtype.name, shape=i.shape, bits=_view(mm, i))
                        for name, i in read_header(tmp).items()}
        applied = 0
        for m in manifests:  # one step's payloads in memory at a time
            items = fetch_items(store, m, limits)
            applied += apply_items(items, targets)
            want = {t.name: t.target for t in m.tensors}
            touched = {it.header.name for it in items}
            bad = [n for n in sorted(touched) if _print(targets[n], want[n]) != want[n]]
            if bad:
                raise TargetMismatch(f"{root}: after version {m.target_version}'s payloads, "
                                     f"tensors {bad[:5]} do not match its target fingerprints."
                                     " The checkpoint is unchanged.")
        last = {t.name: t.target for t in manifests[-1].tensors}
        bad = [n for n, t in targets.items() if _print(t, last[n]) != last[n]]
        if bad:
            raise TargetMismatch(f"{root}: tensors {bad[:5]} do not match version "
                                 f"{manifests[-1].target_version}'s target fingerprints. The "
                                 "checkpoint is unchanged.")
        for path, tmp in tmps.items():
            with tmp.open("r+b") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    for parent in {path.parent for path in paths}:
        fsync_dir(parent)
    return applied
