"""The loopback control plane behaves like a cluster: readiness, CRUD, RBAC, Jobs and GC."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from controlplane import ControlPlane, ControlPlaneError, run_reporting

pytestmark = pytest.mark.e2e

KUBECTL = shutil.which("kubectl")


def _eventually(check: Callable[[], Any], *, timeout_s: float = 60.0, what: str) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s:.0f} s (last: {value!r})")
        time.sleep(0.25)


def _kubectl(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert KUBECTL is not None
    return subprocess.run(
        [KUBECTL, f"--kubeconfig={kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _service_account(cp: ControlPlane, namespace: str, name: str) -> str:
    created = cp.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
    )
    assert created.status == 201, created.body
    return cp.service_account_token(namespace, name)


def test_apiserver_is_ready_and_reports_its_release(control_plane: ControlPlane) -> None:
    ready = control_plane.request("GET", "/readyz")
    version = control_plane.request("GET", "/version")

    assert (ready.status, ready.body) == (200, "ok")
    assert version.status == 200
    # build.sh stamps the release; an unstamped build reports v0.0.0-master.
    assert version.body["gitVersion"].startswith("v1."), version.body


def test_admin_creates_a_configmap_and_reads_it_back(
    control_plane: ControlPlane, namespace: str
) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    created = control_plane.request(
        "POST",
        path,
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"k": "v"}},
    )
    read = control_plane.request("GET", f"{path}/cm")

    assert created.status == 201, created.body
    assert read.status == 200, read.body
    assert read.body["data"] == {"k": "v"}
    assert read.body["metadata"]["resourceVersion"]


def test_service_account_without_rbac_cannot_list_secrets_until_granted(
    control_plane: ControlPlane, namespace: str
) -> None:
    token = _service_account(control_plane, namespace, "nobody")
    secrets = f"/api/v1/namespaces/{namespace}/secrets"

    denied = control_plane.request("GET", secrets, token=token)
    as_admin = control_plane.request("GET", secrets)

    assert denied.status == 403, denied.body
    assert f"system:serviceaccount:{namespace}:nobody" in denied.body["message"]
    assert as_admin.status == 200, as_admin.body

    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "read-secrets"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "read-secrets"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "read-secrets",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}],
    }
    assert control_plane.request("POST", f"{rbac}/roles", role).status == 201
    assert control_plane.request("POST", f"{rbac}/rolebindings", binding).status == 201

    _eventually(
        lambda: control_plane.request("GET", secrets, token=token).status == 200,
        timeout_s=30,
        what="the RoleBinding taking effect",
    )


def test_token_kubeconfig_authenticates_as_the_service_account(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    token = _service_account(control_plane, namespace, "agent")
    kubeconfig = control_plane.write_kubeconfig_for_token(
        token, tmp_path / "agent.kubeconfig", namespace=namespace
    )

    config = json.loads(kubeconfig.read_text())
    review = control_plane.request(
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        token=config["users"][0]["user"]["token"],
    )

    assert config["clusters"][0]["cluster"]["server"] == control_plane.server
    assert review.status == 201, review.body
    username = review.body["status"]["userInfo"]["username"]
    assert username == f"system:serviceaccount:{namespace}:agent"


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
def test_kubectl_uses_the_admin_and_token_kubeconfigs(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    token = _service_account(control_plane, namespace, "viewer")
    as_sa = control_plane.write_kubeconfig_for_token(token, tmp_path / "sa.kubeconfig")

    created = _kubectl(
        control_plane.kubeconfig, "-n", namespace, "create", "configmap", "made-by-kubectl",
        "--from-literal=a=b",
    )  # fmt: skip
    admin_can = _kubectl(
        control_plane.kubeconfig, "-n", namespace, "auth", "can-i", "list", "secrets"
    )
    sa_can = _kubectl(as_sa, "-n", namespace, "auth", "can-i", "list", "secrets")

    assert created.returncode == 0, created.stderr
    assert control_plane.request(
        "GET", f"/api/v1/namespaces/{namespace}/configmaps/made-by-kubectl"
    ).body["data"] == {"a": "b"}
    assert (admin_can.returncode, admin_can.stdout.strip()) == (0, "yes"), admin_can.stderr
    assert (sa_can.returncode, sa_can.stdout.strip()) == (1, "no"), sa_can.stderr


def test_job_creates_pods_and_background_deletion_collects_them(
    control_plane: ControlPlane, namespace: str
) -> None:
    if not control_plane.has_controller_manager:
        pytest.skip("kube-controller-manager is not running: no Job controller, no GC")
    jobs = f"/apis/batch/v1/namespaces/{namespace}/jobs"
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "work"},
        "spec": {
            "parallelism": 2,
            "completions": 2,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    # Never pulled: there is no kubelet, the Pods stay Pending.
                    "containers": [{"name": "c", "image": "registry.invalid/none:0"}],
                }
            },
        },
    }
    created = control_plane.request("POST", jobs, job)
    assert created.status == 201, created.body
    job_uid = created.body["metadata"]["uid"]

    def job_pods() -> list[dict[str, Any]]:
        listed = control_plane.request(
            "GET",
            f"/api/v1/namespaces/{namespace}/pods",
            query={"labelSelector": "batch.kubernetes.io/job-name=work"},
        )
        assert listed.status == 200, listed.body
        items: list[dict[str, Any]] = listed.body["items"]
        return items

    def both_pods() -> list[dict[str, Any]] | None:
        pods = job_pods()
        return pods if len(pods) == 2 else None

    pods = _eventually(both_pods, what="the Job creating its 2 Pods")
    for pod in pods:
        assert pod["status"]["phase"] == "Pending"
        assert [o["uid"] for o in pod["metadata"]["ownerReferences"]] == [job_uid]

    deleted = control_plane.request(
        "DELETE", f"{jobs}/work", query={"propagationPolicy": "Background"}
    )
    assert deleted.status == 200, deleted.body
    _eventually(lambda: not job_pods(), what="garbage collection of the Job's Pods")
    assert control_plane.request("GET", f"{jobs}/work").status == 404


def test_helm_reaches_the_apiserver_with_the_admin_kubeconfig(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    helm = control_plane.binaries.helm
    if helm is None:
        pytest.skip("build.sh did not report a helm binary")
    env = {
        "PATH": "/usr/bin:/bin",
        **{
            f"HELM_{kind}_HOME": str(tmp_path / kind.lower())
            for kind in ("CACHE", "CONFIG", "DATA")
        },
    }

    listed = subprocess.run(
        [
            str(helm),
            f"--kubeconfig={control_plane.kubeconfig}",
            "list",
            "--all-namespaces",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )

    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []


def test_startup_failure_names_the_process_and_shows_its_log(control_plane: ControlPlane) -> None:
    broken = ControlPlane(
        control_plane.binaries, controllers=None, extra_apiserver_args=["--no-such-flag"]
    )

    with pytest.raises(ControlPlaneError, match=r"(?s)kube-apiserver exited.*no-such-flag"):
        broken.start()
    with pytest.raises(ControlPlaneError, match="not started"):
        _ = broken.workdir


def test_a_long_setup_command_reports_its_steps_and_ticks_while_it_is_silent(
    tmp_path: Path,
) -> None:
    """What ``make test`` shows during a cold build: the script's lines, then a tick while
    a step is silent. The step here ends only once a tick has been seen."""
    script, flag = tmp_path / "build.sh", tmp_path / "ticked"
    script.write_text(
        'echo "build.sh: building widget v1 ..." >&2\n'
        f'while [ ! -e "{flag}" ]; do sleep 0.05; done\n'
        'echo "built widget v1 /cache/widget in 3 s"\n'
    )
    said: list[str] = []

    def progress(line: str) -> None:
        said.append(line)
        if "still" in line:
            flag.touch()

    returncode, output = run_reporting(["bash", str(script)], progress=progress, tick_s=0.2,
                                       timeout_s=120, name="build.sh")
    assert returncode == 0
    assert said[0] == "build.sh: building widget v1 ..."
    assert said[1].startswith("build.sh: still building widget (")
    assert said[-1] == "build.sh: built widget v1 /cache/widget in 3 s"
    assert "built widget v1 /cache/widget in 3 s" in output.splitlines()
