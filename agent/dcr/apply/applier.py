"""The applier: decoded items -> scratch -> the runtime's own loader -> storage.

:class:`Applier` applies a set of payloads in place through the runtime's native loader,
touching only changed elements. Nothing is written before every item is checked against the
canonical tensors, and an apply whose writes differ from prewarm's fails. Why, and the
numbers: docs/apply.md, "How a set of payloads is applied".
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
import torch

from dcr.apply import xxh3
from dcr.apply.expand import CompactRecords, Uploader, scatter
from dcr.apply.geometry import (
    View,
    is_rowmajor,
    locate,
    storage_index,
)
from dcr.apply.intercept import LoaderPathError, WriteInterceptor, storage_key
from dcr.apply.plan import (
    FLOATS,
    CanonicalTensor,
    CopySig,
    TensorPlan,
    check_overlaps,
    classify,
    covers,
    held_spans,
    signature,
)
from dcr.apply.sums import span_sum_torch
from dcr.checkpoint import fingerprint
from dcr.codec import _native  # type: ignore[attr-defined]
from dcr.codec.decode import DecodedItem, decode
from dcr.codec.sums import MASK64, span_sum
from dcr.errors import AttemptError, MalformedPayload, TargetMismatch
from dcr.format.dtypes import DTYPES
from dcr.format.payload import (
    DEFAULT_LIMITS,
    DecodeLimits,
    ItemHeader,
    Payload,
    check_disjoint,
    check_limits,
    read_payload,
)
from dcr.format.profile import ReceiverProfile
from dcr.format.regions import Span, region_key, sum_text, whole

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}
BITS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Loader(Protocol):
    """What the engine needs of a serving runtime: its native loader and its tensors."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The runtime's own loader. Returns the names of the tensors it wrote."""
        ...

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter and persistent buffer, tied ones under each of their names."""
        ...


class DuplicatePayload(AttemptError):
    """A payload id was applied before: applying XOR masks twice restores the old bits."""


class PayloadConflict(AttemptError):
    """A payload id was applied before with different bytes."""


@dataclass(kw_only=True)
class ApplyReport:
    tensors: int = 0
    records: int = 0
    writes: int = 0
    loads: int = 0  # load_weights calls
    deferred: int = 0  # tensors applied through the one deferred call
    decode_s: float = 0.0  # verify, check, decompress and validate the payloads
    upload_s: float = 0.0  # pack the compact records and start their copies (device path)
    upload_bytes: int = 0  # what those copies carry to the device
    expand_s: float = 0.0  # records to positions on the device (within scatter_s); on CUDA
    # the device's own time between events, read after the set's one synchronization
    scatter_s: float = 0.0  # positions; staging scratch; the deferred writes into storage
    loader_s: float = 0.0  # the runtime's own loader, less the time in DCR's hook
    intercept_s: float = 0.0  # DCR's hook in loader calls (on the staged path, its writes)
    classes: dict[str, int] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)  # the canonical tensors written


@dataclass(kw_only=True)
class _Records:
    """One tensor's decoded records: ascending flat positions and their bits (a signed
    integer view of the element width). Expanded on the host by the codec's C kernel
    (``host`` holds them as numpy, moved to the engine's device once a path needs them
    there), or on the device from the compact records (``expand.py``)."""

    positions: torch.Tensor
    values: torch.Tensor
    host: tuple[npt.NDArray[np.int64], npt.NDArray[Any]] | None = None

    @classmethod
    def expanded_on_host(cls, group: list[DecodedItem], device: torch.device) -> _Records:
        count = sum(it.header.count for it in group)
        positions = np.empty(count, dtype=np.int64)
        lo = 0
        for it in group:  # sorted by start, disjoint: positions ascend
            it.positions(positions[lo : lo + it.header.count])
            lo += it.header.count
        values = group[0].values if len(group) == 1 else np.concatenate([i.values for i in group])
        if values.itemsize > 1:  # torch has no unsigned 16/32/64-bit arithmetic: signed view
            values = values.view(np.dtype(f"<i{values.itemsize}"))
        return cls(positions=torch.from_numpy(positions).to(device),
                   values=torch.from_numpy(values).to(device), host=(positions, values))

    @classmethod
    def expanded_on_device(cls, compact: CompactRecords) -> _Records:
        positions, values = compact.expand()
        return cls(positions=positions, values=values)

    def __len__(self) -> int:
        return self.positions.numel()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view over the whole storage of ``t`` (same element width)."""
    return torch.empty(0, dtype=BITS[t.element_size()], device=t.device).set_(
        t.untyped_storage()
    )


class Applier:
    """Applies payloads to one runtime (one rank) in place."""

    def __init__(self, runtime: Loader, *, device: str | torch.device = "cpu",
                 verify: bool = False, defer: bool = True,
                 expand: Literal["host", "device"] | None = None,
                 pack: bool | None = None) -> None:
        """``verify`` reads every mapped write back. ``defer`` (the default) applies the
        deferrable tensors of a set through one loader call and writes once that call has
        been checked; ``False`` stages and loads every tensor one call each, as tensors
        on converting and dense paths always are (slower: to compare, or to watch a
        loader tensor by tensor). ``expand`` says where records become positions: on the
        ``host`` by the codec's C kernel, or on the ``device`` with torch operations from
        the compact records (``expand.py``); by default the device on CUDA, the host on
        the CPU. ``pack`` is the :class:`~dcr.apply.expand.Uploader`'s (packed into one
        host buffer and copied, as always on CUDA; on the CPU, to test that layout)."""
        self.runtime = runtime
        self.device = torch.device(device)
        self.verify = verify
        self.defer = defer
        self.expand = expand or ("device" if self.device.type == "cuda" else "host")
        self._uploader = Uploader(self.device, pack=pack)
        self._expand_s = 0.0  # this set's expansion, on the CPU
        self._expand_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # on CUDA
        self._storages: dict[tuple[str, int], str] = {}
        self._key_of: dict[str, tuple[str, int]] = {}
        for name, t in runtime.named_tensors():
            self._storages.setdefault(storage_key(t), name)
            self._key_of[name] = storage_key(t)
        self._scratch = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self._scratch_key = storage_key(self._scratch)
        self.tensors: dict[str, CanonicalTensor] = {}
        self.plans: dict[str, TensorPlan] = {}
        self.limits: DecodeLimits = DEFAULT_LIMITS  # narrowed to the model by prewarm
        self._applied: dict[tuple[str, int, int], bytes] = {}
        self.readable: set[str] = set()  # canonical bits can be read back (read_canonical)
        # xor tensors this rank holds in part: the canonical spans its writes read
        self.regions: dict[str, tuple[Span, ...]] = {}
        # region_key -> tensor: its region, or the whole of a readable tensor
        self._region_keys: dict[str, str] = {}
        # (storage, destination view) -> the canonical tensors whose plan writes it
        self._writers: dict[tuple[str, View], list[str]] = {}

    # --- prewarm -------------------------------------------------------------------

    def prewarm(self, tensors: Iterable[CanonicalTensor]) -> ReceiverProfile:
        """Reserve scratch, run every tensor through the loader in record mode, classify.

        Nothing is written to the runtime's storage.
        """
        self.tensors = {t.name: t for t in tensors}
        self.limits = DecodeLimits.for_tensors((t.dtype, t.shape) for t in self.tensors.values())
        largest = max((t.nbytes for t in self.tensors.values()), default=0)
        self._scratch = torch.zeros(largest, dtype=torch.uint8, device=self.device)
        self._scratch_key = storage_key(self._scratch)
        touched: dict[str, list[tuple[str, View]]] = defaultdict(list)
        self._writers = {}
        for t in self.tensors.values():
            plan = self._record(t)
            self.plans[t.name] = plan
            if plan.cls == "xor" and covers(t, plan.writes):
                self.readable.add(t.name)
                self._region_keys[region_key(t.name, whole(t.shape))] = t.name
            elif plan.cls == "xor" and (spans := held_spans(plan)):
                self.regions[t.name] = spans
                self._region_keys[region_key(t.name, spans)] = t.name
            for w in plan.writes:
                touched[w.storage].append((t.name, w.dst))
                names = self._writers.setdefault((w.storage, w.dst), [])
                if t.name not in names:
                    names.append(t.name)
        check_overlaps(dict(self.runtime.named_tensors()), touched)
        return ReceiverProfile(tensors={n: p.cls for n, p in sorted(self.plans.items())},
                               regions={n: (r,) for n, r in sorted(self.regions.items())})

    def _scratch_for(self, t: CanonicalTensor) -> torch.Tensor:
        return self._scratch[: t.nbytes].view(TORCH_DTYPES[t.dtype]).view(t.shape)

    def _record(self, t: CanonicalTensor) -> TensorPlan:
        scratch = self._scratch_for(t)
        if t.dtype in FLOATS:  # a probe: finite values with NaN between them
            flat = scratch.view(-1)
            flat.fill_(float("nan"))
            flat[::2] = 0.5
        sigs: list[CopySig] = []
        converting_ok = True

        def record(storage: str, dst: torch.Tensor, src: torch.Tensor | None,
                   run: Callable[[], object]) -> None:
            nonlocal converting_ok
            sig = signature(storage, dst, src, scratch.dtype, self._scratch_key)
            sigs.append(sig)
            if src is not None and sig.src is None and src.is_floating_point():
                nan = torch.isnan(src)
                converting_ok &= bool(nan.any()) and not bool(nan.all())

        mode = WriteInterceptor(self._storages, record)
        with mode:
            loaded = self.runtime.load_weights([(t.name, scratch)])
        self._scratch.zero_()
        if not sigs:
            if loaded:
                raise LoaderPathError(
                    f"The loader reports {sorted(loaded)[:3]} loaded from {t.name!r} but no "
                    "write into parameter storage was intercepted: it bypasses the hook."
                )
            return TensorPlan(cls="skip", writes=())
        cls = classify(t, sigs, converting_ok)
        deferrable = (cls in ("xor", "overwrite") and not mode.reads
                      and all(w.mapped or w.is_fill for w in sigs))
        return TensorPlan(cls=cls, writes=tuple(sigs), deferrable=deferrable)

    # --- apply ---------------------------------------------------------------------

    def apply_payloads(self, payloads: Sequence[bytes | Payload]) -> ApplyReport:
        """Validate and deduplicate every payload, then apply them as one set, in order.

        Bytes are verified here (:func:`read_payload`, under :attr:`limits`); a
        :class:`Payload` was verified when it was read and is used as it is. Every item
        is checked against the canonical tensors before any stream is decompressed, and
        every record is validated before anything is written. Deferrable tensors then go
        through one loader call whose writes run only once it has been checked whole;
        the others are staged and loaded one call each.
        """
        t0 = time.perf_counter()
        verified: list[Payload] = []
        ids: dict[tuple[str, int, int], bytes] = {}
        for given in payloads:
            p = given if isinstance(given, Payload) else read_payload(given, self.limits)
            h = p.header
            pid = (h.attempt, h.owner, h.seq)
            digest = p.digest
            seen = self._applied.get(pid, ids.get(pid))
            if seen == digest:
                raise DuplicatePayload(
                    f"{h.label} was already applied; XOR masks applied twice restore the "
                    "old bits, so it is refused."
                )
            if seen is not None:
                raise PayloadConflict(
                    f"{h.label} was seen before with digest {seen.hex()}; this one is "
                    f"{digest.hex()}. The attempt must fail."
                )
            ids[pid] = digest
            verified.append(p)
        headers = [it for p in verified for it in p.header.items]
        try:
            check_disjoint(headers)
        except ValueError as e:
            raise MalformedPayload(f"Payloads to apply conflict: {e}.") from e
        self._check_items(headers)  # before a single stream is decompressed
        for p in verified:
            check_limits(p.header, self.limits)
        groups: dict[str, list[DecodedItem]] = defaultdict(list)
        for p in verified:
            for item in decode(p):
                groups[item.header.name].append(item)
        for group in groups.values():  # disjoint ranges: records ascend across items
            group.sort(key=lambda i: i.header.start)
        self._applied.update(ids)  # from here on, these must never be applied again
        report = ApplyReport(decode_s=time.perf_counter() - t0)
        live = [n for n in groups if self.plans[n].cls != "skip"]
        deferred = [n for n in live if self.defer and self.plans[n].deferrable]
        staged = [n for n in live if not (self.defer and self.plans[n].deferrable)]
        self._expand_s, self._expand_events = 0.0, []
        t1 = time.perf_counter()
        compact = (self._uploader.upload({n: groups[n] for n in deferred + staged})
                   if self.expand == "device" else {})  # copies run while the loader does
        report.upload_s = time.perf_counter() - t1
        report.upload_bytes = self._uploader.bytes
        if deferred:
            self._apply_deferred(deferred, groups, compact, report)
        for name in staged:
            self._apply_tensor(name, groups[name], compact, report)
        if staged:
            self._check_moved()
        if self.device.type == "cuda":  # the one synchronization of the set
            t2 = time.perf_counter()
            torch.cuda.current_stream(self.device).synchronize()
            report.scatter_s += time.perf_counter() - t2
        report.expand_s = self._expand_s + sum(
            b.elapsed_time(e) for b, e in self._expand_events) / 1e3
        return report

    def _check_moved(self) -> None:
        """No parameter's storage was replaced: a loader that rebinds ``param.data``
        writes behind the hook, and deferred writes would land in the old storage."""
        moved = [n for n, t in self.runtime.named_tensors() if storage_key(t) != self._key_of[n]]
        if moved:
            raise LoaderPathError(
                f"The loader replaced the storage of {moved[:3]} instead of writing it in "
                "place: those writes bypass the hook."
            )

    def _records(self, name: str, group: list[DecodedItem],
                 compact: Mapping[str, CompactRecords]) -> _Records:
        """A tensor's records, expanded where :attr:`expand` says."""
        if name not in compact:
            return _Records.expanded_on_host(group, self.device)
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            records = _Records.expanded_on_device(compact[name])
            self._expand_s += time.perf_counter() - t0
            return records
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        compact[name].wait()  # its copy first: the events time the expansion alone
        begin.record()
        records = _Records.expanded_on_device(compact[name])
        end.record()
        self._expand_events.append((begin, end))
        return records

    def _apply_deferred(self, names: list[str], groups: Mapping[str, list[DecodedItem]],
                        compact: Mapping[str, CompactRecords], report: ApplyReport) -> None:
        """Load every deferrable tensor in one call, recording its writes; check them all;
        then write the changed elements. Nothing is written unless every check passes."""
        wanted = set(names)
        observed: dict[str, list[tuple[CopySig, torch.Tensor, Callable[[], object]]]] = {
            n: [] for n in names}
        strays: list[str] = []
        spent = 0.0

        def record(storage: str, dst: torch.Tensor, src: torch.Tensor | None,
                   run: Callable[[], object]) -> None:
            nonlocal spent
            t1 = time.perf_counter()
            owners = [n for n in self._writers.get((storage, View.of(dst)), ())
                      if n in wanted]
            if not owners:
                strays.append(storage)
            # Prewarm's overlap check leaves one owner per destination view (empty views
            # aside): the tensor whose next planned write this is, else the first.
            chosen: tuple[str, CopySig] | None = None
            for n in owners:
                sig = signature(storage, dst, src, TORCH_DTYPES[self.tensors[n].dtype],
                                self._scratch_key)
                chosen = chosen or (n, sig)
                plan, k = self.plans[n].writes, len(observed[n])
                if k < len(plan) and sig == plan[k]:
                    chosen = (n, sig)
                    break
            if chosen is not None:
                observed[chosen[0]].append((chosen[1], dst, run))
            spent += time.perf_counter() - t1

        # The scratch stays zeros: only where the loader copies it matters. Views are
        # made here, before the dispatch mode would see each op that makes them.
        weights = [(n, self._scratch_for(self.tensors[n])) for n in names]

        t0 = time.perf_counter()
        mode = WriteInterceptor(self._storages, record)
        with mode:
            loaded = self.runtime.load_weights(iter(weights))
        report.loader_s += time.perf_counter() - t0 - spent
        report.intercept_s += spent
        report.loads += 1
        self._check_moved()
        if strays:
            raise LoaderPathError(
                f"The loader wrote {sorted(set(strays))[:3]} where no tensor of this apply "
                "wrote at prewarm; the path changed and nothing was written.")
        for n in names:
            if tuple(sig for sig, _, _ in observed[n]) != self.plans[n].writes:
                raise LoaderPathError(
                    f"Tensor {n!r}: the loader's writes differ from prewarm's "
                    f"({len(observed[n])} now, {len(self.plans[n].writes)} then); the path "
                    "changed and nothing was written.")
        written = {self._key_of[sig.storage] for obs in observed.values() for sig, _, _ in obs}
        bypass = [n for n in loaded if n in self._key_of and self._key_of[n] not in written]
        if bypass:
            raise LoaderPathError(
                f"The loader reports {bypass[:3]} loaded without an intercepted write: it "
                "bypasses the hook; nothing was written.")
        if mode.reads:
            raise LoaderPathError(
                f"The loader read parameter storage {sorted(mode.reads)[:3]} while loading "
                f"{len(names)} tensors that did not at prewarm; nothing was written.")
        t2 = time.perf_counter()
        for n in names:
            records = self._records(n, groups[n], compact)
            xor = groups[n][0].header.entry == "xor"
            for sig, dst, run in observed[n]:
                if sig.is_fill:
                    run()  # a constant fill, replayed as the loader meant it
                else:
                    self._write_mapped(sig, dst, records, xor, self._whole(n, sig))
            report.tensors += 1
            report.names.add(n)
            report.records += len(records)
            report.writes += len(observed[n])
            report.classes[self.plans[n].cls] = report.classes.get(self.plans[n].cls, 0) + 1
        report.deferred += len(names)
        report.scatter_s += time.perf_counter() - t2

    def _check_items(self, items: list[ItemHeader]) -> None:
        """Every item fits a canonical tensor of this rank and its path; per tensor, one
        entry kind and, for a tensor loaded whole, every element."""
        groups: dict[str, list[ItemHeader]] = defaultdict(list)
        for h in items:
            t = self.tensors.get(h.name)
            if t is None:
                raise TargetMismatch(f"Item {h.where}: no canonical tensor {h.name!r} was "
                                     "prewarmed on this rank.")
            if (t.dtype, t.shape) != (h.dtype, h.shape):
                raise TargetMismatch(f"Item {h.where}: payload says {h.dtype}{list(h.shape)}, "
                                     f"the runtime's tensor is {t.dtype}{list(t.shape)}.")
            cls = self.plans[h.name].cls
            if h.entry == "xor" and cls not in ("xor", "skip"):
                raise TargetMismatch(
                    f"Item {h.where} carries XOR masks, but {h.name!r} reaches storage "
                    f"through a {cls} path on this rank: the sender must overwrite it."
                )
            groups[h.name].append(h)
        for name, group in groups.items():
            t = self.tensors[name]
            if self.plans[name].cls == "dense":
                count = sum(i.count for i in group)
                numel = t.nbytes // DTYPES[t.dtype].itemsize
                if count != numel:
                    raise TargetMismatch(
                        f"Tensor {name!r} is quantized as a whole on this rank, so every one "
                        f"of its {numel} elements must be sent; the payloads carry {count}."
                    )
            if len({i.entry for i in group}) > 1:
                raise MalformedPayload(f"Tensor {name!r} has both XOR and overwrite items.")

    def _apply_tensor(self, name: str, group: list[DecodedItem],
                      compact: Mapping[str, CompactRecords], report: ApplyReport) -> None:
        """The staged path, one loader call: the records go into scratch (masks on zeros,
        or values on NaN placeholders where a write converts), and each intercepted write
        is honoured as it happens."""
        plan = self.plans[name]
        t = self.tensors[name]
        xor = group[0].header.entry == "xor"
        t0 = time.perf_counter()
        scratch = self._scratch_for(t)
        sbits = scratch.view(BITS[scratch.element_size()]).view(-1)
        records = self._records(name, group, compact)
        positions, values = records.positions, records.values
        native = records.host is not None
        masked = plan.cls == "overwrite" and not all(w.mapped or w.is_fill for w in plan.writes)
        if masked:
            if bool(torch.isnan(values.view(scratch.dtype)).any()):
                raise TargetMismatch(
                    f"Tensor {name!r}: a NaN value cannot pass a converting path whose "
                    "placeholder is NaN; the sender must send it dense."
                )
            scratch.view(-1).fill_(float("nan"))
        _put(sbits, positions, values, xor=False, native=native)
        report.scatter_s += time.perf_counter() - t0

        observed: list[CopySig] = []
        spent = 0.0

        def write(storage: str, dst: torch.Tensor, src: torch.Tensor | None,
                  run: Callable[[], object]) -> None:
            nonlocal spent
            t1 = time.perf_counter()
            observed.append(signature(storage, dst, src, scratch.dtype, self._scratch_key))
            sig = observed[-1]
            if src is None or plan.cls == "dense":
                run()  # a constant fill, or a whole-tensor path: as the loader meant it
            elif sig.mapped:
                self._write_mapped(sig, dst, records, xor, self._whole(name, sig))
            else:
                if xor:
                    raise LoaderPathError(f"A converting write of {name!r} got XOR masks.")
                keep = torch.isnan(src) if src.is_floating_point() else None  # placeholders
                if keep is None:
                    raise LoaderPathError(f"A converting write of {name!r} has no placeholder.")
                converted = src.to(dst.dtype)
                dst.copy_(torch.where(keep, dst, converted))
                if self.verify and not bool(torch.equal(dst[~keep], converted[~keep])):
                    raise LoaderPathError(f"Post-apply check failed for {storage!r}.")
            spent += time.perf_counter() - t1

        t2 = time.perf_counter()
        try:
            with WriteInterceptor(self._storages, write):
                loaded = self.runtime.load_weights([(name, scratch)])
        finally:
            if masked:
                scratch.view(torch.uint8).zero_()
            else:  # back to all zeros, touching only what we set
                _put(sbits, positions, torch.zeros_like(values), xor=False, native=native)
        report.loader_s += time.perf_counter() - t2 - spent
        report.intercept_s += spent
        report.loads += 1
        if tuple(observed) != plan.writes:
            raise LoaderPathError(
                f"Tensor {name!r}: the loader's writes differ from prewarm's "
                f"({len(observed)} now, {len(plan.writes)} then); the path changed."
            )
        written = {self._key_of[w.storage] for w in observed}
        bypass = [n for n in loaded if n in self._key_of and self._key_of[n] not in written]
        if bypass:
            raise LoaderPathError(
                f"Tensor {name!r}: the loader reports {bypass[:3]} loaded without an "
                "intercepted write: it bypasses the hook."
            )
        report.tensors += 1
        report.names.add(name)
        report.records += len(records)
        report.writes += len(observed)
        report.classes[plan.cls] = report.classes.get(plan.cls, 0) + 1

    def _whole(self, name: str, sig: CopySig) -> bool:
        """Whether a write copies the whole canonical tensor in row-major order: then every
        record lands in it, at its own position in the view, with no search or mask."""
        return (sig.src is not None and sig.src.offset == 0 and is_rowmajor(sig.src)
                and sig.src.numel * DTYPES[self.tensors[name].dtype].itemsize
                == self.tensors[name].nbytes)

    def _write_mapped(self, sig: CopySig, dst: torch.Tensor, records: _Records,
                      xor: bool, whole: bool) -> None:
        """XOR (or write) the records that fall in the write's source view into its
        destination: records from the C kernel, on the CPU, a row-major view onto a
        row-major view by a shift in the C kernel; anything else with torch operations
        through the inverted geometry (no search or mask for a ``whole`` copy)."""
        assert sig.src is not None
        src = sig.src
        if records.host is not None and dst.device.type == "cpu" \
                and is_rowmajor(src) and is_rowmajor(sig.dst):
            positions_np, values_np = records.host
            lo, hi = np.searchsorted(positions_np, (src.offset, src.offset + src.numel))
            if hi > lo:
                self._scatter_shifted(sig, dst, positions_np[lo:hi], values_np[lo:hi], xor)
            return
        positions, values = records.positions, records.values
        if whole:
            flat, v = positions, values
        else:
            inside, flat = locate(src, positions)  # positions ascend
            v = values[inside]
        if flat.numel() == 0:
            return
        idx = storage_index(sig.dst, flat) if sig.dst.offset or not is_rowmajor(sig.dst) \
            else flat
        bits = _bits(dst)
        if self.verify:
            expect = bits[idx] ^ v if xor else v
        _put(bits, idx, v, xor=xor, native=records.host is not None)
        if self.verify and not bool(torch.equal(bits[idx], expect)):
            raise LoaderPathError(f"Post-apply check failed for a write into {sig.storage!r}.")

    def _scatter_shifted(self, sig: CopySig, dst: torch.Tensor,
                         positions: npt.NDArray[np.int64], values: npt.NDArray[Any],
                         xor: bool) -> None:
        assert sig.src is not None
        shift = sig.dst.offset - sig.src.offset
        bits = _bits(dst).numpy()
        if self.verify:
            idx = positions + shift
            expect = bits[idx] ^ values if xor else values
        _native.scatter(bits, bits.itemsize, positions, values, xor, shift)
        if self.verify and not np.array_equal(bits[idx], expect):
            raise LoaderPathError(f"Post-apply check failed for a write into {sig.storage!r}.")

    # --- post-apply checks -------------------------------------------------------------

    def read_canonical(self, name: str,
                       held: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The canonical tensor's bits (flat, integer view) as this rank's storage holds
        them, for a tensor in :attr:`readable`: each of prewarm's writes is a same-dtype
        copy of a scratch view into a storage view, which no other write touches, so
        copying every storage view back into its scratch view inverts the load exactly."""
        if name not in self.readable:
            raise LoaderPathError(f"Tensor {name!r} cannot be read back on this rank: its "
                                  f"path is {self.plans[name].cls}, or the rank holds part.")
        t = self.tensors[name]
        size = DTYPES[t.dtype].itemsize
        held = dict(self.runtime.named_tensors()) if held is None else held
        out = torch.empty(t.nbytes // size, dtype=BITS[size], device=self.device)
        for w in self.plans[name].writes:
            if w.src is None:
                continue  # a constant fill: no canonical element reaches it
            base = held[w.storage]
            bits = torch.empty(0, dtype=BITS[size], device=base.device).set_(
                base.untyped_storage())
            out.as_strided(w.src.sizes, w.src.strides, w.src.offset).copy_(
                bits.as_strided(w.dst.sizes, w.dst.strides, w.dst.offset))
        return out

    def check_targets(self, targets: Mapping[str, str]) -> dict[str, str]:
        """Compare the fingerprints among ``targets`` that this rank can recompute with
        what storage holds; return those that differ, each with the fingerprint it holds.
        ``targets`` maps a readable tensor's name to ``xxh3-128:...`` of its canonical
        bits (or ``sum64:`` of them where the owners were ranks), as a manifest lists
        them, and the key of a region this rank holds
        (:attr:`regions`) to its ``sum64:...``. On the device path the hashing runs where
        the weights live (``xxh3.py``: 1/16 of each tensor's bytes reach the host, as
        per-block sums; ``sums.py``: 8 bytes)."""
        tensors = dict(self.runtime.named_tensors())  # once: a model has 10^5 of them
        held = {name: self._held_print(name, targets[name], tensors)
                for name in sorted(targets.keys() & self.readable)}
        held |= {key: sum_text(self.region_sum(self._region_keys[key], tensors))
                 for key in sorted(targets.keys() & self._region_keys.keys())}
        return {name: fp for name, fp in held.items() if fp != targets[name]}

    def _held_print(self, name: str, want: str, held: Mapping[str, torch.Tensor]) -> str:
        """A readable tensor's fingerprint, of the kind ``want`` is."""
        if want.startswith("sum64:"):
            return sum_text(self.region_sum(name, held))
        return self._digest(self.read_canonical(name, held))

    def region_sum(self, name: str, held: Mapping[str, torch.Tensor] | None = None) -> int:
        """The additive fingerprint (``dcr.codec.sums``) of the canonical elements this
        rank holds of ``name``: of the whole tensor for a readable one (read back), else
        of its region (:attr:`regions`): each write of its plan copied one span of the
        canonical tensor into one storage view, so the storage view holds that span's
        elements in its order."""
        t = self.tensors[name]
        held = dict(self.runtime.named_tensors()) if held is None else held
        if name in self.readable:
            (span,) = whole(t.shape)
            return self._span_sum(self.read_canonical(name, held), span)
        size = DTYPES[t.dtype].itemsize
        total = 0
        for w in self.plans[name].writes:
            if w.src is None:
                continue  # a constant fill: no canonical element reaches it
            base = held[w.storage]
            bits = torch.empty(0, dtype=BITS[size], device=base.device).set_(
                base.untyped_storage()).as_strided(w.dst.sizes, w.dst.strides, w.dst.offset)
            total += self._span_sum(bits, (w.src.offset, w.src.sizes, w.src.strides))
        return total & MASK64

    @staticmethod
    def _span_sum(bits: torch.Tensor, span: Span) -> int:
        """A span's sum where ``bits`` lives: torch on a device, the C kernel on the CPU."""
        if bits.device.type != "cpu":
            return span_sum_torch(bits, span)
        return span_sum(bits.contiguous().numpy().view(f"<u{bits.element_size()}"), span)

    def _digest(self, bits: torch.Tensor) -> str:
        """xxh3-128 on the device path where the weights live, else on the host."""
        return xxh3.fingerprint(bits) if self.expand == "device" else fingerprint(
            bits.cpu().numpy())


def _put(bits: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, *, xor: bool,
         native: bool) -> None:
    """``bits[idx] = values`` (or ``^=``): on the CPU through the codec's bounds-checked C
    kernel when ``native``, else with torch indexing (the device path: its indices come
    from validated records and prewarm's geometry)."""
    if native and bits.device.type == "cpu":
        _native.scatter(bits.numpy(), bits.element_size(), idx.contiguous().numpy(),
                        values.contiguous().numpy(), xor)
    else:
        scatter(bits.view(-1), idx, values, xor=xor)
