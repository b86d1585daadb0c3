"""The training cluster's kubeconfig Secret, rotated while the operator uses it.

On a real kube-apiserver: the Secret holds a ServiceAccount token bound to a Secret of the
training namespace (``kubectl create token --bound-object-kind Secret``, as
docs/two-clusters.md mints it), the operator's client for that cluster lists Jobs with
it, the Secret is updated to a second token and the first one is revoked (its bound
Secret deleted). The client's next call is refused (401), reads the kubeconfig Secret
again and succeeds: no refit has to fail and start over for a rotation. The tokens
appear in no log line. And the example Role (charts/dcr/examples/training-cluster.yaml)
grants that ServiceAccount exactly the calls the operator makes there, nothing more.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest
import yaml
from controlplane import ControlPlane
from k8sutil import REPO, apply, eventually

from dcr_operator.api.rolloutfleet import EncoderProfile
from dcr_operator.kube import KubeClient, api_path
from dcr_operator.sites import encoder_site

SA = "dcr-operator-remote"


def _kubeconfig_secret(cp: ControlPlane, token: str) -> dict[str, Any]:
    kubeconfig = json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "training",
        "contexts": [{"name": "training", "context": {"cluster": "training", "user": "op"}}],
        "clusters": [{"name": "training", "cluster": {
            "server": cp.server,
            "certificate-authority-data": base64.b64encode(cp.ca_path.read_bytes()).decode()}}],
        "users": [{"name": "op", "user": {"token": token}}]})
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "training-cluster",
                         "labels": {"dcr.dev/encoder-cluster": "true"}},
            "data": {"kubeconfig": base64.b64encode(kubeconfig.encode()).decode()}}


def test_a_rotated_kubeconfig_secret_is_read_again_once_the_old_token_is_revoked(
        control_plane: ControlPlane, kube: KubeClient, namespace: str,
        caplog: pytest.LogCaptureFixture) -> None:
    cp, ns = control_plane, namespace
    jobs = api_path("batch", "v1", "jobs", ns)
    apply(kube, [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SA}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": SA},
         "rules": [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": SA},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA},
         "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": ns}]},
        *({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"op-token-{i}"}}
          for i in (1, 2))], ns)
    first = cp.service_account_token(ns, SA, bound_secret="op-token-1")
    apply(kube, [_kubeconfig_secret(cp, first)], ns)
    profile = EncoderProfile.model_validate({"name": "training", "cluster": {
        "kubeconfigSecretRef": {"name": "training-cluster"}, "namespace": ns}})
    caplog.set_level(logging.DEBUG)
    site = encoder_site(kube, ns, profile)
    eventually(lambda: site.kube.get(jobs), what="the first token's RBAC in force")

    second = cp.service_account_token(ns, SA, bound_secret="op-token-2")
    apply(kube, [_kubeconfig_secret(cp, second)], ns)  # the Secret first, then revoke
    kube.delete(api_path("", "v1", "secrets", ns, "op-token-1"))
    eventually(lambda: cp.request("GET", jobs, token=first).status == 401, timeout_s=60,
               what="the first token revoked")

    assert site.kube.get(jobs)["items"] == []  # read the Secret again, with the second token
    assert "refused its credentials: reading the Secret again" in caplog.text
    for token in (first, second):
        assert token not in caplog.text


# What the operator does in the training cluster (docs/two-clusters.md, "Setting it up,
# step by step", the table under step 1): the example Role must grant exactly this.
OPERATOR_CALLS = {("batch", "jobs"): {"create", "get", "list", "delete"},
                  ("", "configmaps"): {"create", "get", "delete"},
                  ("", "secrets"): {"get"},
                  ("", "pods"): {"list"}}


def _granted(cp: ControlPlane, namespace: str, account: str) -> set[tuple[str, str, str]]:
    """(group, resource, verb) that ServiceAccount ``account`` may use in ``namespace``."""
    review = cp.request(
        "POST", "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
         "spec": {"namespace": namespace}},
        token=cp.service_account_token(namespace, account))
    assert review.status == 201, review.body
    return {(group, resource, verb) for rule in review.body["status"]["resourceRules"]
            for group in rule.get("apiGroups", []) for resource in rule.get("resources", [])
            for verb in rule["verbs"]}


def test_the_example_training_cluster_role_grants_exactly_the_operators_calls(
        control_plane: ControlPlane, kube: KubeClient, namespace: str) -> None:
    example = REPO / "charts" / "dcr" / "examples" / "training-cluster.yaml"
    apply(kube, [o for o in yaml.safe_load_all(example.read_text()) if o], namespace)
    # What every ServiceAccount may do (ask who it is, read trust bundles) is not the Role's.
    everyone = _granted(control_plane, namespace, "default")
    extra = _granted(control_plane, namespace, SA) - everyone
    assert extra == {(group, resource, verb) for (group, resource), verbs
                     in OPERATOR_CALLS.items() for verb in verbs}
