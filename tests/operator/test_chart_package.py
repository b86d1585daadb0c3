"""The chart as a team takes it: a Helm package of the project's version, pushed as an OCI
artifact beside the images (``make push``, ``tools/image/push.sh``).

The push goes to a real registry (distribution's ``registry serve``, the deploy tier's, built
by ``tools/controlplane/build.sh registry``) behind TLS with a private CA and an htpasswd
login, and the chart is pulled back from it with ``helm pull`` as an installer would.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml
from controlplane import ControlPlaneError, built, go_available
from k8sutil import CHART, REPO
from registry import registry

PUSH = REPO / "tools" / "image" / "push.sh"


def _project_version() -> str:
    version: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return version


def test_the_charts_version_and_app_version_are_the_projects() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (_project_version(),) * 2


def _push(helm: Path, registry_path: str, env: dict[str, str]
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(PUSH), registry_path, "chart"], capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "HELM": str(helm), **env})


@pytest.fixture(scope="session")
def registry_binary() -> None:
    """The registry tools/controlplane/build.sh builds (skip if it cannot)."""
    try:
        built("registry")
    except ControlPlaneError as e:
        if not go_available():
            pytest.skip(f"no registry binary and no Go toolchain to build it: {e}")
        raise


def test_make_push_puts_the_chart_of_the_projects_version_into_an_oci_registry(
        helm: Path, registry_binary: None, tmp_path: Path) -> None:
    version = _project_version()
    with registry(tmp_path / "registry", host="127.0.0.1") as reg:
        login = {"REGISTRY_AUTH_FILE": str(reg.auth_file), "DCR_PUSH_CERT_DIR": str(reg.cert_dir)}
        refused = _push(helm, f"{reg.address}/dcr-dev", {"DCR_PUSH_CERT_DIR": str(reg.cert_dir),
                                                         "REGISTRY_AUTH_FILE": "/dev/null"})
        assert refused.returncode != 0  # no login: the registry refuses the push
        assert f"helm push to oci://{reg.address}/dcr-dev/charts failed" in refused.stderr

        done = _push(helm, f"{reg.address}/dcr-dev", login)
        assert done.returncode == 0, done.stderr
        ((role, ref, digest),) = [line.split()[1:] for line in done.stdout.splitlines()]
        assert (role, ref) == ("chart", f"oci://{reg.address}/dcr-dev/charts/dcr:{version}")
        assert digest.startswith("sha256:")
        assert reg.password not in done.stdout + done.stderr

        pulled = subprocess.run(
            [str(helm), "pull", f"oci://{reg.address}/dcr-dev/charts/dcr", "--version", version,
             "--destination", str(tmp_path), "--registry-config", str(reg.auth_file),
             "--ca-file", str(reg.ca)], capture_output=True, text=True, timeout=120, check=False)
        assert pulled.returncode == 0, pulled.stderr
        assert f"Digest: {digest}" in pulled.stdout + pulled.stderr
    with tarfile.open(tmp_path / f"dcr-{version}.tgz") as tgz:
        chart = yaml.safe_load(tgz.extractfile("dcr/Chart.yaml").read())  # type: ignore[union-attr]
        names = tgz.getnames()
    assert (chart["version"], chart["appVersion"]) == (version, version)
    assert "dcr/values.schema.json" in names
    assert any(n.startswith("dcr/crds/") for n in names)


def test_a_chart_whose_version_is_not_the_projects_is_not_pushed(tmp_path: Path) -> None:
    """push.sh refuses before packaging, naming both versions (no registry is asked)."""
    fake = tmp_path / "repo"
    (fake / "tools" / "image").mkdir(parents=True)
    (fake / "charts" / "dcr").mkdir(parents=True)
    (fake / "tools" / "image" / "push.sh").write_text(PUSH.read_text())
    (fake / "pyproject.toml").write_text('[project]\nversion = "9.9.9"\n')
    (fake / "charts" / "dcr" / "Chart.yaml").write_text(
        (CHART / "Chart.yaml").read_text())
    done = subprocess.run(["bash", str(fake / "tools" / "image" / "push.sh"),
                           "registry.invalid/x", "chart"], capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, "HELM": "true"})
    assert done.returncode != 0
    assert f"version is {_project_version()}, not the project's version 9.9.9" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("registry_path", ["oci://x", "host/UPPER", "a b"])
def test_push_refuses_a_registry_it_cannot_name(registry_path: str) -> None:
    done = subprocess.run(["bash", str(PUSH), registry_path, "chart"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert f"'{registry_path}' is not a registry host[:port][/path]" in done.stderr
