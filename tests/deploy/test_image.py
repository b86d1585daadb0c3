"""The images ``make image`` builds (``tools/image/build.sh``): they hold what the operator,
the agent sidecar, the encoder and the reference serving engine need, run the way the chart
runs them, and hold nothing a final image should not.

The script runs once per session (minutes on a cold cache, seconds after); each test then
runs a built image with podman the way the chart's pods run: runc, no network, a read-only
root with a tmpfs on /tmp, every capability dropped, no privilege escalation. Each test checks
one property and fails without it: an image running as root or as a uid with no passwd
entry (kopf calls ``getpass.getuser()`` and crash-loops), without libstdc++6 (numpy fails
to import), without a dependency of the operator extra, with the chart's operator command
not resolving, with a compiler or pip left in a final stage, with .pyc files a read-only
root would make Python recompile on every start.

Skipped only where podman is missing (CI installs it, with mmdebstrap).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "tools" / "image" / "build.sh"
DEPLOYMENT = REPO / "charts" / "dcr" / "templates" / "deployment.yaml"
VALUES = REPO / "charts" / "dcr" / "values.yaml"
# The chart's pods: runc (crun fails on cgroups v1 hosts), no network, read-only root.
# --passwd=false: podman would otherwise add a passwd entry for a uid the image lacks, which
# containerd never does (kopf's crash loop would not show here).
PODMAN_RUN = ["podman", "run", "--rm", "--runtime", "runc", "--network=none",
              "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
              "--passwd=false", "--http-proxy=false",
              "--read-only", "--tmpfs", "/tmp", "--cap-drop=ALL",
              "--security-opt", "no-new-privileges"]
# Distribution name -> the module it is imported as (where they differ).
MODULE_OF = {"pyyaml": "yaml"}
# Environment variables getpass.getuser() reads before it asks the passwd database.
LOGIN_VARIABLES = ("LOGNAME", "USER", "LNAME", "USERNAME")


@dataclass(frozen=True, kw_only=True)
class Built:
    """The images as build.sh reported them: role -> (reference, archive)."""

    refs: dict[str, str]
    archives: dict[str, Path]
    stdout: str


@pytest.fixture(scope="session")
def built(progress: Callable[[str], None]) -> Built:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (Debian: apt-get install podman mmdebstrap runc)")
    progress(f"tests/deploy/test_image.py: {BUILD.relative_to(REPO)} "
             "(minutes on a cold cache, seconds after)")
    proc = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, check=False,
                          cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"{BUILD} exited with {proc.returncode}:\n{proc.stderr[-6000:]}")
    refs, archives = {}, {}
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"image (\S+) (\S+) (/\S+)", line)
        assert m is not None, f"build.sh printed {line!r}, not 'image <role> <ref> <archive>'"
        refs[m.group(1)], archives[m.group(1)] = m.group(2), Path(m.group(3))
    return Built(refs=refs, archives=archives, stdout=proc.stdout)


def run(image: str, *command: str, user: str | None = None,
        entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
    args = [*PODMAN_RUN]
    if user is not None:
        args += ["--user", user]
    if entrypoint is not None:
        args += ["--entrypoint", entrypoint]
    return subprocess.run([*args, image, *command], capture_output=True, text=True,
                          check=False, timeout=600)


def succeeds(image: str, *command: str, **kw: str) -> str:
    proc = run(image, *command, **kw)
    assert proc.returncode == 0, (
        f"{' '.join(command)} in {image} exited with {proc.returncode}:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def python(image: str, code: str, **kw: str) -> str:
    return succeeds(image, "python", "-c", code, **kw)


def chart_operator_command() -> list[str]:
    """The operator container's ``command`` in the chart's Deployment template."""
    m = re.search(r"^\s*command:\s*(\[.*\])\s*$", DEPLOYMENT.read_text(), re.MULTILINE)
    assert m is not None, f"{DEPLOYMENT} has no one-line `command: [...]`"
    command = json.loads(m.group(1))
    assert isinstance(command, list)
    return [str(c) for c in command]


def chart_run_as() -> str:
    """``uid:gid`` of the chart's podSecurityContext (the operator pod's user)."""
    text = VALUES.read_text()
    uid = re.search(r"^\s+runAsUser:\s*(\d+)\s*$", text, re.MULTILINE)
    gid = re.search(r"^\s+runAsGroup:\s*(\d+)\s*$", text, re.MULTILINE)
    assert uid is not None, f"{VALUES} sets no runAsUser"
    assert gid is not None, f"{VALUES} sets no runAsGroup"
    return f"{uid.group(1)}:{gid.group(1)}"


def operator_modules() -> list[str]:
    """What the dcr image must import: the project's dependencies and its operator extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [*project["dependencies"], *project["optional-dependencies"]["operator"]]
    out = []
    for req in names:
        name = re.match(r"[A-Za-z0-9._-]+", req)
        assert name is not None, req
        dist = name.group(0).lower()
        out.append(MODULE_OF.get(dist, dist.replace("-", "_")))
    return out


def test_build_script_prints_one_line_per_image_with_its_archive(built: Built) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = (REPO / "charts" / "dcr" / "Chart.yaml").read_text()
    assert f'appVersion: "{version}"' in chart, "the chart's appVersion is not pyproject's"
    assert built.refs == {"dcr": f"localhost/dcr:{version}",
                          "serve": f"localhost/dcr-serve:{version}"}, built.stdout
    for role, archive in built.archives.items():
        assert archive.is_file(), (role, archive)
        assert archive.stat().st_size > 0, (role, archive)


@pytest.fixture(scope="session")
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A throwaway containerd (no CRI plugin) with its own root, state and socket."""
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        pytest.skip("containerd is not installed (Debian: apt-get install containerd)")
    d = Path(tmp_path_factory.mktemp("containerd", numbered=True))
    socket = d / "containerd.sock"
    (d / "config.toml").write_text(
        f'version = 2\nroot = "{d}/root"\nstate = "{d}/state"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{socket}"\n[ttrpc]\n  address = "{socket}.ttrpc"\n'
        '[debug]\n  address = ""\n[metrics]\n  address = ""\n')
    with (d / "containerd.log").open("w") as log:
        proc = subprocess.Popen(["containerd", "--config", str(d / "config.toml")],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            if subprocess.run(["ctr", "--address", str(socket), "version"],
                              capture_output=True, check=False).returncode == 0:
                break
            assert proc.poll() is None, (d / "containerd.log").read_text()
            time.sleep(0.1)
        yield str(socket), d
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        # Snapshots are overlay mounts under root/: unmount before the directory goes.
        subprocess.run(["umount", "--recursive", str(d / "root")], capture_output=True,
                       check=False)


def test_archive_loads_into_containerd_and_runs_as_the_image_user(
        built: Built, containerd: tuple[str, Path]) -> None:
    socket, _ = containerd
    ctr = ["ctr", "--address", socket, "--namespace", "k8s.io"]
    imported = subprocess.run([*ctr, "images", "import", str(built.archives["dcr"])],
                              capture_output=True, text=True, check=False, timeout=600)
    assert imported.returncode == 0, imported.stderr
    listed = subprocess.run([*ctr, "images", "ls", "--quiet"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert built.refs["dcr"] in listed
    ran = subprocess.run([*ctr, "run", "--rm", built.refs["dcr"], "image-test",
                          "python", "-c", "import getpass, os; print(os.getuid(), "
                          "getpass.getuser())"],
                         capture_output=True, text=True, check=False, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["65532", "dcr"]


@pytest.mark.parametrize("role", ["dcr", "serve"])
def test_image_runs_as_a_non_root_user_with_a_passwd_entry(built: Built, role: str) -> None:
    image = built.refs[role]
    configured = subprocess.run(["podman", "image", "inspect", "--format", "{{.Config.User}}",
                                 image], capture_output=True, text=True, check=True).stdout
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without a runAsUser.
    assert configured.strip() == "65532:65532"
    code = ("import getpass, os, pwd\n"
            f"for v in {LOGIN_VARIABLES!r}: os.environ.pop(v, None)\n"
            "entry = pwd.getpwuid(os.getuid())\n"
            "print(os.getuid(), getpass.getuser(), entry.pw_dir, os.environ['HOME'])")
    for user in (None, chart_run_as()):  # the image's own user, and the chart's runAsUser
        out = python(image, code, **({} if user is None else {"user": user}))
        uid, name, home, env_home = out.split()
        assert int(uid) != 0
        assert (uid, name) == ("65532", "dcr")
        assert home == env_home == "/home/dcr"


def test_dcr_image_imports_the_operator_and_data_plane_libraries(built: Built) -> None:
    modules = operator_modules()
    assert {"numpy", "zstandard", "pydantic", "aiohttp", "kopf", "kubernetes"} <= set(modules)
    # numpy needs libstdc++6; dcr.codec._native is the C extension the builder stage compiled;
    # dcr_operator.handlers is what `python -m dcr_operator` registers with kopf.
    out = python(built.refs["dcr"], "import importlib, sys\n"
                 f"for m in {[*modules, 'dcr.codec._native', 'dcr_operator.handlers']!r}:\n"
                 "    importlib.import_module(m)\n"
                 "import numpy; print(numpy.__version__)")
    assert out.strip()


@pytest.mark.parametrize("command", [
    ["dcr", "--help"], ["dcr", "agent", "--help"], ["dcr", "encode", "--help"],
    ["dcr", "relay", "--help"]])
def test_dcr_image_runs_the_dcr_commands(built: Built, command: list[str]) -> None:
    assert "usage:" in succeeds(built.refs["dcr"], *command)


def test_dcr_image_runs_the_operator_command_of_the_chart(built: Built) -> None:
    command = chart_operator_command()
    assert command[:1] == ["python"], command  # resolved through the image's PATH
    out = succeeds(built.refs["dcr"], *command, "--help", user=chart_run_as())
    assert "usage: python -m dcr_operator" in out
    assert "--liveness" in out
    assert "--standalone" in out


def test_serve_image_runs_the_reference_engine_on_debian_torch(built: Built) -> None:
    image = built.refs["serve"]
    versions = python(image, "import torch, transformers, safetensors\n"
                      "print(torch.__version__, transformers.__version__, torch.__file__)")
    torch_version, _, torch_file = versions.split()
    assert torch_version.startswith("2.6."), torch_version
    assert torch_file.startswith("/usr/lib/python3/"), f"torch from {torch_file}, not Debian's"
    assert "usage:" in succeeds(image, "dcr", "serve", "--help")
    # The hf runtime on a tiny Llama: transformers builds the model on Debian's torch and
    # load_state_dict takes its weights back.
    out = python(image, "import tempfile, torch\n"
                 "from pathlib import Path\n"
                 "from transformers import LlamaConfig\n"
                 "from dcr.runtimes import build_runtime\n"
                 "d = Path(tempfile.mkdtemp())\n"
                 "LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, "
                 "num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)"
                 ".save_pretrained(d)\n"
                 "rt = build_runtime('hf', d)\n"
                 "state = {k: torch.ones_like(v) for k, v in rt.named_tensors()}\n"
                 "rt.load_weights(state.items())\n"
                 "print(all(bool((v == 1).all()) for _, v in rt.named_tensors()))")
    assert out.split()[-1] == "True"


def test_serve_image_runs_the_example_training_loop(built: Built) -> None:
    """examples/trainer-ranks.yaml runs ``python -m dcr.loop`` from the serve image: FSDP2
    ranks over gloo on Debian's torch, asking for refits with dcr.client (kubernetes)."""
    image = built.refs["serve"]
    out = python(image, "import torch.distributed as dist, kubernetes, dcr.client\n"
                 "from torch.distributed.fsdp import fully_shard\n"
                 "print(dist.is_gloo_available())")
    assert out.split()[-1] == "True"
    assert "usage: python -m dcr.loop" in succeeds(image, "python", "-m", "dcr.loop", "--help")


@pytest.mark.parametrize("role", ["dcr", "serve"])
def test_final_image_holds_no_compiler(built: Built, role: str) -> None:
    out = succeeds(built.refs[role], "sh", "-c",
                   "for c in gcc cc c++ g++ cpp x86_64-linux-gnu-gcc; do command -v $c; done;"
                   " ls /usr/lib/gcc/*/*/cc1 /usr/libexec/gcc/*/*/cc1 2>/dev/null; true")
    assert out.strip() == "", f"{built.refs[role]} holds a compiler: {out}"


@pytest.mark.parametrize("role", ["dcr", "serve"])
def test_final_image_holds_no_pip(built: Built, role: str) -> None:
    # The venvs are made without pip (the build runs Debian's pip wheel from outside them).
    proc = run(built.refs[role], "python", "-c", "import pip")
    assert proc.returncode != 0
    assert "No module named 'pip'" in proc.stderr


@pytest.mark.parametrize("role", ["dcr", "serve"])
def test_modules_are_precompiled_for_a_read_only_root(built: Built, role: str) -> None:
    # Flags 0b01: hash-based, source not checked (valid whatever the layers' mtimes). Without
    # them Python would recompile on every start and fail to cache under a read-only root.
    module = "dcr_operator.handlers" if role == "dcr" else "transformers"
    out = python(built.refs[role], "import importlib, importlib.util\n"
                 f"for name in ('dcr.cli', 'pydantic.main', {module!r}):\n"
                 "    m = importlib.import_module(name)\n"
                 "    with open(importlib.util.cache_from_source(m.__file__), 'rb') as f:\n"
                 "        print(name, int.from_bytes(f.read(8)[4:], 'little'))")
    flags = dict(line.split() for line in out.splitlines())
    assert flags == {"dcr.cli": "1", "pydantic.main": "1", module: "1"}, out
