"""The engine plugin's one table: the docstring, both ends and every list of methods follow it.

The agent's drivers, the rank that answers (``EngineRank``), vLLM's worker extension,
SGLang's loader and ``dcr serve``'s workers each reach the plugin's calls; every one of
them is held here to :class:`~dcr.protocol.engine_api.EngineApi`.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import threading
import typing
from collections.abc import Callable

import pytest
import torch
from pydantic import ValidationError

import dcr.protocol.engine_api as api
from dcr.apply.applier import ApplyReport
from dcr.drivers.plugin import EngineTimeouts, PluginDriver
from dcr.errors import ConfigError
from dcr.protocol.engine_api import METHODS, ApplyAnswer, EngineApi
from dcr.runtimes.rank import EngineRank
from dcr.runtimes.sglang import SglangCall
from dcr.runtimes.vllm import DcrWorkerExtension
from dcr.serve.workers import UnknownMethod, Workers, make_worker


def test_the_module_docstring_lists_the_table() -> None:
    assert api.__doc__ is not None
    assert textwrap.indent(EngineApi.describe(), "    ") in api.__doc__


def test_every_row_is_a_dcr_method_named_once() -> None:
    assert tuple(f"dcr_{c.name}" for c in EngineApi.calls()) == METHODS
    assert len(set(METHODS)) == len(METHODS) == 7


def test_every_rows_timeout_is_an_engine_timeouts_field() -> None:
    fields = {f.name for f in dataclasses.fields(EngineTimeouts)}
    waits = set(typing.get_args(api.Wait))
    assert {c.wait for c in EngineApi.calls()} <= waits <= fields
    t = EngineTimeouts()
    assert [t.of(c.wait) for c in EngineApi.calls()] == [
        t.call_s, t.prewarm_s, t.apply_s, t.call_s, t.dense_s, t.prewarm_s, t.call_s]


def takes(f: Callable[..., object]) -> int:
    """How many arguments ``f`` takes besides ``self``."""
    return len([p for p in inspect.signature(f).parameters.values() if p.name != "self"])


def test_the_vllm_worker_extension_has_exactly_the_tables_methods() -> None:
    methods = {n for n in vars(DcrWorkerExtension) if n.startswith("dcr_")}
    assert methods == set(METHODS)
    for c in EngineApi.calls():
        assert takes(getattr(DcrWorkerExtension, c.method)) == int(c.request is not None), c


def test_the_rank_answers_every_row_with_a_method_of_its_name() -> None:
    for c in EngineApi.calls():
        run = getattr(EngineRank, c.name)
        hints = typing.get_type_hints(run)
        assert hints["return"] is c.answer, c
        assert takes(run) == int(c.request is not None), c
        if c.request is not None:
            assert hints["req"] is c.request, c


def test_the_driver_makes_every_row_as_a_method_of_its_name() -> None:
    assert all(callable(getattr(PluginDriver, c.name, None)) for c in EngineApi.calls())


def test_sglangs_loader_dispatches_exactly_the_tables_methods() -> None:
    for method in METHODS:
        assert SglangCall(call="a1", method=method, args=[]).method == method
    for method in ("__init__", "dcr_serve", "instance", "dcr_pause"):
        with pytest.raises(ValidationError, match="not one of the plugin's methods"):
            SglangCall(call="a1", method=method, args=[])


def test_the_serve_workers_run_exactly_the_tables_methods() -> None:
    model = torch.nn.Linear(2, 2)
    worker = make_worker(model, rank=0, world=1)
    workers = Workers([worker], threading.Lock())
    assert {n for n in dir(type(worker)) if n.startswith("dcr_")} == set(METHODS)
    assert workers.call("dcr_instance", [], {})[0]["rank"] == 0
    for method in ("_dcr_rank", "dcr_serve", "load_weights"):
        with pytest.raises(UnknownMethod, match="not one of DCR's plugin methods"):
            workers.call(method, [], {})


def test_an_apply_answer_declares_every_field_of_the_apply_report() -> None:
    report = {f.name for f in dataclasses.fields(ApplyReport)}
    assert report <= set(ApplyAnswer.model_fields)


def test_a_request_is_parsed_from_json_or_a_dict_and_a_bad_field_is_named() -> None:
    row = EngineApi.apply
    assert row.parse('{"payloads":["p.dcrp"]}') == row.parse({"payloads": ["p.dcrp"]})
    with pytest.raises(ConfigError, match=r"^ApplyRequest: .*payloads"):
        row.parse({"payloads": []})
    with pytest.raises(ConfigError, match="dcr_sync takes no request"):
        EngineApi.sync.parse("{}")
