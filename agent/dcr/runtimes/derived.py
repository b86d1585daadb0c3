"""Layers a vLLM engine computes from a form it derived after loading.

After loading, vLLM runs each layer's ``quant_method.process_weights_after_loading``, which
may replace what the layer computes with: on CPU it packs every linear weight for oneDNN
and leaves the parameter empty; online FP8 quantizes the weight into a new parameter;
other methods repack or transpose. A write into the loaded parameter then changes nothing
the engine computes with, and a fingerprint of it proves nothing.

:class:`DerivedLayers` finds those layers when DCR attaches to a model, by comparing every
layer's tensors with the metadata vLLM records of them as created (the loading form its
loaders write; ``model_loader/reload``), and handles two kinds:

- **kept**: the loading form is gone (a tensor emptied, reshaped, re-typed or re-strided).
  DCR keeps a copy of it, and the loader writes that copy: DCR's loads run with the copy
  put in the layer's place. The copy holds known bits only after a dense load through DCR
  (:meth:`DerivedLayers.fill`); until then :attr:`unfilled` names the layers.
- **refreshed**: the loading form is intact but the layer computes from a copy of its own
  (CPU's ``cpu_linear``), so writes land in place as usual.

After DCR writes into a layer of either kind, :meth:`DerivedLayers.rebuild` runs the
layer's own post-load step again (on a copy of the kept form, since the step may consume
what it is given) and carries the result into the tensors the engine computes with, in
their storage, as vLLM's own layerwise reload does (captured graphs keep pointing there).
A layer whose quantization method processes its weights in place, leaving nothing to tell
the loaded form from the compute form, is refused by :meth:`DerivedLayers.refuse`.
docs/derived-weights.md, "Weights an engine derives after loading".
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dcr.apply.intercept import LoaderPathError

COMPUTE_FORMS = ("cpu_linear",)  # attributes through which a layer computes from its own copy
MAX_NAMED = 3  # layers a sentence names


@dataclass(eq=False)
class DerivedLayer:
    """One layer whose compute form is derived from its loaded tensors."""

    name: str  # the module's path in the model
    layer: torch.nn.Module
    kind: Literal["kept", "refreshed"]
    why: str  # what prewarm saw, for sentences and the prewarm answer
    kept: dict[str, torch.nn.Parameter] = field(default_factory=dict)  # kind "kept" only
    filled: bool = False  # the kept copy holds loaded bits ("refreshed": always)

    def tensor_names(self) -> list[str]:
        """The model-level names of the tensors DCR's view holds for this layer."""
        prefix = f"{self.name}." if self.name else ""
        return [prefix + p for p in self.kept]


def _reload_metadata() -> Any:
    """vLLM's record of every layer's tensors as created, or None where this vLLM has
    none (then no layer can be told apart from its loading form)."""
    try:
        return importlib.import_module("vllm.model_executor.model_loader.reload.layerwise")
    except ImportError:
        return None


def _unwrapped_loader(loader: Any) -> Any:
    """A weight loader without vLLM's layerwise wrappers (online quantization wraps the
    loaders it made the layer with, to process a layer once it is whole)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _materialize(meta: torch.Tensor, layer: torch.nn.Module,
                 device: torch.device) -> torch.nn.Parameter:
    """A zeroed tensor of ``meta``'s shape, stride, dtype, class and attributes (its weight
    loader bound to ``layer`` again), on ``device``."""
    sanitize = importlib.import_module("vllm.model_executor.model_loader.reload.sanitize")
    data = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype,
                               device=device).zero_()
    out = torch.nn.Parameter(data, requires_grad=False)
    out.__class__ = meta.__class__  # type: ignore[assignment]  # vLLM's parameter classes
    out.__dict__ = meta.__dict__.copy()
    sanitize.restore_layer_refs(out, layer)
    for key in ("weight_loader", "_weight_loader"):
        if key in out.__dict__:
            out.__dict__[key] = _unwrapped_loader(out.__dict__[key])
    return out


def _clone(kept: torch.nn.Parameter) -> torch.nn.Parameter:
    """A copy of a kept tensor with its class and attributes, for the post-load step."""
    out = torch.nn.Parameter(kept.detach().clone(), requires_grad=False)
    out.__class__ = kept.__class__
    out.__dict__ = kept.__dict__.copy()
    return out


def _differs(now: torch.Tensor | None, meta: torch.Tensor) -> str | None:
    """How a layer's tensor differs from its record as created, or None."""
    if now is None:
        return "was removed"
    if now.numel() == 0 and meta.numel() > 0:
        return f"was emptied (created {tuple(meta.shape)})"
    if tuple(now.shape) != tuple(meta.shape):
        return f"is {tuple(now.shape)}, created {tuple(meta.shape)}"
    if now.dtype != meta.dtype:
        return f"is {now.dtype}, created {meta.dtype}"
    if now.stride() != meta.stride():
        return f"has strides {now.stride()}, created {meta.stride()}"
    return None


class DerivedLayers:
    """Every layer of ``model`` whose compute form vLLM derived after loading, with the
    kept copies (on the model's device) and the rebuild. Empty for a model vLLM did not
    record, or that is no torch module."""

    def __init__(self, model: object) -> None:
        self.layers: list[DerivedLayer] = []
        self.in_place: list[tuple[str, str]] = []  # (layer, quant method): see refuse()
        self.rebuild_s = 0.0  # seconds in post-load steps, since the last take_seconds()
        meta = _reload_metadata()
        if meta is None or not isinstance(model, torch.nn.Module):
            return
        device = next(model.parameters(), torch.empty(0)).device
        info_of = meta.LAYERWISE_INFO
        for name, layer in model.named_modules():
            method = getattr(layer, "quant_method", None)
            info = info_of.get(layer)
            if method is None or info is None:
                continue
            created: dict[str, torch.Tensor] = info.restore_metadata[0]
            changes = {p: why for p, m in created.items()
                       if (why := _differs(layer._parameters.get(p), m)) is not None}
            if changes:
                kept = {p: _materialize(m, layer, device) for p, m in created.items()}
                p, why = next(iter(changes.items()))
                self.layers.append(DerivedLayer(
                    name=name, layer=layer, kind="kept", kept=kept,
                    why=f"its {p} {why} by {type(method).__name__} after loading"))
            elif any(hasattr(layer, a) for a in COMPUTE_FORMS):
                form = next(a for a in COMPUTE_FORMS if hasattr(layer, a))
                self.layers.append(DerivedLayer(
                    name=name, layer=layer, kind="refreshed", filled=True,
                    why=f"computes through {form}, a copy {type(method).__name__} made "
                        "after loading"))
            elif not type(method).__name__.startswith("Unquantized"):
                self.in_place.append((name, type(method).__name__))

    # --- the view DCR loads through ----------------------------------------------------

    def named_tensors(self, named: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """``named`` (the model's tensors) with every kept layer's loading form in place
        of what the engine left there."""
        replaced = {n: t for d in self.layers for n, t in zip(d.tensor_names(),
                                                               d.kept.values(), strict=True)}
        for name, t in named:
            if name not in replaced:
                yield name, t
        yield from replaced.items()

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """The kept copies registered in their layers, so the model's loaders write them;
        what the engine left there is put back afterwards, whatever happens."""
        held: list[tuple[torch.nn.Module, str, torch.nn.Parameter | None]] = []
        try:
            for d in self.layers:
                for p, kept in d.kept.items():
                    held.append((d.layer, p, d.layer._parameters.get(p)))
                    d.layer._parameters[p] = kept
            yield
        finally:
            for layer, p, live in reversed(held):
                if live is None:
                    layer._parameters.pop(p, None)
                else:
                    layer._parameters[p] = live

    # --- state -------------------------------------------------------------------------

    @property
    def unfilled(self) -> list[DerivedLayer]:
        """Kept layers whose copy holds no loaded bits yet (none before a dense load)."""
        return [d for d in self.layers if not d.filled]

    def refuse(self, written: Iterable[str], rank: int) -> None:
        """Raise if any layer among ``written`` (module names DCR's plans write) processes
        its weights in place after loading: nothing there tells the loaded form from the
        compute form, so no rebuild can be trusted."""
        written = set(written)
        hit = sorted((n, m) for n, m in self.in_place if n in written)
        if hit:
            names = ", ".join(n for n, _ in hit[:MAX_NAMED])
            raise LoaderPathError(
                f"Rank {rank}: {len(hit)} layers DCR would write ({names}) use "
                f"quantization method {hit[0][1]}, which processes their weights after "
                "loading in place, leaving no loaded form DCR can keep or rebuild from; "
                "this engine can only be refit densely (dcr_load_dense), not in place.")

    def check_filled(self, call: str, rank: int) -> None:
        """Raise unless every kept copy holds loaded bits."""
        missing = self.unfilled
        if missing:
            raise LoaderPathError(
                f"Rank {rank}: dcr_{call} refused: {len(missing)} layers "
                f"({', '.join(d.name for d in missing[:MAX_NAMED])}) compute from a form the "
                f"engine derived after loading ({missing[0].why}), and DCR keeps their "
                "loading form only from a dense load through it (dcr_load_dense), which "
                "has not happened since this model was loaded.")

    def describe(self) -> list[dict[str, str]]:
        """For the prewarm answer: each derived layer, its kind and why."""
        return [{"layer": d.name, "kind": d.kind, "why": d.why,
                 "state": "filled" if d.filled else "unfilled"} for d in self.layers]

    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.layers for t in d.kept.values())

    # --- the rebuild -------------------------------------------------------------------

    def of_tensors(self, names: Iterable[str]) -> list[DerivedLayer]:
        """The derived layers holding any of ``names`` (model-level tensor names)."""
        wanted = set(names)
        return [d for d in self.layers
                if any(n.rpartition(".")[0] == d.name for n in wanted)]

    def fill(self) -> None:
        """A dense load has written every kept copy: rebuild every layer from it."""
        self.rebuild(self.layers)
        for d in self.layers:
            d.filled = True

    def rebuild(self, layers: Iterable[DerivedLayer]) -> None:
        t0 = time.perf_counter()
        for d in layers:
            self._rebuild(d)
        self.rebuild_s += time.perf_counter() - t0

    def take_seconds(self) -> float:
        out, self.rebuild_s = self.rebuild_s, 0.0
        return out

    @staticmethod
    def _rebuild(d: DerivedLayer) -> None:
        layer = d.layer
        live_params = dict(layer._parameters)
        live_buffers = dict(layer._buffers)
        for p, kept in d.kept.items():  # the step may consume or rewrite what it is given
            layer._parameters[p] = _clone(kept)
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        method: Any = layer.quant_method
        try:
            method.process_weights_after_loading(layer)
        except Exception:
            layer._parameters.update(live_params)  # serve on what it had
            layer._buffers.update(live_buffers)
            raise
        tables: list[tuple[dict[str, Any], dict[str, Any]]] = [
            (layer._parameters, live_params), (layer._buffers, live_buffers)]
        for table, live in tables:
            for p, old in live.items():
                new = table.get(p)
                if new is None or new is old or old is None:
                    continue
                if new.shape != old.shape or new.dtype != old.dtype:
                    raise LoaderPathError(
                        f"Layer {d.name}: rebuilding its compute form made {p} "
                        f"{tuple(new.shape)} {new.dtype}, not {tuple(old.shape)} {old.dtype} "
                        "as at load; its storage cannot be kept.")
                old.data.copy_(new.data)  # into the storage the engine computes with
                table[p] = old
