"""Fixtures for tests against a real Kubernetes control plane on loopback.

``control_plane`` is session-scoped: etcd, kube-apiserver and kube-controller-manager start once
(a few seconds) and every test shares them, each in its own namespace (``namespace``).

The binaries come from ``tools/controlplane/build.sh``: a fraction of a second when cached, but
the first build takes minutes, longer than the per-test timeout. So the script runs once after
collection, outside any test's timeout, and only when a selected test needs the control plane.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests run with --import-mode=importlib and no __init__.py: make the helper module importable.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from controlplane import Binaries, ControlPlane, ControlPlaneError, build_binaries

_BINARIES = pytest.StashKey[Binaries | ControlPlaneError]()


def _can_build() -> bool:
    return shutil.which("go") is not None or os.access("/usr/local/go/bin/go", os.X_OK)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any("control_plane" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("tests/k8s: tools/controlplane/build.sh (minutes on a cold cache)")
    try:
        session.config.stash[_BINARIES] = build_binaries()
    except ControlPlaneError as e:
        session.config.stash[_BINARIES] = e


@pytest.fixture(scope="session")
def control_plane(pytestconfig: pytest.Config) -> Iterator[ControlPlane]:
    """A started control plane (admin kubeconfig at ``.kubeconfig``), stopped after the session."""
    binaries = pytestconfig.stash.get(_BINARIES, None)
    if binaries is None:  # the collection hook did not run (e.g. the fixture used via a plugin)
        try:
            binaries = build_binaries()
        except ControlPlaneError as e:
            binaries = e
    if isinstance(binaries, ControlPlaneError):
        if not _can_build():
            pytest.skip(f"no cached control-plane binaries and no Go toolchain: {binaries}")
        raise binaries
    with ControlPlane(binaries) as cp:
        yield cp


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (asynchronously, by the controllers)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    created = control_plane.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
    )
    assert created.status == 201, created.body
    yield name
    control_plane.request("DELETE", f"/api/v1/namespaces/{name}")
