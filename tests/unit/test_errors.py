"""The error tree in ``dcr/errors.py`` (and the operator's in ``dcr_operator/errors.py``) is
true: every exception class DCR defines is a ``DcrError``, names no other class's name, and
appears in one of the two drawn trees."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import dcr
import dcr.errors
import dcr_operator
import dcr_operator.errors
from dcr.errors import DcrError


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
