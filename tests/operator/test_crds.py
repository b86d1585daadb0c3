"""The CRDs: generated from the pydantic models, checked in, structural, and usable."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from dcr_operator.api.generate import (
    ENTRY_POINT,
    OUTPUT_DIRS,
    REPO_ROOT,
    crd_manifests,
    main,
    render,
)
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.api.schema import check_structural, structural
from dcr_operator.api.weightrefit import WeightRefitSpec

EXAMPLES = REPO_ROOT / "charts" / "dcr" / "examples"


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.mark.parametrize("out", OUTPUT_DIRS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_checked_in_crds_equal_the_generated_ones(out: Path) -> None:
    for name, crd in crd_manifests().items():
        path = out / name
        assert path.exists(), f"{path} is missing: run `{ENTRY_POINT}`"
        assert path.read_text() == render(crd), (
            f"{path} is stale: run `{ENTRY_POINT}`")
    extra = {p.name for p in out.glob("*.yaml")} - set(crd_manifests())
    assert not extra, f"{out} holds CRDs no model generates: {sorted(extra)}"


def test_check_mode_reports_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "dcr.dev_weightrefits.yaml").write_text("stale\n")
    assert main(["--check", "--out", str(tmp_path)]) == 1
    assert "stale" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(crd_manifests()))
def test_every_schema_is_structural(name: str) -> None:
    schema = _schema(crd_manifests()[name])
    assert check_structural(schema) == []
    text = yaml.safe_dump(schema)
    for forbidden in ("$ref", "$defs", "nullable", "title:", "additionalProperties: false"):
        assert forbidden not in text


def test_dcr_crds_have_status_subresource_printer_columns_and_list_maps() -> None:
    crds = crd_manifests()
    refit = crds["dcr.dev_weightrefits.yaml"]["spec"]
    version = refit["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c]
    assert columns == ["Fleet", "Version", "Phase", "Reason", "Attempts", "Receivers", "Bytes",
                       "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["conditions"]["x-kubernetes-list-type"] == "map"
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert status["conditions"]["items"]["required"] == ["type", "status", "reason",
                                                         "lastTransitionTime"]
    assert status["attempts"]["x-kubernetes-list-map-keys"] == ["id"]
    fleet = crds["dcr.dev_rolloutfleets.yaml"]["spec"]["versions"][0]
    fleet_status = fleet["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(fleet_status["commit"]["required"]) == {"committedVersion", "baselineId",
                                                       "attempt"}
    assert "Version" in [c["name"] for c in fleet["additionalPrinterColumns"]]


def test_immutable_fields_carry_cel_transition_rules() -> None:
    crds = crd_manifests()
    refit_spec = _schema(crds["dcr.dev_weightrefits.yaml"])["properties"]["spec"]
    rules = [r["rule"] for r in refit_spec["x-kubernetes-validations"]]
    assert "self == oldSelf" in rules
    assert "self.targetVersion > self.baseVersion" in rules
    fleet_spec = _schema(crds["dcr.dev_rolloutfleets.yaml"])["properties"]["spec"]
    assert {"rule": "self == oldSelf"}.items() <= (
        fleet_spec["properties"]["initial"]["x-kubernetes-validations"][0].items())


def _undescribed(node: dict[str, Any], path: str) -> list[str]:
    """Paths of the properties under ``node``, at every depth, that have no description."""
    out: list[str] = []
    for name, sub in node.get("properties", {}).items():
        if not sub.get("description"):
            out.append(f"{path}.{name}")
        out += _undescribed(sub, f"{path}.{name}")
    if "items" in node:
        out += _undescribed(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _undescribed(node["additionalProperties"], f"{path}.*")
    return out


@pytest.mark.parametrize("name", ["dcr.dev_rolloutfleets.yaml", "dcr.dev_weightrefits.yaml"])
def test_every_field_has_a_description_for_kubectl_explain(name: str) -> None:
    """Every property, at every depth, but metadata: the API server refuses anything but
    its type there, and ``kubectl explain`` describes ObjectMeta itself."""
    crd = crd_manifests()[name]
    kind = crd["spec"]["names"]["kind"]
    missing = _undescribed(_schema(crd), kind)
    missing = [p for p in missing if p != f"{kind}.metadata"]
    assert not missing, f"fields without a description: {missing}"


def test_status_schemas_carry_no_defaults_and_specs_do() -> None:
    schema = _schema(crd_manifests()["dcr.dev_rolloutfleets.yaml"])
    assert "default: " not in yaml.safe_dump(schema["properties"]["status"])
    assert schema["properties"]["spec"]["properties"]["retryLimit"]["default"] == 4


def test_structural_inlines_refs_and_rewrites_json_schema_keywords() -> None:
    schema = structural({
        "$defs": {"Inner": {"title": "Inner", "type": "object",
                            "properties": {"n": {"type": "integer", "exclusiveMinimum": 0}},
                            "additionalProperties": False}},
        "type": "object",
        "properties": {
            "inner": {"$ref": "#/$defs/Inner", "description": "d"},
            "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "kind": {"const": "X"},
            "free": {"type": "object", "additionalProperties": True},
        },
    })
    props = schema["properties"]
    assert props["inner"] == {"type": "object", "description": "d",
                              "properties": {"n": {"type": "integer", "minimum": 0,
                                                   "exclusiveMinimum": True}}}
    assert props["maybe"] == {"type": "string"}
    assert props["kind"] == {"enum": ["X"], "type": "string"}
    assert props["free"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _examples(kind: str) -> list[dict[str, Any]]:
    return [d for f in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
            if d and d.get("kind") == kind]


def test_chart_examples_parse_with_the_models() -> None:
    fleets, refits = _examples("RolloutFleet"), _examples("WeightRefit")
    assert fleets
    assert refits
    for f in fleets:
        RolloutFleetSpec.model_validate(f["spec"])
    for r in refits:
        spec = WeightRefitSpec.model_validate(r["spec"])
        assert spec.target_version > spec.base_version


def test_a_spec_with_an_unknown_key_names_it() -> None:
    refit = _examples("WeightRefit")[0]["spec"]
    with pytest.raises(ValidationError, match="targetVersoin"):
        WeightRefitSpec.model_validate({**refit, "targetVersoin": 3})


FLEET_SPEC: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "r"}},
    "agent": {"tokenSecretRef": {"name": "tok"}}, "store": {"uri": "file:///s"},
    "initial": {"checkpoint": "/c"}}
REFIT_SPEC: dict[str, Any] = {"fleet": "f", "baseVersion": 0, "targetVersion": 1,
                              "source": {"checkpoint": "/c1"}}


@pytest.mark.parametrize("name", ["fleet#x", "../f", "a/b", "F", "a?b", "", "-a", "a" * 254])
def test_object_names_must_be_what_kubernetes_allows_for_their_kind(name: str) -> None:
    """Fails on 5b0b0ae: ``spec.fleet`` and Secret names took any non-empty string; a
    ``#`` in one sent the commit record's patch to the wrong object."""
    with pytest.raises(ValidationError, match="fleet"):
        WeightRefitSpec.model_validate({**REFIT_SPEC, "fleet": name})
    with pytest.raises(ValidationError, match=r"tokenSecretRef\.name"):
        RolloutFleetSpec.model_validate({**FLEET_SPEC, "agent": {
            "tokenSecretRef": {"name": name}}})
    with pytest.raises(ValidationError, match="serviceAccountName"):
        RolloutFleetSpec.model_validate({**FLEET_SPEC, "encoderProfiles": [
            {"name": "p", "serviceAccountName": name}]})


def test_dotted_names_are_subdomains_and_profile_names_are_labels() -> None:
    assert WeightRefitSpec.model_validate({**REFIT_SPEC, "fleet": "team.a-1"}).fleet == (
        "team.a-1")
    with pytest.raises(ValidationError, match="profile"):
        WeightRefitSpec.model_validate({**REFIT_SPEC, "encoder": {"profile": "a.b"}})
    with pytest.raises(ValidationError, match=r"tokenSecretRef\.key"):
        RolloutFleetSpec.model_validate({**FLEET_SPEC, "agent": {
            "tokenSecretRef": {"name": "t", "key": "../token"}}})


@pytest.mark.parametrize("selector", [
    {}, {"matchLabels": {}}, {"matchExpressions": []}, {"matchLabels": {}, "matchExpressions": []},
    {"matchExpressions": [{"key": "old", "operator": "DoesNotExist"}]},
    {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["x"]}]},
])
def test_a_selector_that_selects_every_pod_is_refused(selector: dict[str, Any]) -> None:
    """Fails on 5b0b0ae: an empty selector (or one that only excludes) passed, and every
    pod of the namespace became a receiver and got the agent token."""
    with pytest.raises(ValidationError, match="selector needs a matchLabels entry"):
        RolloutFleetSpec.model_validate({**FLEET_SPEC, "selector": selector})


@pytest.mark.parametrize("selector", [
    {"matchLabels": {"app": "r"}},
    {"matchExpressions": [{"key": "app", "operator": "In", "values": ["r"]}]},
    {"matchExpressions": [{"key": "app", "operator": "Exists"},
                          {"key": "old", "operator": "DoesNotExist"}]},
])
def test_a_selector_with_a_label_it_requires_is_taken(selector: dict[str, Any]) -> None:
    RolloutFleetSpec.model_validate({**FLEET_SPEC, "selector": selector})


def _fleet_with_volume(volume: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
            "metadata": {"name": "volumes"},
            "spec": {**FLEET_SPEC, "encoderProfiles": [{"name": "p", "volumes": [volume]}]}}


@pytest.mark.e2e
def test_the_apiserver_refuses_a_profile_volume_with_two_sources_or_over_the_profile_dir(
        kube: Any, namespace: str) -> None:
    """The CRD's CEL rules and patterns refuse what the models refuse, for clients that
    never run them; the same volume with one source is stored as written."""
    from k8sutil import install_crds, path_of

    from dcr_operator.errors import ApiError

    install_crds(kube)
    pvc = {"name": "ckpt", "mountPath": "/checkpoints",
           "persistentVolumeClaim": {"claimName": "policy-checkpoints"}}
    refused = [
        ({**pvc, "hostPath": {"path": "/mnt/ckpt"}},
         "set exactly one of persistentVolumeClaim, hostPath and nfs"),
        ({**pvc, "mountPath": "/etc/dcr"},
         "mountPath /etc/dcr would cover or sit inside /etc/dcr/profile"),
        ({**pvc, "mountPath": "/checkpoints/../etc"}, "spec.encoderProfiles[0].volumes[0]"
         ".mountPath: Invalid value"),
        ({"name": "host", "mountPath": "/h", "hostPath": {"path": "mnt"}},
         "spec.encoderProfiles[0].volumes[0].hostPath.path: Invalid value"),
    ]
    for volume, message in refused:
        obj = _fleet_with_volume(volume)
        with pytest.raises(ApiError, match=re.escape(message)) as e:
            kube.create(path_of(obj, namespace), obj)
        assert e.value.status == 422
    obj = _fleet_with_volume(pvc)
    created = kube.create(path_of(obj, namespace), obj)
    assert created["spec"]["encoderProfiles"][0]["volumes"] == [{**pvc, "readOnly": True}]


@pytest.mark.e2e
def test_the_apiserver_refuses_a_profile_with_both_warm_encoders_and_a_cluster(
        kube: Any, namespace: str) -> None:
    from k8sutil import install_crds, path_of

    from dcr_operator.errors import ApiError

    install_crds(kube)
    cluster = {"kubeconfigSecretRef": {"name": "training"}, "namespace": "encoders"}
    both = {"name": "p", "cluster": cluster,
            "endpoint": {"urls": ["http://e:8480"], "tokenSecretRef": {"name": "t"}}}
    obj = {"apiVersion": "dcr.dev/v1alpha1", "kind": "RolloutFleet",
           "metadata": {"name": "two-places"},
           "spec": {**FLEET_SPEC, "encoderProfiles": [both]}}
    with pytest.raises(ApiError, match="set at most one of endpoint") as e:
        kube.create(path_of(obj, namespace), obj)
    assert e.value.status == 422
    obj["spec"]["encoderProfiles"] = [{"name": "p", "cluster": cluster}]
    created = kube.create(path_of(obj, namespace), obj)
    assert created["spec"]["encoderProfiles"][0]["cluster"] == {
        "kubeconfigSecretRef": {"name": "training", "key": "kubeconfig"},
        "namespace": "encoders"}


CHECKPOINTS = {"/c": True, "/checkpoints/policy-a/v3": True, "/a/.hidden/..x/v-1.2": True,
               "/a/$(AWS_SECRET_ACCESS_KEY)": False, "/a/$$b": False, "/a/b\n": False,
               "/a/\x7fb": False, "relative/v1": False, "/a/../b": False, "/a/./b": False,
               "/a//b": False, "/a/": False, "/": False}


@pytest.mark.parametrize(("path", "ok"), CHECKPOINTS.items())
def test_the_checkpoint_pattern_of_the_schema_agrees_with_the_model(path: str, ok: bool
                                                                    ) -> None:
    """Clients that never run the model meet the CRD's pattern: both take the same paths."""
    import re

    from pydantic import ValidationError

    from dcr_operator.api.volumes import CHECKPOINT_PATH

    assert bool(re.fullmatch(CHECKPOINT_PATH, path)) is ok
    try:
        WeightRefitSpec.model_validate({**REFIT_SPEC, "source": {"checkpoint": path}})
        taken = True
    except ValidationError:
        taken = False
    assert taken is ok


@pytest.mark.e2e
def test_the_apiserver_refuses_a_checkpoint_path_the_kubelet_would_expand(
        kube: Any, namespace: str) -> None:
    from k8sutil import install_crds, path_of

    from dcr_operator.errors import ApiError

    install_crds(kube)
    for kind, spec in (("WeightRefit", {**REFIT_SPEC, "source": {
            "checkpoint": "/checkpoints/$(AWS_SECRET_ACCESS_KEY)"}}),
                       ("RolloutFleet", {**FLEET_SPEC, "initial": {
                           "checkpoint": "/checkpoints/$(AWS_SECRET_ACCESS_KEY)"}})):
        obj = {"apiVersion": "dcr.dev/v1alpha1", "kind": kind,
               "metadata": {"name": "expands"}, "spec": spec}
        with pytest.raises(ApiError, match="checkpoint: Invalid value") as e:
            kube.create(path_of(obj, namespace), obj)
        assert e.value.status == 422
