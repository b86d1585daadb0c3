"""Shared test setup: an autouse guard that fails any network call beyond loopback, and
the real Kubernetes control plane that tests/k8s and tests/operator share.

``control_plane`` is session-scoped: etcd, kube-apiserver and kube-controller-manager start
once (a few seconds) and every test shares them, each in its own namespace (``namespace``).
The binaries come from ``tools/controlplane/build.sh``: a fraction of a second when cached,
but the first build takes minutes, longer than the per-test timeout. So the script runs once
after collection, outside any test's timeout, and only when a selected test needs the
control plane; its steps ("build.sh: building etcd ...", then "still building etcd (N s)"
every 30 s) reach the terminal while it runs. Modules whose fixtures need other build.sh
components say so with the ``builds`` marker (``pytest.mark.builds("promtool")``); those
are built there too, for the same reason. The ``progress`` fixture gives any other long
session setup the same live line, past pytest's output capture.

Tiers go by what a test starts: every test whose fixtures (at any depth) include the
control plane or helm is marked ``controlplane`` here, so ``make test-fast`` runs every
other test, tests/operator's pure ones among them, with ``-m "not controlplane"``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from controlplane import (
    Binaries,
    ControlPlane,
    ControlPlaneError,
    build_binaries,
    built,
    go_available,
)

from dcr.codec.encode import PayloadBuilder, diff_range, encode_item
from dcr.format.dtypes import DTYPES

_real_connect = socket.socket.connect


# Networks that never leave this machine besides loopback: a deploy-tier node's bridge
# (tests/support/node.py) registers its subnet here while it runs.
LOCAL_NETWORKS: list[ipaddress.IPv4Network] = []


def _is_loopback(address: Any) -> bool:
    if isinstance(address, str):  # AF_UNIX path
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or any(ip in net for net in LOCAL_NETWORKS)


def _guarded_connect(self: socket.socket, address: Any) -> Any:
    if not _is_loopback(address):
        raise RuntimeError(f"test tried to reach {address!r}; only loopback is allowed")
    return _real_connect(self, address)


@pytest.fixture
def sealed_xor() -> Callable[..., bytes]:
    """``sealed_xor(attempt, owner, seq, name, base, target, shape=None)``: one sealed
    payload of transition 0 -> 1 whose single item carries the XOR masks ``base ^
    target`` (flat BF16 bits) of tensor ``name``; the hostile-input tests forge with it."""
    def seal(attempt: str, owner: int, seq: int, name: str, base: np.ndarray,
             target: np.ndarray, shape: tuple[int, ...] | None = None) -> bytes:
        delta = diff_range(name=name, dtype=DTYPES["BF16"], shape=shape or (base.size,),
                           start=0, base=base, target=target, entry="xor")
        assert delta is not None
        builder = PayloadBuilder(base_version=0, target_version=1, attempt=attempt,
                                 owner=owner, seq=seq, mode="mixed")
        builder.add(encode_item(delta), dense_bytes=base.nbytes)
        return builder.seal()
    return seal


@pytest.fixture(scope="session")
def local_networks() -> list[ipaddress.IPv4Network]:
    """The guard's allow-list beyond loopback: a fixture whose network stays on this
    machine (a node's bridge) appends to it for as long as that network exists."""
    return LOCAL_NETWORKS


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket.socket, "connect", _guarded_connect)


# --- the real control plane -----------------------------------------------------------

_BINARIES = pytest.StashKey[Binaries | ControlPlaneError]()


def terminal_line(config: pytest.Config) -> Callable[[str], None]:
    """Write a line to the terminal now, even from inside a test or fixture, whose output
    pytest otherwise captures: for setup that runs for minutes (first builds)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if reporter is None:
            return
        with (capture.global_and_fixture_disabled() if capture is not None
              else contextlib.nullcontext()):
            reporter.write_line(line)

    return write


@pytest.fixture(scope="session")
def progress(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """``progress(line)``: say what a long session setup is doing, on the terminal, live."""
    return terminal_line(pytestconfig)


# Fixtures that start tools/controlplane/build.sh's binaries: the control plane, helm.
CONTROL_PLANE_FIXTURES = frozenset({"control_plane", "helm"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by it
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if CONTROL_PLANE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.controlplane)


def pytest_collection_finish(session: pytest.Session) -> None:
    say = terminal_line(session.config)
    if any("control_plane" in getattr(item, "fixturenames", ()) for item in session.items):
        say("tests/k8s: tools/controlplane/build.sh (minutes on a cold cache; "
            "its steps show here as they run)")
        try:
            session.config.stash[_BINARIES] = build_binaries(progress=say)
        except ControlPlaneError as e:
            session.config.stash[_BINARIES] = e
    # Other components, named by the `builds` marker of the selected tests, for the same
    # reason: cold, promtool alone takes about 5 minutes on 2 cores.
    components = sorted({c for item in session.items
                         for mark in item.iter_markers("builds") for c in mark.args})
    if components:
        say(f"tests: tools/controlplane/build.sh {' '.join(components)} "
            "(minutes on a cold cache)")
        with contextlib.suppress(ControlPlaneError):  # the fixture that needs one says why
            built(*components, progress=say)


@pytest.fixture(scope="session")
def control_plane(pytestconfig: pytest.Config) -> Iterator[ControlPlane]:
    """A started control plane (admin kubeconfig at ``.kubeconfig``), stopped after the session."""
    binaries = pytestconfig.stash.get(_BINARIES, None)
    if binaries is None:  # the collection hook did not run (e.g. the fixture used via a plugin)
        try:
            binaries = build_binaries(progress=terminal_line(pytestconfig))
        except ControlPlaneError as e:
            binaries = e
    if isinstance(binaries, ControlPlaneError):
        if not go_available():
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
    if control_plane.has_controller_manager:
        # Pods are admitted only once the ServiceAccount controller has made the namespace's
        # 'default' account, which a busy controller manager may take seconds to do.
        deadline = time.monotonic() + 60
        while control_plane.request(
                "GET", f"/api/v1/namespaces/{name}/serviceaccounts/default").status != 200:
            assert time.monotonic() < deadline, f"namespace {name}: no default ServiceAccount"
            time.sleep(0.1)
    yield name
    control_plane.request("DELETE", f"/api/v1/namespaces/{name}")
