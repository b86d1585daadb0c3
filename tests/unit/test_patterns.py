"""Every ``pattern`` a model declares is anchored at both ends.

pydantic (and the API server, for CRD schemas) *searches* a pattern: ``[0-9a-f]{1,64}``
accepts ``x/../../escaped/a`` because it contains an ``a``. The SGLang plugin made such a
call id part of a file name, so its answer could land outside the staging directory.
This walks every pydantic model of both packages and fails on any pattern that is not
``^...$`` (the unanchored SGLang call id and the fleet's store/relay URL patterns, which
let a newline through, failed here).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import dcr
import dcr_operator


def models() -> Iterator[type[BaseModel]]:
    for pkg in (dcr, dcr_operator):
        for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (inspect.isclass(obj) and issubclass(obj, BaseModel)
                        and obj.__module__ == module.__name__):
                    yield obj


def patterns(node: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        if isinstance(node.get("pattern"), str):
            yield where, node["pattern"]
        for k, v in node.items():
            yield from patterns(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from patterns(v, f"{where}[{i}]")


def test_every_model_pattern_is_anchored_at_both_ends() -> None:
    found = [(m.__name__, w, p) for m in models()
             for w, p in patterns(m.model_json_schema(), m.__name__)]
    assert len(found) > 20  # the walk reaches the models (attempt ids, digests, names, URLs)
    loose = [f for f in found if not (f[2].startswith("^") and f[2].endswith("$"))]
    assert loose == []


@pytest.mark.parametrize("call", ["x/../../escaped/a", "../a", "ab\n", "a" * 65, ""])
def test_an_sglang_call_id_that_is_not_hex_is_refused(call: str) -> None:
    from dcr.runtimes.sglang import SglangCall

    with pytest.raises(ValidationError):
        SglangCall(call=call, method="dcr_instance", args=[])


def test_an_sglang_answer_file_name_never_holds_a_separator() -> None:
    from dcr.runtimes.sglang import write_answer

    with pytest.raises(ValueError, match="cannot be part of a file name"):
        write_answer("x/../../escaped/a", 0, {})


@pytest.mark.parametrize("uri", ["s3://b/p\nx", "file:///a b"])
def test_a_store_uri_with_whitespace_is_refused(uri: str) -> None:
    from dcr_operator.api.rolloutfleet import StoreSpec

    with pytest.raises(ValidationError):
        StoreSpec(uri=uri)
