"""Fixtures for the operator's tests against the real control plane.

``control_plane`` and ``namespace`` come from tests/conftest.py (shared with tests/k8s, so
one session starts one control plane). Tests that need them skip only when the binaries are
missing and cannot be built (no Go toolchain). Tests here that need neither them nor
``helm`` start nothing of Kubernetes' and run in ``make test-fast`` too (tests/conftest.py
marks the others ``controlplane``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from controlplane import ControlPlane, build_binaries, go_available
from k8sutil import admin_client

from dcr_operator.kube import KubeClient


@pytest.fixture
def kube(control_plane: ControlPlane) -> KubeClient:
    """The admin client (system:masters), for test setup and assertions."""
    return admin_client(control_plane)


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary tools/controlplane/build.sh builds (skip if it cannot)."""
    try:
        binaries = build_binaries()
    except Exception as e:
        if not go_available():
            pytest.skip(f"no helm binary and no Go toolchain to build it: {e}")
        raise
    if binaries.helm is None:
        pytest.skip("tools/controlplane/build.sh did not report a helm binary")
    return binaries.helm
