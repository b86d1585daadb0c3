"""The chart's monitoring: the metrics Service, prometheus-operator's ServiceMonitor,
PodMonitor and PrometheusRule, and the Grafana dashboard.

The alerts are rendered by helm and unit-tested by ``promtool test rules``
(tests/operator/monitoring/alerts-test.yaml); every query of the rules and the dashboard
is parsed by promtool and names only series DCR exports; the objects are created in the
real API server with prometheus-operator's own CRDs and strict field validation. The
deploy tier scrapes the real pods (tests/deploy/test_deploy.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from controlplane import ControlPlaneError, built, go_available
from k8sutil import CHART, apply, helm_template, install_crds, path_of, wait_established
from promtext import samples

from dcr.protocol.coordinator import AttemptResult
from dcr.receiver.server import render_metrics
from dcr_operator.errors import ApiError
from dcr_operator.kube import KubeClient
from dcr_operator.metrics import Metrics

pytestmark = pytest.mark.builds("promtool", "monitoring-crds")
HERE = Path(__file__).parent / "monitoring"
ALL_ON = ["--set=metrics.serviceMonitor.enabled=true",
          "--set=metrics.agentPodMonitor.enabled=true",
          "--set=metrics.agentPodMonitor.selector.app=policy-rollout",
          "--set=metrics.agentPodMonitor.namespaces={team-a,team-b}",
          "--set=metrics.prometheusRule.enabled=true",
          "--set=metrics.grafanaDashboard.enabled=true"]


@pytest.fixture(scope="session")
def monitoring(progress: Callable[[str], None]) -> dict[str, Path]:
    """promtool and prometheus-operator's CRDs from tools/controlplane/build.sh (minutes
    the first time)."""
    progress("tests/operator: build.sh promtool monitoring-crds (cached after the first)")
    try:
        return built("promtool", "monitoring-crds", progress=progress)
    except ControlPlaneError:
        if not go_available():
            pytest.skip("no promtool and no Go toolchain to build it")
        raise


def _promtool(monitoring: dict[str, Path], *args: str, cwd: Path) -> str:
    done = subprocess.run([str(monitoring["promtool"]), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _kinds(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def _rule_groups(helm: Path, *args: str) -> dict[str, Any]:
    rule = _kinds(helm_template(helm, "--set=metrics.prometheusRule.enabled=true", *args))
    return dict(rule["PrometheusRule"]["spec"])


def _dashboard(helm: Path) -> dict[str, Any]:
    cm = _kinds(helm_template(helm, "--set=metrics.grafanaDashboard.enabled=true"))
    return dict(json.loads(cm["ConfigMap"]["data"]["dcr.json"]))


def _dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def _exported_names() -> set[str]:
    """Every series name the operator and an agent export, read from real expositions."""
    m = Metrics()
    m.refit_committed(namespace="n", fleet="f", version=1, seconds=1, payload_bytes=1, at=1)
    m.refit_failed(namespace="n", fleet="f", reason="RetryLimitReached")
    m.attempt_ended(AttemptResult(attempt="a", mode="mixed", receivers=(), error="AgentError",
                                  stages={"flush": 1.0}),
                    namespace="n", fleet="f", mode="mixed", outcome="Failed")
    m.fleet_polled(namespace="n", fleet="f", version=1, committed_at=1.0, receivers=1,
                   behind=0)
    m.fleet_refits(namespace="n", fleet="f", unfinished=0)
    agent = SimpleNamespace(
        snapshot=lambda: SimpleNamespace(version=1, gate_open=True, bytes_staged=0),
        counters=SimpleNamespace(payloads_applied=0, payload_bytes_applied=0,
                                 apply_seconds=0.0, attempts={"committed": 1}, dense_loads=0,
                                 store_bytes_fetched=0),
        store=SimpleNamespace(peer_bytes=0, peer_refusals=0), waits=0)
    text = m.render() + render_metrics(agent)  # type: ignore[arg-type]
    return {name for name, _ in samples(text)}


def _names_in(query: str) -> set[str]:
    return set(re.findall(r"\bdcr_[a-z_]+\b", query))


# --- the alerts --------------------------------------------------------------------------


def test_the_alerts_pass_promtool_check_and_unit_tests(helm: Path, monitoring: dict[str, Path],
                                                       tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_rule_groups(helm)))
    shutil.copy(HERE / "alerts-test.yaml", tmp_path)
    assert "5 rules found" in _promtool(monitoring, "check", "rules", "rules.yaml",
                                        cwd=tmp_path)
    out = _promtool(monitoring, "test", "rules", "alerts-test.yaml", cwd=tmp_path)
    assert "SUCCESS" in out


DOCS = Path(__file__).parents[2] / "docs" / "monitoring.md"


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings (lower case, spaces to dashes)."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("base", [None, "https://wiki.example/dcr/runbooks"])
def test_every_alert_links_its_runbook_section_of_the_monitoring_doc(
        helm: Path, base: str | None) -> None:
    args = [f"--set=metrics.prometheusRule.runbookBaseUrl={base}"] if base else []
    rules = _rule_groups(helm, *args)["groups"][0]["rules"]
    sections = _anchors(DOCS.read_text())
    want = base or "https://github.com/dcr-dev/dcr/blob/main/docs/monitoring.md"
    for rule in rules:
        url, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert (url, anchor) == (want, rule["alert"].lower()), rule
        assert anchor in sections, f"docs/monitoring.md has no section #{anchor}"


def test_the_alert_thresholds_are_the_values_given(helm: Path, monitoring: dict[str, Path],
                                                   tmp_path: Path) -> None:
    groups = _rule_groups(helm, "--set=metrics.prometheusRule.failedAttempts=7",
                          "--set=metrics.prometheusRule.failedAttemptsWindow=2h",
                          "--set=metrics.prometheusRule.receiversBehindFor=1h",
                          "--set=metrics.prometheusRule.noCommitMinutes=90")
    rules = {r["alert"]: r for r in groups["groups"][0]["rules"]}
    assert "[2h]" in rules["DCRAttemptsFailing"]["expr"]
    assert rules["DCRAttemptsFailing"]["expr"].endswith(">= 7")
    assert rules["DCRReceiversBehind"]["for"] == "1h"
    assert "> 5400" in rules["DCRNoCommit"]["expr"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    _promtool(monitoring, "check", "rules", "rules.yaml", cwd=tmp_path)
    # ... and the unit tests, written for the defaults, now fail: they test something.
    shutil.copy(HERE / "alerts-test.yaml", tmp_path)
    done = subprocess.run([str(monitoring["promtool"]), "test", "rules", "alerts-test.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode != 0
    assert "DCRNoCommit" in done.stdout + done.stderr


def test_every_query_parses_and_names_only_series_dcr_exports(
        helm: Path, monitoring: dict[str, Path], tmp_path: Path) -> None:
    exported = _exported_names()
    rules = [r["expr"] for r in _rule_groups(helm)["groups"][0]["rules"]]
    panels = _dashboard_queries(_dashboard(helm))
    assert len(panels) >= 10
    for query in rules + panels:
        names = _names_in(query)
        assert names, query
        assert names <= exported, f"{query}: {sorted(names - exported)} not exported"
    # The dashboard's queries as recording rules, Grafana's variables filled in: promtool
    # parses each (a typo in PromQL fails here).
    filled = [q.replace("$__rate_interval", "5m").replace("$namespace", ".*")
              .replace("$fleet", ".*") for q in panels]
    records = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dcr:panel_query_{i}", "expr": q} for i, q in enumerate(filled)]}]}
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(records))
    assert f"{len(panels)} rules found" in _promtool(monitoring, "check", "rules",
                                                     "dashboard.yaml", cwd=tmp_path)


def test_the_dashboard_selects_by_datasource_namespace_and_fleet(helm: Path) -> None:
    dashboard = _dashboard(helm)
    assert dashboard["uid"] == "dcr-refits"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "fleet"}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            if "dcr_operator_" in target["expr"] and "stage" not in target["expr"]:
                assert 'fleet=~"$fleet"' in target["expr"], target["expr"]


# --- the objects -------------------------------------------------------------------------


def test_the_service_and_monitors_find_the_operator_and_the_agents(helm: Path) -> None:
    objs = helm_template(helm, *ALL_ON)
    kinds = _kinds(objs)
    deployment, service = kinds["Deployment"], kinds["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    # Without this, the Service's environment variables (DCR_OPERATOR_METRICS_SERVICE_HOST,
    # ...) reach the operator, whose settings refuse unknown DCR_OPERATOR_* names.
    assert pod["spec"]["enableServiceLinks"] is False
    # The Service selects the operator's pod and targets its named port ...
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["targetPort"]) == ("metrics", "metrics")
    # ... the ServiceMonitor selects the Service, keeping the fleets' namespace labels.
    sm = kinds["ServiceMonitor"]["spec"]
    assert sm["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    (endpoint,) = sm["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["honorLabels"]) == (
        "metrics", "/metrics", True)
    # The PodMonitor scrapes the agents' named port where the rollout pods are.
    pm = kinds["PodMonitor"]["spec"]
    assert pm["selector"]["matchLabels"] == {"app": "policy-rollout"}
    assert pm["namespaceSelector"]["matchNames"] == ["team-a", "team-b"]
    assert pm["podMetricsEndpoints"] == [{"port": "dcr-agent", "path": "/metrics",
                                          "interval": "30s"}]
    # The example rollout pods name that port.
    example = yaml.safe_load_all((CHART / "examples" / "rollout-reference.yaml").read_text())
    ports = {p["name"] for d in example if d and d["kind"] == "Deployment"
             for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert "dcr-agent" in ports


def test_helm_lint_strict_is_clean_with_all_of_it_on(helm: Path) -> None:
    done = subprocess.run([str(helm), "lint", "--strict", str(CHART), *ALL_ON],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_monitoring_is_off_unless_asked_and_refuses_what_cannot_work(helm: Path) -> None:
    kinds = {o["kind"] for o in helm_template(helm)}
    assert "Service" in kinds
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}
    assert "Service" not in {o["kind"] for o in helm_template(
        helm, "--set=metrics.enabled=false")}

    def refused(*args: str) -> str:
        done = subprocess.run([str(helm), "template", "dcr", str(CHART), *args],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode != 0, done.stdout
        return done.stderr

    assert "metrics.service.enabled" in refused("--set=metrics.serviceMonitor.enabled=true",
                                                "--set=metrics.service.enabled=false")
    assert "selector" in refused("--set=metrics.agentPodMonitor.enabled=true")
    assert "noCommitMinutes" in refused("--set=metrics.prometheusRule.noCommitMinutes=0")
    assert "interval" in refused("--set=metrics.serviceMonitor.interval=soon")


def test_the_api_server_accepts_the_monitoring_objects_under_their_crds(
        helm: Path, monitoring: dict[str, Path], kube: KubeClient, namespace: str) -> None:
    crds = [yaml.safe_load(p.read_text())
            for p in sorted(monitoring["monitoring-crds"].glob("*.yaml"))]
    assert {c["spec"]["names"]["kind"] for c in crds} == {
        "ServiceMonitor", "PodMonitor", "PrometheusRule"}
    apply(kube, crds)
    wait_established(kube, crds)
    install_crds(kube)
    objs = [o for o in helm_template(helm, f"--namespace={namespace}", *ALL_ON)
            if o["kind"] in {"Service", "ServiceMonitor", "PodMonitor", "PrometheusRule",
                             "ConfigMap"}]
    assert len(objs) == 5
    for obj in objs:  # strict: a field the CRD's schema does not know is an error
        created = kube.create(path_of(obj, namespace) + "?fieldValidation=Strict", obj)
        field = "data" if obj["kind"] == "ConfigMap" else "spec"
        if obj["kind"] != "Service":  # a Service's spec gains defaults (clusterIP, ...)
            assert created[field] == obj[field], obj["kind"]
    # The schema is enforced: a misspelt field is refused.
    bad = dict(_kinds(objs)["ServiceMonitor"])
    bad["metadata"] = {**bad["metadata"], "name": "misspelt"}
    bad["spec"] = {**bad["spec"], "endpoint": bad["spec"]["endpoints"]}
    with pytest.raises(ApiError, match="endpoint"):
        kube.create(path_of(bad, namespace) + "?fieldValidation=Strict", bad)
