"""The state words of dcr.protocol.states: the CRDs' text names exactly them, and the
agent and the operator write no others."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from dcr.protocol.states import (
    REFIT_RECEIVER_STATES,
    AttemptOutcome,
    AttemptState,
    Phase,
    ReceiverStep,
)
from dcr_operator.api.generate import crd_manifests
from dcr_operator.progress import STEPS
from dcr_operator.reconcile import OUTCOMES, phase_of

_LIST = re.compile(r"\bone of ([\w<>]+(?:, [\w<>]+)*)")

# Each status field that holds a state, and the words the code defines for it.
FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("dcr.dev_rolloutfleets.yaml", "status.receivers[].state"):
        tuple(s.value for s in AttemptState),
    ("dcr.dev_weightrefits.yaml", "status.receivers[].state"): REFIT_RECEIVER_STATES,
    ("dcr.dev_weightrefits.yaml", "status.phase"): tuple(Phase),
    ("dcr.dev_weightrefits.yaml", "status.attempts[].outcome"): tuple(AttemptOutcome),
}


def _schema(name: str) -> dict[str, Any]:
    crd = crd_manifests()[name]
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _field(schema: dict[str, Any], path: str) -> dict[str, Any]:
    node = schema
    for part in path.split("."):
        node = node["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            node = node["items"]
    return node


def _named(description: str) -> list[str]:
    """The states a description lists (``api.common.one_of``)."""
    return [w for m in _LIST.finditer(description) for w in m.group(1).split(", ")]


def _descriptions(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, str]]:
    if "description" in node:
        yield path, node["description"]
    for name, sub in node.get("properties", {}).items():
        yield from _descriptions(sub, f"{path}.{name}".lstrip("."))
    if "items" in node:
        yield from _descriptions(node["items"], f"{path}[]")


@pytest.mark.parametrize(("crd", "path"), sorted(FIELDS), ids=lambda v: str(v))
def test_a_state_field_names_exactly_the_states_the_code_defines(crd: str, path: str) -> None:
    node = _field(_schema(crd), path)
    assert _named(node["description"]) == list(FIELDS[crd, path])
    if "enum" in node:
        assert node["enum"] == list(FIELDS[crd, path])


@pytest.mark.parametrize("crd", sorted(crd_manifests()))
def test_no_description_lists_a_state_no_code_defines(crd: str) -> None:
    """Where a description lists states, each is one of the field's own words; a list
    elsewhere would be prose the constants do not hold."""
    defined = {path: set(words) for (name, path), words in FIELDS.items() if name == crd}
    for path, text in _descriptions(_schema(crd)):
        named = _named(text)
        if named:
            assert path in defined, f"{crd} {path} lists states {named} outside a state field"
            assert set(named) <= defined[path], (crd, path, set(named) - defined[path])


def test_the_refit_phase_printer_column_lists_the_phases() -> None:
    version = crd_manifests()["dcr.dev_weightrefits.yaml"]["spec"]["versions"][0]
    column = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Phase")
    assert _named(column["description"]) == list(Phase)


def test_the_operator_writes_only_defined_receiver_states() -> None:
    written = {s.after["state"] for s in STEPS.values() if "state" in s.after}
    written |= {s.before["state"] for s in STEPS.values() if "state" in s.before}
    written.add(AttemptState.FLUSHED.value)  # Recorder.flushed
    assert written <= set(REFIT_RECEIVER_STATES)
    assert set(REFIT_RECEIVER_STATES) <= written
    assert ReceiverStep.failed("flush") == "flush failed"


def test_attempt_outcomes_and_phases_come_from_the_constants() -> None:
    assert set(OUTCOMES.values()) | {AttemptOutcome.ABANDONED} == set(AttemptOutcome)
    assert phase_of([]) is Phase.PENDING
    committed = [{"type": "Committed", "status": "True"}]
    assert phase_of(committed) is Phase.COMMITTED
