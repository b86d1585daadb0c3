"""Operator settings parse once from the environment and refuse what they do not know; the
Helm chart sets each from the value its declaration names, with the same default, and
its values schema is generated from the declarations.

The chart is read as text (the Deployment's env entries, values.yaml, Chart.yaml), so this
needs no helm binary; tests/operator/test_chart.py renders it with helm."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from dcr.errors import ConfigError
from dcr_operator.api.generate import REPO_ROOT
from dcr_operator.settings import OperatorSettings, declared, env_name
from dcr_operator.values_schema import ENTRY_POINT, JSON_TYPES, SCHEMA_PATH, main, render


def test_settings_parse_from_the_environment() -> None:
    s = OperatorSettings.from_env({"DCR_OPERATOR_ENCODER_IMAGE": "img:2",
                                   "DCR_OPERATOR_JOB_POLL_SECONDS": "0.5",
                                   "DCR_OPERATOR_ENCODER_TTL_SECONDS": "60",
                                   "DCR_OPERATOR_CLEANUP_STORE": "false", "HOME": "/x"})
    assert (s.encoder_image, s.job_poll_seconds, s.encoder_ttl_seconds, s.cleanup_store) == (
        "img:2", 0.5, 60, False)


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(ConfigError, match="Unknown setting DCR_OPERATOR_JOB_POLL_SECOND;"):
        OperatorSettings.from_env({"DCR_OPERATOR_JOB_POLL_SECOND": "1"})


def test_a_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"DCR_OPERATOR_RETRY_SECONDS='soon' is not a valid"):
        OperatorSettings.from_env({"DCR_OPERATOR_RETRY_SECONDS": "soon"})
    with pytest.raises(ConfigError, match="PULL_POLICY='Sometimes'"):
        OperatorSettings.from_env({"DCR_OPERATOR_ENCODER_IMAGE_PULL_POLICY": "Sometimes"})


def test_encoder_images_the_admin_allows_parse_as_exact_names_and_prefixes() -> None:
    """What the chart's encoder.allowedImages becomes (joined by commas)."""
    s = OperatorSettings.from_env({"DCR_OPERATOR_ENCODER_IMAGE": "dcr:1",
                                   "DCR_OPERATOR_ENCODER_IMAGES": "reg/dcr:*,mine:2"})
    assert [s.allows_image(i) for i in ("dcr:1", "reg/dcr:0.3", "mine:2", "mine:22",
                                        "reg/dcrx:1", "other:1")] == [
        True, True, True, False, False, False]
    assert not OperatorSettings(encoder_image="dcr:1").allows_image("")


def test_every_field_declares_its_chart_value_and_a_numbers_unit_is_in_its_name() -> None:
    for f in fields(OperatorSettings):
        assert declared(f).value, f.name
        assert f.metadata["doc"].endswith("."), f.name
        if f.type in ("int", "float"):
            assert f.name.endswith(("_seconds", "_port")), f"{f.name}: name its unit"


def test_a_value_out_of_its_declared_bounds_is_named() -> None:
    with pytest.raises(ConfigError, match=r"DCR_OPERATOR_RETRY_SECONDS=0\.0 must be > 0"):
        OperatorSettings.from_env({"DCR_OPERATOR_RETRY_SECONDS": "0"})
    with pytest.raises(ConfigError, match="DCR_OPERATOR_METRICS_PORT=65536 must be <= 65535"):
        OperatorSettings(metrics_port=65536)
    assert OperatorSettings(metrics_port=0, encoder_ttl_seconds=0).metrics_port == 0


# --- the Helm chart, held to the declarations ------------------------------------------

CHART = REPO_ROOT / "charts" / "dcr"
# `- name: DCR_OPERATOR_X` and the template expression of its value, in the Deployment.
ENV_ENTRY = re.compile(r"- name: (DCR_OPERATOR_\w+)\n\s+value: \{\{ (.+?) \}\}")
QUOTED = re.compile(r"(.+) \| quote")
VALUE = re.compile(r"\.Values\.([\w.]+)")


def _at(values: dict[str, Any], path: str) -> Any:
    for name in path.split("."):
        values = values[name]
    return values


def _operator_image(values: dict[str, Any]) -> str:
    """What the chart's "dcr.image" helper renders."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    return f"{values['image']['repository']}:{values['image']['tag'] or app_version}"


# Each form of expression the template sets a variable with: how helm renders it (before
# `| quote`) from the values its `.Values.*` paths name. A new form fails the test below
# until it is taught here.
FORMS: dict[str, Callable[[dict[str, Any], list[Any]], Any]] = {
    r"\.Values\.[\w.]+": lambda _, v: v[0],
    r'join "," \.Values\.[\w.]+': lambda _, v: ",".join(v[0]),
    r'default \(include "dcr\.image" \.\) \.Values\.[\w.]+':
        lambda values, v: v[0] or _operator_image(values),
    r"ternary \.Values\.[\w.]+ 0 \.Values\.[\w.]+": lambda _, v: v[0] if v[1] else 0,
}


def _go_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _chart_env() -> dict[str, tuple[str, str]]:
    """Variable -> (its template expression, what it renders from values.yaml)."""
    template = (CHART / "templates" / "deployment.yaml").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    out = {}
    for name, expression in ENV_ENTRY.findall(template):
        quoted = QUOTED.fullmatch(expression)
        assert quoted, f"{name}: the chart quotes every value ({expression})"
        form = next((f for f in FORMS if re.fullmatch(f, quoted[1])), None)
        assert form, f"{name}: teach this test how helm renders {quoted[1]!r}"
        paths = [_at(values, p) for p in VALUE.findall(quoted[1])]
        out[name] = (expression, _go_text(FORMS[form](values, paths)))
    assert len(out) == template.count("- name: DCR_OPERATOR_"), "an env entry did not parse"
    return out


def test_the_chart_sets_every_field_and_nothing_else_from_its_declared_value() -> None:
    env = _chart_env()
    assert sorted(env) == sorted(env_name(f) for f in fields(OperatorSettings))
    for f in fields(OperatorSettings):
        expression = env[env_name(f)][0]
        assert f".Values.{declared(f).value} " in expression, (
            f"{env_name(f)} is set from {expression}, not .Values.{declared(f).value}")


def test_the_charts_default_values_are_the_settings_defaults() -> None:
    rendered = {name: text for name, (_, text) in _chart_env().items()}
    assert OperatorSettings.from_env(rendered) == OperatorSettings()


def test_the_values_schema_is_generated_from_the_settings(tmp_path: Path) -> None:
    text = SCHEMA_PATH.read_text()
    assert render(text) == text, f"{SCHEMA_PATH} is stale: run `{ENTRY_POINT}`"
    stale = tmp_path / "values.schema.json"
    stale.write_text(text.replace("Sets DCR_OPERATOR_RETRY_SECONDS.", "Sets it."))
    assert main(["--check", "--path", str(stale)]) == 1
    assert main(["--path", str(stale)]) == 0
    assert stale.read_text() == text


def test_the_values_schema_types_bounds_and_describes_each_value_as_its_field() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    for f in fields(OperatorSettings):
        node = schema
        for name in declared(f).value.split("."):
            node = node["properties"][name]
        assert node["description"] == f"{f.metadata['doc']} Sets {env_name(f)}."
        assert node["type"] == declared(f).chart.get("type", JSON_TYPES[str(f.type)]), f.name
        assert node.get("enum", []) == list(declared(f).choices), f.name
        for keyword, limit in declared(f).bounds.items():
            assert node[keyword] == declared(f).chart.get(keyword, limit), (f.name, keyword)
