"""``dcr.client``, a training loop's client, against the real API server.

The WeightRefit CRD is installed in a real kube-apiserver; the client creates refits and
watches them with the official ``kubernetes`` client. Here the operator's part is played
by the test, which writes the status subresource as the operator would (phases, conditions,
receivers), so each outcome comes when the test says: a commit, with progress seen on the
way; a return at publication for asynchronous RL, then the commit; a failure and a
supersession with their reasons; a timeout; a restarted loop attaching to its refit, and
a different spec under the same name refused. The refit committed by the real operator
through this client is in ``test_operator_e2e.py`` (the warm-encoder refit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import ControlPlane
from k8sutil import CHART, admin_client, apply, install_crds
from kubernetes import config
from kubernetes.client import ApiClient, Configuration

from dcr.client import (
    Progress,
    Refit,
    WeightRefitError,
    WeightRefitFailed,
    WeightRefitSuperseded,
    WeightRefitTimeout,
    refit,
)
from dcr_operator.kube import KubeClient

CKPT = "/ckpt/step-7"


@pytest.fixture
def kube(control_plane: ControlPlane) -> KubeClient:
    k = admin_client(control_plane)
    install_crds(k)
    return k


@pytest.fixture
def api(control_plane: ControlPlane) -> Iterator[ApiClient]:
    cp = control_plane
    with ApiClient(Configuration(host=cp.server, ssl_ca_cert=str(cp.ca_path),
                                 cert_file=str(cp.admin_cert_path),
                                 key_file=str(cp.admin_key_path))) as client:
        yield client


def _path(ns: str, name: str) -> str:
    return f"/apis/dcr.dev/v1alpha1/namespaces/{ns}/weightrefits/{name}"


def _cond(type_: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-12-02T00:00:00Z"}


def _receivers(*states: str) -> dict[str, Any]:
    """The receiver fields of a status as the operator writes them: a (capped) list, the
    count and the count per state."""
    return {"receivers": [{"name": f"rollout-{i}", "state": s} for i, s in enumerate(states)],
            "receiverCount": len(states),
            "receiverStates": [{"state": s, "count": states.count(s)}
                               for s in sorted(set(states))]}


class Operator(threading.Thread):
    """Writes a refit's status through the given steps once it exists, a step every
    ``every_s``."""

    def __init__(self, kube: KubeClient, ns: str, name: str,
                 steps: list[dict[str, Any]], every_s: float = 0.3) -> None:
        super().__init__(daemon=True)
        self.kube, self.path, self.steps, self.every_s = kube, _path(ns, name), steps, every_s
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    self.kube.get(self.path)
                    break
                except Exception:
                    time.sleep(0.05)
            for status in self.steps:
                time.sleep(self.every_s)
                self.kube.merge_patch(self.path + "/status", {"status": status})
        except BaseException as e:
            self.error = e


ENCODING = {"phase": "Encoding", "attemptCount": 1, "conditions": [
    _cond("Validated", "True", "BaseVersionCommitted"),
    _cond("Encoding", "True", "EncoderJobRunning", "Job policy-v7-a-1 publishes")]}
PUBLISHED = {"phase": "Applying", **_receivers("staged", "flushed"),
             "conditions": [_cond("Validated", "True", "BaseVersionCommitted"),
                            _cond("Encoding", "False", "EncoderJobSucceeded"),
                            _cond("Applying", "True", "AttemptRunning")]}
COMMITTED = {"phase": "Committed", "bytes": 1234,
             **_receivers("committed", "committed"),
             "conditions": [_cond("Validated", "True", "BaseVersionCommitted"),
                            _cond("Encoding", "False", "Committed"),
                            _cond("Applying", "False", "Committed"),
                            _cond("Committed", "True", "Committed", "version 7")]}


def _failed(reason: str, message: str) -> dict[str, Any]:
    return {"phase": "Failed", "conditions": [
        _cond("Validated", "True", "BaseVersionCommitted"),
        _cond("Failed", "True", reason, message)]}


def test_a_refit_is_created_as_asked_and_returns_at_its_commit_with_progress(
        kube: KubeClient, api: ApiClient, namespace: str) -> None:
    op = Operator(kube, namespace, "policy-v7", [ENCODING, PUBLISHED, COMMITTED])
    op.start()
    seen: list[Progress] = []
    handle = refit("policy", 7, CKPT, namespace=namespace, api_client=api, owners=2,
                   on_progress=seen.append, progress_bar=False, timeout_s=60)
    op.join(5)
    assert op.error is None
    obj = handle.get()
    spec = obj["spec"]
    assert {k: spec[k] for k in ("fleet", "targetVersion", "baseVersion", "source",
                                 "encoder")} == {
        "fleet": "policy", "targetVersion": 7, "baseVersion": 6,
        "source": {"checkpoint": CKPT}, "encoder": {"profile": "default", "owners": 2}}
    assert obj["status"]["phase"] == "Committed"
    phases = [p.phase for p in seen]
    assert phases[0] == "Pending"
    assert phases[-1] == "Committed"
    assert [p for p in phases if p != "Pending"] == ["Encoding", "Applying", "Committed"]
    assert seen[-1].applied == seen[-1].receivers == 2
    assert seen[-1].bytes == 1234
    assert seen[-1].message == "Committed/Committed: version 7"


def test_a_trainer_in_another_cluster_refits_through_a_kubeconfig_of_the_example_role(
        control_plane: ControlPlane, kube: KubeClient, namespace: str, tmp_path: Path) -> None:
    """docs/two-clusters.md, step 5, as written: the example's ``trainer`` ServiceAccount and
    Role (create, get, list, watch on weightrefits, nothing more) in the rollout cluster, a
    token of it in a kubeconfig file, ``new_client_from_config`` and ``api_client=``: the
    refit is created and waited on to its commit with those rights alone."""
    example = yaml.safe_load_all((CHART / "examples" / "trainer-ranks.yaml").read_text())
    apply(kube, [o for o in example if o and o["kind"] in ("ServiceAccount", "Role",
                                                            "RoleBinding")], namespace)
    token = control_plane.service_account_token(namespace, "trainer")
    rollout = control_plane.write_kubeconfig_for_token(token, tmp_path / "kubeconfig")
    op = Operator(kube, namespace, "policy-v7", [ENCODING, PUBLISHED, COMMITTED])
    op.start()
    with config.new_client_from_config(config_file=str(rollout)) as trainer_api:
        handle = refit("policy", 7, CKPT, namespace=namespace, api_client=trainer_api,
                       progress_bar=False, timeout_s=60)
    op.join(5)
    assert op.error is None
    assert handle.get()["status"]["phase"] == "Committed"


def test_asynchronous_rl_returns_once_published_then_waits_for_the_commit(
        kube: KubeClient, api: ApiClient, namespace: str) -> None:
    op = Operator(kube, namespace, "policy-v7", [ENCODING, PUBLISHED])
    op.start()
    handle = refit("policy", 7, CKPT, namespace=namespace, api_client=api, wait="published",
                   progress_bar=False, timeout_s=60)
    op.join(5)
    p = handle.progress
    assert (p.phase, p.applied, p.receivers) == ("Applying", 1, 2)  # not committed yet
    later = Operator(kube, namespace, "policy-v7", [COMMITTED], every_s=0.5)
    later.start()
    assert handle.wait(timeout_s=60).progress.phase == "Committed"
    later.join(5)


@pytest.mark.parametrize(("reason", "kind"), [
    ("RetryLimitReached", WeightRefitFailed),
    ("DeadlineExceeded", WeightRefitFailed),
    ("BaseVersionMismatch", WeightRefitSuperseded),
    ("TargetCommittedElsewhere", WeightRefitSuperseded),
])
def test_a_failed_refit_raises_with_its_reason_and_message(
        kube: KubeClient, api: ApiClient, namespace: str, reason: str,
        kind: type[WeightRefitFailed]) -> None:
    message = f"3 attempts failed; last: rollout-1 {reason.lower()}"
    op = Operator(kube, namespace, "policy-v7", [ENCODING, _failed(reason, message)])
    op.start()
    with pytest.raises(WeightRefitFailed) as info:
        refit("policy", 7, CKPT, namespace=namespace, api_client=api, progress_bar=False,
              timeout_s=60)
    assert type(info.value) is kind
    assert (info.value.name, info.value.reason, info.value.message) == (
        "policy-v7", reason, message)
    assert reason in str(info.value)
    assert message in str(info.value)


def test_a_refit_that_does_not_finish_in_time_raises_a_timeout_naming_where_it_is(
        kube: KubeClient, api: ApiClient, namespace: str) -> None:
    op = Operator(kube, namespace, "policy-v7", [ENCODING], every_s=0.1)
    op.start()
    t0 = time.monotonic()
    with pytest.raises(WeightRefitTimeout) as info:
        refit("policy", 7, CKPT, namespace=namespace, api_client=api, progress_bar=False,
              timeout_s=3)
    assert time.monotonic() - t0 >= 3
    assert info.value.phase == "Encoding"
    assert "EncoderJobRunning" in info.value.condition
    assert "within 3 s" in str(info.value)


def test_asking_again_attaches_to_the_same_refit_and_a_different_spec_is_refused(
        kube: KubeClient, api: ApiClient, namespace: str) -> None:
    first = refit("policy", 7, CKPT, namespace=namespace, api_client=api, wait="created")
    uid = first.get()["metadata"]["uid"]
    op = Operator(kube, namespace, "policy-v7", [COMMITTED])
    op.start()
    again = refit("policy", 7, CKPT, namespace=namespace, api_client=api,
                  progress_bar=False, timeout_s=60)  # a restarted loop
    assert again.get()["metadata"]["uid"] == uid
    with pytest.raises(WeightRefitError, match=r"exists with another spec \(source differ\)"):
        refit("policy", 7, "/ckpt/other", namespace=namespace, api_client=api,
              wait="created")


def test_bad_arguments_are_refused_before_any_call(api: ApiClient, namespace: str) -> None:
    with pytest.raises(WeightRefitError, match="version must be at least 1, got 0"):
        refit("policy", 0, CKPT, namespace=namespace, api_client=api)
    with pytest.raises(WeightRefitError, match=r"base_version must be in \[0, 7\), got 7"):
        refit("policy", 7, CKPT, base_version=7, namespace=namespace, api_client=api)
    with pytest.raises(WeightRefitError, match="'Policy_v7' is not a valid WeightRefit name"):
        refit("policy", 7, CKPT, name="Policy_v7", namespace=namespace, api_client=api)


def test_the_api_servers_refusal_is_raised_with_its_message(
        kube: KubeClient, api: ApiClient, namespace: str) -> None:
    """The CRD's schema refuses a relative checkpoint path: the error says so."""
    with pytest.raises(WeightRefitError, match=r"Creating WeightRefit .*/policy-v7: 422") as info:
        refit("policy", 7, "relative/ckpt", namespace=namespace, api_client=api,
              wait="created")
    assert "checkpoint" in str(info.value)


def test_a_refit_deleted_while_waited_on_is_an_error(
        kube: KubeClient, api: ApiClient, namespace: str) -> None:
    def delete_soon() -> None:
        time.sleep(1.0)
        kube.delete(_path(namespace, "policy-v7"))

    threading.Thread(target=delete_soon, daemon=True).start()
    with pytest.raises(WeightRefitError, match="policy-v7 was deleted while waited on"):
        refit("policy", 7, CKPT, namespace=namespace, api_client=api, progress_bar=False,
              timeout_s=30)


def test_a_refit_rides_through_api_server_restarts_before_and_during_its_wait(
        control_plane: ControlPlane, kube: KubeClient, api: ApiClient,
        namespace: str) -> None:
    """The API server is down when the loop asks (the create is asked again until it is
    back) and restarts again while the loop watches (the dropped watch resumes); the
    commit written after that is the one ``refit`` returns at."""
    seen: list[Progress] = []
    outcome: list[BaseException | Refit] = []

    def loop() -> None:
        try:
            outcome.append(refit("policy", 7, CKPT, namespace=namespace, api_client=api,
                                 on_progress=seen.append, progress_bar=False,
                                 timeout_s=300))
        except BaseException as e:
            outcome.append(e)

    asking = threading.Thread(target=loop, daemon=True)
    control_plane.restart_apiserver(while_down=lambda: (asking.start(), time.sleep(3.0)))
    Operator(kube, namespace, "policy-v7", [ENCODING], every_s=0.0).run()
    deadline = time.monotonic() + 120
    while not any(p.phase == "Encoding" for p in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(p.phase == "Encoding" for p in seen), "the loop never saw its refit encoding"
    control_plane.restart_apiserver(while_down=lambda: time.sleep(3.0))
    Operator(kube, namespace, "policy-v7", [PUBLISHED, COMMITTED], every_s=0.0).run()
    asking.join(240)
    assert [type(o).__name__ for o in outcome] == ["Refit"], outcome
    assert seen[-1].phase == "Committed"
    assert kube.get(_path(namespace, "policy-v7"))["spec"]["targetVersion"] == 7
