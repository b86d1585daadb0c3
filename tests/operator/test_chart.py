"""The Helm chart: lint-clean, schema-valid manifests, and RBAC that is just enough.

The RBAC tests install what ``helm template`` renders into the real apiserver and ask,
as the chart's ServiceAccount (a bound token from the TokenRequest API), whether each
thing the operator does is allowed, and whether a few things it never does are denied.
The end-to-end test proves the same RBAC by running the operator with that token.
Watching every namespace, the "cluster-wide" flavour names the namespace its fleets
live in (``rbac.workloadNamespaces``): only there may it read Secrets and run Jobs.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from controlplane import ControlPlane
from k8sutil import CHART, apply, helm_template, install_crds

from dcr_operator.errors import ApiError
from dcr_operator.kube import KubeClient
from dcr_operator.metrics import Metrics

KUBE_VERSION = "1.37.0"  # the control plane's release line (tools/controlplane/build.sh)
FLAVOURS = {"cluster-wide": ["--set=rbac.workloadNamespaces={elsewhere}"],
            "namespaced": ["--set=watchNamespaces={team-a,team-b}"]}
CUSTOM_KINDS = {"ClusterKopfPeering", "KopfPeering", "RolloutFleet", "WeightRefit"}


def _helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_helm_lint_strict_is_clean(helm: Path, flavour: str) -> None:
    done = _helm(helm, "lint", "--strict", str(CHART), *FLAVOURS[flavour])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_values_schema_rejects_unknown_keys_and_bad_types(helm: Path) -> None:
    typo = _helm(helm, "template", "dcr", str(CHART), "--set=replicas=2")
    assert typo.returncode != 0
    assert "replicas" in typo.stderr
    bad = _helm(helm, "template", "dcr", str(CHART), "--set=peering.priority=high")
    assert bad.returncode != 0
    assert "priority" in bad.stderr


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_rendered_manifests_validate_against_kubernetes_schemas(helm: Path,
                                                                flavour: str) -> None:
    objs = helm_template(helm, "--include-crds", *FLAVOURS[flavour])
    kinds = sorted({o["kind"] for o in objs})
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount"} <= set(kinds)
    for obj in objs:
        if obj["kind"] in CUSTOM_KINDS:
            continue  # no published schema: the apiserver validates them (test below)
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def _access(cp: ControlPlane, token: str, verb: str, resource: str, *, group: str = "",
            namespace: str | None = None, sub: str = "") -> bool:
    attrs: dict[str, Any] = {"verb": verb, "resource": resource, "group": group}
    if namespace:
        attrs["namespace"] = namespace
    if sub:
        attrs["subresource"] = sub
    r = cp.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                   {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": attrs}}, token=token)
    assert r.status == 201, r.body
    return bool(r.body["status"]["allowed"])


# (verb, resource, group, subresource): everything the operator and kopf do.
USED = [
    ("watch", "weightrefits", "dcr.dev", ""), ("patch", "weightrefits", "dcr.dev", ""),
    ("delete", "weightrefits", "dcr.dev", ""), ("list", "rolloutfleets", "dcr.dev", ""),
    ("get", "rolloutfleets", "dcr.dev", ""),
    ("patch", "rolloutfleets", "dcr.dev", "status"),
    ("patch", "weightrefits", "dcr.dev", "status"),
    ("list", "pods", "", ""), ("get", "secrets", "", ""), ("create", "configmaps", "", ""),
    ("patch", "configmaps", "", ""),
    ("create", "events", "", ""), ("create", "jobs", "batch", ""),
    ("delete", "jobs", "batch", ""), ("get", "jobs", "batch", ""),
    ("create", "secrets", "", ""), ("get", "services", "", ""), ("create", "services", "", ""),
    ("patch", "services", "", ""),
]
# Things it never does: none of them may be granted.
UNUSED = [
    ("create", "weightrefits", "dcr.dev", ""), ("delete", "rolloutfleets", "dcr.dev", ""),
    ("update", "rolloutfleets", "dcr.dev", "status"), ("list", "secrets", "", ""),
    ("delete", "pods", "", ""), ("create", "pods", "", ""), ("patch", "jobs", "batch", ""),
    ("delete", "configmaps", "", ""), ("create", "deployments", "apps", ""),
    ("create", "rolebindings", "rbac.authorization.k8s.io", ""),
    ("patch", "secrets", "", ""), ("update", "secrets", "", ""), ("delete", "secrets", "", ""),
    ("delete", "services", "", ""),
]


@pytest.mark.e2e
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_the_chart_service_account_may_do_exactly_what_the_operator_does(
        control_plane: ControlPlane, kube: KubeClient, helm: Path, flavour: str) -> None:
    release = f"rbac-{flavour}"
    ns = f"dcr-{flavour}"
    watched = ["team-a", "team-b"] if flavour == "namespaced" else []
    for name in (ns, *watched, "elsewhere"):
        apply(kube, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}])
    install_crds(kube)
    objs = helm_template(helm, f"--namespace={ns}", *FLAVOURS[flavour], release=release)
    created = apply(kube, objs, ns)  # every rendered object is accepted by the apiserver
    assert sorted(o["kind"] for o in created) == sorted(o["kind"] for o in objs)
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    token = control_plane.service_account_token(ns, sa)
    for target in watched or ["elsewhere"]:
        for verb, resource, group, sub in USED:
            assert _access(control_plane, token, verb, resource, group=group,
                           namespace=target, sub=sub), (verb, resource, sub, target)
        for verb, resource, group, sub in UNUSED:
            assert not _access(control_plane, token, verb, resource, group=group,
                               namespace=target, sub=sub), (verb, resource, sub, target)
        peering = "kopfpeerings" if watched else "clusterkopfpeerings"
        assert _access(control_plane, token, "patch", peering, group="kopf.dev",
                       namespace=target if watched else None)
    assert _access(control_plane, token, "list", "customresourcedefinitions",
                   group="apiextensions.k8s.io")
    assert _access(control_plane, token, "watch", "namespaces")
    if watched:  # nothing in namespaces it does not watch
        assert not _access(control_plane, token, "get", "secrets", namespace="elsewhere")
        assert not _access(control_plane, token, "list", "weightrefits", group="dcr.dev",
                           namespace="elsewhere")


# (verb, resource, group): what lets the operator run pods and read credentials.
WORKLOADS = [("get", "secrets", ""), ("create", "configmaps", ""), ("create", "jobs", "batch"),
             ("delete", "jobs", "batch")]


@pytest.mark.e2e
def test_watching_every_namespace_grants_jobs_and_secrets_only_where_named(
        control_plane: ControlPlane, kube: KubeClient, helm: Path) -> None:
    """Fails on 5b0b0ae: the default install let the operator create Jobs and read
    Secrets in every namespace, so anyone who could create a WeightRefit (or a fleet)
    in any namespace could have it run pods there."""
    install_crds(kube)
    for name in ("dcr-narrow", "fleets", "elsewhere"):
        apply(kube, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}])
    cases = {"rbac-default": ([], set()),
             "rbac-named": (["--set=rbac.workloadNamespaces={fleets}"], {"fleets"}),
             "rbac-wide": (["--set=rbac.workloadsClusterWide=true"], {"fleets", "elsewhere"})}
    for release, (args, granted) in cases.items():
        objs = helm_template(helm, "--namespace=dcr-narrow", *args, release=release)
        apply(kube, objs, "dcr-narrow")
        sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
        token = control_plane.service_account_token("dcr-narrow", sa)
        for target in ("fleets", "elsewhere"):
            for verb, resource, group in WORKLOADS:
                assert _access(control_plane, token, verb, resource, group=group,
                               namespace=target) == (target in granted), (
                    release, verb, resource, target)
            assert _access(control_plane, token, "watch", "weightrefits", group="dcr.dev",
                           namespace=target)
            assert _access(control_plane, token, "list", "pods", namespace=target)


def test_with_watched_namespaces_all_that_is_cluster_wide_is_reading_crds_and_namespaces(
        helm: Path) -> None:
    """values.yaml promises nothing cluster-wide beyond kopf's discovery with
    watchNamespaces set (it said "nothing cluster-wide" while the chart rendered this
    ClusterRole): every cluster-scoped rule is list/watch of CRDs and Namespaces."""
    objs = helm_template(helm, "--namespace=dcr-system", "--set=watchNamespaces={rl}",
                         release="narrow")
    cluster_roles = [o for o in objs if o["kind"] == "ClusterRole"]
    assert [o["metadata"]["name"] for o in cluster_roles] == ["narrow-dcr-operator-discovery"]
    rules = {(g, r, v) for rule in cluster_roles[0]["rules"] for g in rule["apiGroups"]
             for r in rule["resources"] for v in rule["verbs"]}
    assert rules == {("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                     ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
                     ("", "namespaces", "list"), ("", "namespaces", "watch")}
    assert "list and watch CustomResourceDefinitions and Namespaces" in " ".join(
        (CHART / "values.yaml").read_text().split())


# --- the helm test hook ------------------------------------------------------------------


def _test_hook(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (pod,) = [o for o in objs
              if o.get("metadata", {}).get("annotations", {}).get("helm.sh/hook") == "test"]
    return pod


def test_the_helm_test_pod_runs_as_restricted_as_the_operator_and_asks_its_service(
        helm: Path) -> None:
    objs = helm_template(helm, "--namespace=dcr-system")
    pod = _test_hook(objs)
    operator = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]
    service = next(o for o in objs if o["kind"] == "Service")
    (container,) = pod["spec"]["containers"]
    (op_container,) = operator["spec"]["containers"]
    assert pod["spec"]["securityContext"] == operator["spec"]["securityContext"]
    assert container["securityContext"] == op_container["securityContext"]
    assert container["image"] == op_container["image"]
    # Least privilege: no API token, no Service environment, not behind the operator's
    # Service.
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["enableServiceLinks"] is False
    assert not service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert container["command"][:2] == ["python", "-c"]
    assert container["command"][-1] == "http://dcr-operator-metrics.dcr-system.svc:8081/metrics"
    assert not [o for o in helm_template(helm, "--set=metrics.service.enabled=false")
                if o.get("metadata", {}).get("annotations", {}).get("helm.sh/hook")]


def test_the_helm_test_script_passes_against_the_operator_metrics(
        helm: Path, tmp_path: Path) -> None:
    """The hook's own script, run here against a server answering with the operator's real
    exposition (the cluster's Service stands in for loopback)."""
    text = Metrics().render().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        command = _test_hook(helm_template(helm))["spec"]["containers"][0]["command"]
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        done = subprocess.run([sys.executable, "-c", command[2], url], capture_output=True,
                              text=True, timeout=120, check=False, cwd=tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"The DCR operator answers at {url}."


def test_the_restricted_pod_security_standard_admits_the_helm_test_pod(
        kube: KubeClient, helm: Path) -> None:
    ns = "dcr-restricted"
    apply(kube, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": ns, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}}])
    pod = _test_hook(helm_template(helm, f"--namespace={ns}"))
    loose = {**pod, "metadata": {**pod["metadata"], "name": "loose"},
             "spec": {**pod["spec"], "securityContext": {}}}
    with pytest.raises(ApiError, match="restricted"):  # the standard is enforced here
        kube.create(f"/api/v1/namespaces/{ns}/pods", loose)
    created = kube.create(f"/api/v1/namespaces/{ns}/pods", pod)
    assert created["metadata"]["name"] == "dcr-operator-test-metrics"


TLS = ["--set=tls.enabled=true", "--set=tls.certificates.enabled=true",
       "--set=tls.certificates.issuerRef.name=dcr-ca", "--set=tls.certificates.namespace=rl",
       "--set=tls.certificates.roles.encoder.dnsNames={dcr-encoder.rl.svc}"]


def test_with_tls_the_operator_trusts_the_ca_secret_and_checks_the_server_name(
        helm: Path) -> None:
    (deployment,) = [o for o in helm_template(helm, *TLS) if o["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["DCR_TLS_SERVER_NAME"] == "peer.dcr.internal"
    assert "DCR_TLS_CERT" not in env  # it serves nothing that needs a key
    (mount,) = [m for m in c["volumeMounts"] if env["DCR_TLS_CA"].startswith(m["mountPath"])]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"] == {"secretName": "dcr-operator-tls",
                                "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    (monitor,) = [o for o in helm_template(helm, *TLS, "--set=metrics.agentPodMonitor.enabled=true",
                                           "--set=metrics.agentPodMonitor.selector.app=x")
                  if o["kind"] == "PodMonitor"]
    (scrape,) = monitor["spec"]["podMetricsEndpoints"]
    assert scrape["scheme"] == "https"
    assert scrape["tlsConfig"] == {"ca": {"secret": {"name": "dcr-operator-tls", "key": "ca.crt"}},
                                   "serverName": "peer.dcr.internal"}
    plain = next(o for o in helm_template(helm) if o["kind"] == "Deployment")
    assert not any(e["name"].startswith("DCR_TLS_")
                   for e in plain["spec"]["template"]["spec"]["containers"][0]["env"])


def test_cert_manager_certificates_per_server_role_name_the_server_name(helm: Path) -> None:
    certs = {o["metadata"]["name"]: o for o in helm_template(helm, *TLS)
             if o["kind"] == "Certificate"}
    assert set(certs) == {"dcr-agent-tls", "dcr-encoder-tls", "dcr-relay-tls",
                          "dcr-operator-tls"}
    for name in ("dcr-agent-tls", "dcr-encoder-tls", "dcr-relay-tls"):
        spec = certs[name]["spec"]
        assert certs[name]["metadata"]["namespace"] == "rl"
        assert spec["secretName"] == name
        assert spec["dnsNames"][0] == "peer.dcr.internal"
        assert "server auth" in spec["usages"]
        assert spec["issuerRef"] == {"name": "dcr-ca", "kind": "ClusterIssuer",
                                     "group": "cert-manager.io"}
    assert certs["dcr-encoder-tls"]["spec"]["dnsNames"] == ["peer.dcr.internal",
                                                           "dcr-encoder.rl.svc"]
    assert certs["dcr-relay-tls"]["spec"]["secretTemplate"] == {
        "labels": {"dcr.dev/relay-ca": "true"}}  # what spec.relay.caSecretRef asks of it
    assert certs["dcr-operator-tls"]["metadata"]["namespace"] == "default"
    no_issuer = _helm(helm, "template", "dcr", str(CHART), "--set=tls.certificates.enabled=true")
    assert no_issuer.returncode != 0
    assert "tls.certificates.issuerRef.name" in no_issuer.stderr
