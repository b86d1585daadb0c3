"""The error tree in ``dcr/errors.py`` (and the operator's in ``dcr_operator/errors.py``) is
true: every exception class DCR defines is a ``DcrError``, names no other class's name,
appears in one of the two drawn trees and sits under exactly one group; a refusal carries
its status, and every server answers it (and each error it maps) with the status drawn."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import dcr
import dcr.errors
import dcr_operator
import dcr_operator.errors
from dcr.drivers.errors import EngineError
from dcr.errors import (
    GROUPS,
    Busy,
    CheckpointError,
    ConfigError,
    DcrError,
    Invalid,
    Refused,
    StateConflict,
    StoreError,
    TryLater,
)
from dcr.http.edge import Statuses
from dcr.owner import server as owner_server
from dcr.owner.server import BadPublish, PublishConflict, Stopped
from dcr.protocol.agent_api import BadRequest
from dcr.protocol.state import IllegalTransition
from dcr.receiver import member, server
from dcr.receiver.attempt import AttemptFailed
from dcr.receiver.fromstore import NotVouched
from dcr.receiver.member import MemberConflict
from dcr.receiver.service import AgentConflict
from dcr.serve import server as serve_server
from dcr.serve.completions import BadCompletion
from dcr.serve.gate import Paused
from dcr.serve.server import ServeRefused, Unavailable
from dcr.serve.workers import UnknownMethod
from dcr.transport.relay import node
from dcr.transport.relay.wire import RelayRefused


def _modules() -> list[str]:
    names = []
    for pkg in (dcr, dcr_operator):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not info.name.endswith("__main__"):
                names.append(info.name)
    return names


def _defined_exceptions() -> list[type[BaseException]]:
    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
    return found


def test_every_error_dcr_defines_is_a_dcr_error() -> None:
    outside = [f"{c.__module__}.{c.__qualname__}" for c in _defined_exceptions()
               if not issubclass(c, DcrError)]
    assert not outside, f"exceptions outside the DcrError tree: {outside}"


def test_no_two_error_classes_share_a_name() -> None:
    by_name: dict[str, list[str]] = {}
    for c in _defined_exceptions():
        by_name.setdefault(c.__name__, []).append(c.__module__)
    shared = {n: m for n, m in by_name.items() if len(m) > 1}
    assert not shared, f"error classes of one name in several modules: {shared}"


def test_the_drawn_trees_name_every_public_error() -> None:
    drawn = (dcr.errors.__doc__ or "") + (dcr_operator.errors.__doc__ or "")
    missing = [f"{c.__module__}.{c.__name__}" for c in _defined_exceptions()
               if not c.__name__.startswith("_") and f" {c.__name__} " not in drawn
               and f" {c.__name__}\n" not in drawn]
    assert not missing, f"errors missing from the tree in errors.py: {missing}"


def _dcr_errors() -> list[type[DcrError]]:
    return [c for c in _defined_exceptions()
            if issubclass(c, DcrError) and c.__module__.startswith("dcr.")]


def test_every_dcr_error_sits_under_exactly_one_group() -> None:
    """``except`` a group means one thing: what the caller does about it."""
    loose = {f"{c.__module__}.{c.__name__}": [g.__name__ for g in GROUPS if issubclass(c, g)]
             for c in _dcr_errors() if c is not DcrError and c not in GROUPS}
    wrong = {name: groups for name, groups in loose.items() if len(groups) != 1}
    assert not wrong, f"errors under no group or under several: {wrong}"


def test_every_refusal_carries_the_status_of_its_kind() -> None:
    kinds = {Invalid: 400, StateConflict: 409, TryLater: 503}
    for c in _dcr_errors():
        if issubclass(c, Refused):
            want = next((s for k, s in kinds.items() if issubclass(c, k)), None)
            assert c.status == (want or c.status), c
            assert 400 <= c.status < 600, c


def _raised(cls: type[BaseException]) -> BaseException:
    return RelayRefused(418, "a sentence") if cls is RelayRefused else cls("a sentence")


# What each server answers for what its handlers raise; None: not answered (aiohttp's 500).
ANSWERS: dict[str, tuple[Statuses, dict[type[BaseException], int | None]]] = {
    "agent": (server.STATUS, {
        BadRequest: 400, AgentConflict: 409, IllegalTransition: 409, AttemptFailed: 422,
        EngineError: 503, Busy: 503, StoreError: 500, RuntimeError: 500}),
    "encoder": (owner_server.STATUS, {
        BadPublish: 400, CheckpointError: 400, ConfigError: 400,
        dcr.errors.BaselineError: 409, PublishConflict: 409, Stopped: 409, Busy: 503,
        StoreError: 500, RuntimeError: 500}),
    "member": (member.STATUS, {
        BadRequest: 400, MemberConflict: 409, NotVouched: 409, StoreError: 409,
        RuntimeError: 500}),
    "serve": (serve_server.STATUS, {
        ServeRefused: 400, BadCompletion: 400, UnknownMethod: 400, ConfigError: 400,
        ValueError: 400, Unavailable: 503, Paused: 503, NotImplementedError: 501,
        TimeoutError: 500}),
    "relay": (node.STATUS, {RelayRefused: 418, RuntimeError: None}),
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_server_answers_each_error_with_the_status_drawn(name: str) -> None:
    statuses, answers = ANSWERS[name]
    got = {cls: statuses.status(_raised(cls)) for cls in answers}
    assert got == answers


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_every_server_answers_a_refusal_with_the_status_on_its_class(name: str) -> None:
    statuses, _ = ANSWERS[name]
    for c in _dcr_errors():
        if issubclass(c, Refused) and c is not RelayRefused:
            assert statuses.status(c("a sentence")) == c.status, (name, c)
