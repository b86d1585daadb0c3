"""Catching the loader's writes into parameter storage.

A ``TorchDispatchMode`` hands every ``copy_`` and constant ``fill_`` into a registered
storage to a handler instead of running it; any other op writing one fails the apply. It
also notes the registered storages an op reads (:attr:`WriteInterceptor.reads`): writes are
deferred only for a loader that reads none (docs/apply.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr.errors import AttemptError

aten = torch.ops.aten


class LoaderPathError(AttemptError):
    """The runtime's loader wrote parameter storage in a way DCR cannot honour exactly."""


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


# (storage name, dst, src); src is None for a constant fill, replayed by calling ``fill``
Handler = Callable[[str, torch.Tensor, torch.Tensor | None, Callable[[], Any]], None]


class WriteInterceptor(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Routes ``copy_`` into registered storages to ``handler``; refuses other writes."""

    def __init__(self, storages: Mapping[tuple[str, int], str], handler: Handler) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages = storages
        self.handler = handler
        self.reads: set[str] = set()  # registered storages whose data an op read

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is aten.copy_.default or func is aten.fill_.Scalar:
            dst = args[0]
            name = self.storages.get(storage_key(dst))
            if name is not None:
                src = args[1] if func is aten.copy_.default else None
                self.handler(name, dst, src, lambda: func(*args, **kwargs))
                return dst
        written, read = self._registered_args(func, args, kwargs)
        if written is not None:
            raise LoaderPathError(
                f"The loader writes parameter storage {written!r} with {func}; only copy_ "
                "into parameter views can be applied in place."
            )
        if read is not None:
            self.reads.add(read)
        return func(*args, **kwargs)

    def _registered_args(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str | None, str | None]:
        """The first registered storage among the op's written arguments, and among the
        ones it only reads (a view op reads no data)."""
        written: str | None = None
        read: str | None = None
        is_view, spec = _spec(func)
        for i, arg_name, is_write in spec:
            value = args[i] if i < len(args) else kwargs.get(arg_name)
            tensors = value if isinstance(value, list | tuple) else (value,)
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    name = self.storages.get(storage_key(t))
                    if name is None:
                        continue
                    if is_write:
                        written = written or name
                    elif not is_view:
                        read = read or name
        return written, read


# op -> (is a view op, per argument: index, name, whether the op writes it); the schema's
# argument list is rebuilt on every access, and the loader runs the same few ops
_SPECS: dict[Any, tuple[bool, tuple[tuple[int, str, bool], ...]]] = {}


def _spec(func: Any) -> tuple[bool, tuple[tuple[int, str, bool], ...]]:
    spec = _SPECS.get(func)
    if spec is None:
        spec = (bool(func.is_view), tuple(
            (i, a.name, a.alias_info is not None and a.alias_info.is_write)
            for i, a in enumerate(func._schema.arguments)))
        _SPECS[func] = spec
    return spec
