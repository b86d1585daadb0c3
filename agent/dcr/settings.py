"""Settings declared once: a field's default, doc, command-line option and argv in one place.

Fields of frozen, keyword-only dataclasses are declared with :func:`option`;
:func:`add_options`, :func:`from_args` and :func:`to_argv` turn them into ``argparse``
options, back into settings, and into flags. Types understood: ``int``, ``float``, ``str``,
``Path``, ``bool`` (``--flag``/``--no-flag``), ``Literal[...]``, ``tuple[str, ...]``
(repeatable) and ``X | None`` of those. Dataclasses, not pydantic: settings are built in
process far more often than parsed.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin

MiB = 1 << 20
GiB = 1 << 30

T = TypeVar("T")

_UNITS = {MiB: "mib", GiB: "gib"}


def option(default: Any = dataclasses.MISSING, *, doc: str, unit: int = 1,
           flag: str | None = None, metavar: str | None = None, cli: bool = True) -> Any:
    """A settings field: ``doc`` says what it is, in which unit, and why the default.

    ``unit`` (``MiB`` or ``GiB``) makes a ``*_bytes`` field speak that unit on the command
    line; ``flag`` overrides the derived option name; ``cli=False`` keeps a documented
    field off the command line.
    """
    meta = {"doc": doc, "unit": unit, "flag": flag, "metavar": metavar, "cli": cli}
    return dataclasses.field(default=default, metadata=meta)


def doc(cls: type, name: str) -> str:
    """The doc of field ``name`` of settings class ``cls``."""
    return str({f.name: f for f in dataclasses.fields(cls)}[name].metadata["doc"])


@dataclasses.dataclass(frozen=True)
class _Opt:
    field: dataclasses.Field[Any]
    flag: str
    kind: Any  # the field's type with ``| None`` removed
    optional: bool
    unit: int

    @property
    def dest(self) -> str:
        return self.field.name

    def to_cli(self, value: Any) -> Any:
        return value // self.unit if self.unit != 1 and value is not None else value

    def from_cli(self, value: Any) -> Any:
        return value * self.unit if self.unit != 1 and value is not None else value


def _options(cls: type) -> list[_Opt]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "doc" not in f.metadata or not f.metadata["cli"]:
            continue
        kind, optional = hints[f.name], False
        if get_origin(kind) in (types.UnionType, typing.Union):
            args = [a for a in get_args(kind) if a is not type(None)]
            kind, optional = args[0], len(args) < len(get_args(kind))
        unit = int(f.metadata["unit"])
        name = f.name
        if unit != 1:
            if not name.endswith("_bytes"):
                raise TypeError(f"{cls.__name__}.{name}: a unit needs a *_bytes field.")
            name = name.removesuffix("_bytes") + "_" + _UNITS[unit]
        flag = f.metadata["flag"] or "--" + name.replace("_", "-")
        out.append(_Opt(field=f, flag=flag, kind=kind, optional=optional, unit=unit))
    return out


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                skip: tuple[str, ...] = (), required: tuple[str, ...] = ()) -> None:
    """Add an option per documented field of ``cls``, but those in ``skip``.

    A field without a default is a required option, as is one named in ``required``.
    """
    for o in _options(cls):
        if o.dest in skip:
            continue
        default = _default(o.field)
        must = default is dataclasses.MISSING or o.dest in required
        help_ = str(o.field.metadata["doc"])
        if default not in (dataclasses.MISSING, None, (), False) and not must:
            help_ += f" (default {o.to_cli(default)})"
        kw: dict[str, Any] = {"dest": o.dest, "help": help_}
        if o.kind is bool:
            parser.add_argument(o.flag, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, **kw)
            continue
        if get_origin(o.kind) is Literal:
            kw["choices"] = list(get_args(o.kind))
        elif get_origin(o.kind) is tuple:
            kw["action"] = "append"
            kw["type"] = get_args(o.kind)[0]
        else:
            kw["type"] = o.kind
        if o.field.metadata["metavar"] or o.unit != 1:
            kw["metavar"] = o.field.metadata["metavar"] or _UNITS[o.unit].upper()
        parser.add_argument(o.flag, required=must, default=argparse.SUPPRESS, **kw)


def from_args(cls: type[T], ns: argparse.Namespace, **given: Any) -> T:
    """Settings ``cls`` from parsed options (absent ones keep their defaults) and ``given``."""
    values = dict(given)
    for o in _options(cls):
        if o.dest in values or not hasattr(ns, o.dest):
            continue
        value = getattr(ns, o.dest)
        if get_origin(o.kind) is tuple:
            value = tuple(value)
        values[o.dest] = o.from_cli(value)
    return cls(**values)


def to_argv(settings: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild ``settings`` through :func:`add_options` and :func:`from_args`.

    Every command-line field is written, defaults included, so the argv means the same to
    a receiving process whose defaults changed.
    """
    argv: list[str] = []
    for o in _options(type(settings)):
        if o.dest in skip:
            continue
        value = getattr(settings, o.dest)
        if o.kind is bool:
            argv.append(o.flag if value else "--no-" + o.flag.removeprefix("--"))
        elif value is None:
            continue
        elif get_origin(o.kind) is tuple:
            for v in value:
                argv += [o.flag, str(v)]
        else:
            if o.unit != 1 and value % o.unit:
                raise ValueError(f"{o.dest}={value} is not a whole number of {o.flag} units.")
            argv += [o.flag, str(o.to_cli(value))]
    return argv


JITTER = 0.25  # a wait is drawn from [1 - JITTER, 1] of its step: waiting parties spread out


def backoff_s(first_s: float, max_s: float, step: int, draw: float) -> float:
    """The wait before try ``step`` + 1 (0: the first wait): ``first_s`` doubled per step up
    to ``max_s``, jittered down by ``draw`` (in [0, 1)) times :data:`JITTER` of it."""
    return min(max_s, first_s * 2.0 ** min(step, 60)) * (1.0 - JITTER * draw)


__all__ = ["JITTER", "GiB", "MiB", "add_options", "backoff_s", "doc", "from_args", "option",
           "to_argv"]
