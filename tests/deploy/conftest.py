"""The deploy tier's fixtures: a real node, the project's images on it, an image registry
and an S3 server the node's Pods reach.

``node`` starts once per session (:class:`node.Node`: a control plane on the bridge
address, containerd, kubelet, kube-proxy, kube-scheduler, cluster DNS) and registers its
bridge with the loopback guard, so the tests may call Pods by their IPs: that network
never leaves this machine. ``built_images`` builds the images with
``tools/image/build.sh`` (``make image``; minutes the first time, seconds after);
``pushed`` pushes the dcr image to a registry on the node (``make push``), from which the
kubelet pulls it; ``images`` imports the serve image into the node's containerd.

Skipped, with the reason, where the machine cannot run a node (not root, or the Debian
packages missing); ``.ci/run`` installs the packages, so CI runs the tier.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from controlplane import run_reporting
from node import (
    GATEWAY,
    PACKAGES,
    SUBNET,
    Images,
    Node,
    NodeError,
    missing_prerequisites,
)
from registry import Pushed, push, registry
from s3server import S3Server, scoped_s3_server

REPO = Path(__file__).resolve().parents[2]
IMAGE_SCRIPT = REPO / "tools" / "image" / "build.sh"


@pytest.fixture(scope="session")
def node(progress: Callable[[str], None],
         local_networks: list[ipaddress.IPv4Network]) -> Iterator[Node]:
    missing = missing_prerequisites()
    if missing:
        pytest.skip(f"no node on this machine: needs {', '.join(missing)} "
                    f"(root and the Debian packages {' '.join(PACKAGES)})")
    progress("tests/deploy: starting a one-node cluster (containerd, kubelet, kube-proxy)")
    started = time.monotonic()
    try:
        n = Node(progress=progress)
        n.start()
    except NodeError as e:
        pytest.fail(str(e))
    progress(f"tests/deploy: node Ready in {time.monotonic() - started:.1f} s")
    network = ipaddress.IPv4Network(SUBNET)
    local_networks.append(network)
    try:
        yield n
    finally:
        local_networks.remove(network)
        n.stop()


@pytest.fixture(scope="session")
def built_images(progress: Callable[[str], None]) -> dict[str, tuple[str, Path]]:
    """The project's images, built (``make image``): role -> (reference, archive)."""
    progress(f"tests/deploy: {IMAGE_SCRIPT.relative_to(REPO)} (minutes on a cold cache; "
             "its steps show here as they run)")
    started = time.monotonic()
    status, output = run_reporting(["bash", str(IMAGE_SCRIPT)], progress=progress,
                                   name="make image")
    if status != 0:
        pytest.fail(f"{IMAGE_SCRIPT} exited with {status}:\n{output[-3000:]}")
    built: dict[str, tuple[str, Path]] = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "image":
            _, role, ref, archive = parts
            built[role] = (ref, Path(archive))
    if set(built) != {"dcr", "serve"}:
        pytest.fail(f"{IMAGE_SCRIPT} reported images {sorted(built)}, not dcr and serve:\n"
                    f"{output[-3000:]}")
    progress(f"tests/deploy: images built in {time.monotonic() - started:.0f} s")
    return built


@pytest.fixture(scope="session")
def pushed(progress: Callable[[str], None], node: Node,
           built_images: dict[str, tuple[str, Path]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    """A registry on the node's bridge address (TLS, one login) that the node trusts, with
    the dcr image pushed to it by ``tools/image/push.sh`` (``make push``)."""
    with registry(tmp_path_factory.mktemp("registry"), host=GATEWAY,
                  progress=progress) as reg:
        node.trust_registry(reg.address, reg.ca)
        progress(f"tests/deploy: make push REGISTRY={reg.address}/dcr-dev")
        try:
            pushed = push(reg, "dcr-dev")
        except RuntimeError as e:
            pytest.fail(str(e))
        yield pushed


@pytest.fixture(scope="session")
def images(node: Node, built_images: dict[str, tuple[str, Path]], pushed: Pushed) -> Images:
    """The images as the node's Pods name them. The dcr image comes from the registry only:
    the operator's Pod pulls it at install (the first test), and Pods after it that hold
    the login find it there (the kubelet lets a Pod use an image pulled with a login only
    if the Pod has it too, whatever name or pull policy it uses). The serve image is
    imported (``ctr images import``)."""
    ref, archive = built_images["serve"]
    node.load_image(archive)
    return Images(dcr=pushed.ref, serve=ref)


@pytest.fixture(scope="session")
def node_s3(node: Node, tmp_path_factory: pytest.TempPathFactory,
            progress: Callable[[str], None]) -> Iterator[S3Server]:
    """versitygw on the node's bridge address, where Pods reach it: the encoders write
    with the owners' key, the rollout pods hold only the read-only key."""
    with scoped_s3_server(tmp_path_factory.mktemp("node-s3"), host=GATEWAY,
                          bucket="rl-weights", progress=progress) as server:
        yield server
