"""The per-attempt manifest, version 2 or 3: the payloads a receiver must apply, written last.

It names the transition, the attempt, every payload with its size and digest in apply
order, and every tensor's base and target fingerprints (version 3: also an owner's part
of a whole tensor's additive sum, where the owners are ranks that each hold part of it,
added up when parts are merged): JSON (``manifest.schema.json``,
generated from the model below) sealed in a small zstd container, whose size, digest and
entry count are checked before anything is decompressed or parsed. ``FORMAT.md``,
"Manifest", has the bytes, the limits and why.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dcr.errors import ManifestError, first_validation_error
from dcr.format.names import ATTEMPT_PATTERN, ATTEMPT_RE, Mode
from dcr.format.payload import MAGIC as _PAYLOAD_MAGIC
from dcr.format.payload import decompress_exact
from dcr.format.regions import SUM_PATTERN, Spans, region_key, sum_text, sum_value
from dcr.versions import MANIFEST, MANIFEST_DOCUMENT

MANIFEST_VERSION = MANIFEST.writes
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")

MAGIC = b"\x89DCM\r\n\x1a\n"
_PREAMBLE = struct.Struct("<8sHHIII")  # magic, version, flags, packed, raw, reserved
DIGEST_SIZE = 16
DIGEST_PERSON = b"dcr-manifest-v2"
PREAMBLE_SIZE = _PREAMBLE.size + DIGEST_SIZE  # 40
LEVEL = 1  # writers' zstd level: smaller than 3 or 9 here, within 4% of 19; readers take any

_HEX32 = r"^[0-9a-f]{32}$"
_FINGERPRINT = r"^(xxh3-128:[0-9a-f]{32}|sum64:[0-9a-f]{16})$"


@dataclass(frozen=True, kw_only=True)
class ManifestLimits:
    """Upper bounds a reader enforces before it decompresses or parses a manifest.

    The largest public checkpoints list about 10^5 tensors (a 671B MoE with FP8 scales)
    and under 10^4 payloads (1T parameters in 256 MiB buckets), a tenth of
    ``max_entries``. A tensor costs about 195 bytes of JSON and 37 compressed; reading
    costs 3-6 us and about 1.3 KiB of peak memory per entry (measured), so the defaults
    take a few seconds and about 1.3 GiB at worst.
    """

    max_bytes: int = 64 << 20  # the stored object (the relay's max_manifest_bytes default)
    max_json_bytes: int = 256 << 20  # the decompressed JSON document
    max_entries: int = 1 << 20  # payloads plus tensors


DEFAULT_MANIFEST_LIMITS = ManifestLimits()
_ENTRY_JSON = 2048  # bytes of JSON per entry a reader allows (a 1024-character name fits)


def limits_for(tensors: int) -> ManifestLimits:
    """What a reader of ``tensors`` canonical tensors can use: that many tensor entries,
    a small multiple of them as payloads (a tensor larger than a bucket spans several)
    and as region sums (one per rank of a TP 8 engine, per owner of a part), and JSON
    for that many entries, each bound by the defaults. A part over that is refused
    before it is decompressed or parsed: a receiver of a 100-tensor model reads at most
    3.5 MB of JSON, whatever an owner wrote (the defaults admit a part that costs every
    reader seconds and over a GiB)."""
    entries = min(DEFAULT_MANIFEST_LIMITS.max_entries, 16 * tensors + 1024)
    json_bytes = min(DEFAULT_MANIFEST_LIMITS.max_json_bytes, entries * _ENTRY_JSON + (64 << 10))
    return ManifestLimits(max_bytes=min(DEFAULT_MANIFEST_LIMITS.max_bytes, json_bytes),
                          max_entries=entries, max_json_bytes=json_bytes)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PayloadEntry(_Model):
    key: Annotated[str, Field(min_length=1, description="Object key relative to the store root")]
    owner: Annotated[int, Field(ge=0)]
    seq: Annotated[int, Field(ge=0)]
    size: Annotated[int, Field(ge=48, description="Bytes of the payload object")]
    digest: Annotated[str, Field(pattern=_HEX32, description="BLAKE2b-128 of the whole object")]
    items: Annotated[int, Field(ge=0)]
    records: Annotated[int, Field(ge=0)]


class TensorEntry(_Model):
    """A canonical tensor's fingerprints at the base and the target: ``xxh3-128:`` of its
    bits, from an owner that holds it whole; or ``sum64:``, an owner's part of the sum
    over the whole tensor (``dcr.codec.sums``), from owners that each hold part of it
    (trainer ranks), which :func:`merge_manifests` adds into the whole tensor's."""

    name: Annotated[str, Field(min_length=1)]
    dtype: str
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    base: Annotated[str, Field(pattern=_FINGERPRINT)]
    target: Annotated[str, Field(pattern=_FINGERPRINT)]

    @property
    def summed(self) -> bool:
        """Whether the fingerprints are additive sums (parts that add up)."""
        return self.base.startswith("sum64:")


class RegionSum(_Model):
    """An owner's part of a region's additive fingerprint (``dcr.codec.sums``): the sum
    over the elements of the region it owns. A receiver adds every owner's part."""

    tensor: Annotated[str, Field(min_length=1)]
    spans: Spans
    sum: Annotated[str, Field(pattern=SUM_PATTERN)]


class Stats(_Model):
    tensors: Annotated[int, Field(ge=0)]
    changed_elements: Annotated[int, Field(ge=0)]
    total_elements: Annotated[int, Field(ge=0)]
    dense_bytes: Annotated[int, Field(ge=0)]
    payload_bytes: Annotated[int, Field(ge=0)]


class Manifest(_Model):
    format: Literal["dcr-manifest"] = "dcr-manifest"
    format_version: Literal[2, 3] = 2  # 3 exactly when some tensor's fingerprints are sums
    base_version: Annotated[int, Field(ge=0)]
    target_version: Annotated[int, Field(ge=0)]
    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)]
    mode: Mode
    payloads: tuple[PayloadEntry, ...]
    tensors: tuple[TensorEntry, ...]
    stats: Stats
    sums: tuple[RegionSum, ...] = ()  # regions a receiver's profile names; absent when none

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.base_version == self.target_version:
            raise ValueError(f"base and target version are both {self.base_version}")
        ids = [(p.owner, p.seq) for p in self.payloads]
        if len(set(ids)) != len(ids):
            raise ValueError("two payloads share an (owner, seq) id")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("a tensor is listed twice")
        kinds = {(t.base.split(":")[0], t.target.split(":")[0]) for t in self.tensors}
        if kinds - {("xxh3-128", "xxh3-128"), ("sum64", "sum64")}:
            raise ValueError(f"a tensor's base and target fingerprints are of two kinds "
                             f"{sorted(kinds)}")
        if self.format_version != (3 if any(t.summed for t in self.tensors) else 2):
            raise ValueError(f"format_version is {self.format_version}, but a document lists "
                             "sum64 fingerprints exactly when it is version 3")
        return self

    def region_sums(self) -> dict[str, str]:
        """Region key (``dcr.format.regions.region_key``) -> the region's fingerprint:
        every owner's part added."""
        out: dict[str, int] = {}
        for r in self.sums:
            key = region_key(r.tensor, r.spans)
            out[key] = out.get(key, 0) + sum_value(r.sum)
        return {k: sum_text(v) for k, v in out.items()}

    def document(self) -> bytes:
        """The JSON document the container carries (compact, fields in schema order;
        ``sums`` only when there are some)."""
        return self.model_dump_json(exclude=None if self.sums else {"sums"}).encode()

    def pack(self, level: int = LEVEL) -> bytes:
        """The manifest object, as stores and relays hold it."""
        return seal_document(self.document(), level=level)

    @classmethod
    def parse(cls, data: bytes | memoryview, where: str,
              limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS) -> Manifest:
        """Check a manifest object's container, limits and schema; ``where`` names it in
        errors (a store key or URL)."""
        doc = open_document(data, where, limits)
        try:
            # Strict JSON mode: UTF-8 only, integers must be JSON integers, no coercion.
            return cls.model_validate_json(doc, strict=True)
        except ValidationError as e:
            MANIFEST_DOCUMENT.refuse_invalid(e, f"Manifest {where}", ManifestError)
            raise ManifestError(f"Manifest {where} is invalid: "
                                f"{first_validation_error(e)}.") from e


def seal_document(doc: bytes, *, level: int = LEVEL) -> bytes:
    """Compress a JSON document and seal it in the manifest container.

    Refuses what a reader with the default limits would refuse, so no owner publishes a
    manifest its receivers cannot read. Does not validate the document: :meth:`Manifest.pack`
    seals only valid ones, tests seal hostile ones.
    """
    limits = DEFAULT_MANIFEST_LIMITS
    _check_document("The manifest to seal", doc, limits)
    frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(doc)
    if PREAMBLE_SIZE + len(frame) > limits.max_bytes:
        raise ManifestError(f"The manifest to seal compresses to {PREAMBLE_SIZE + len(frame)} "
                            f"bytes, over the limit of {limits.max_bytes}.")
    pre = _PREAMBLE.pack(MAGIC, MANIFEST_VERSION, 0, len(frame), len(doc), 0)
    return b"".join((pre, _digest(pre, frame), frame))


def open_document(data: bytes | memoryview, where: str,
                  limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS) -> bytes:
    """The JSON document of a manifest object, after every check short of the schema:
    size, magic, version, reserved fields, length, digest, the declared JSON size, the
    frame, and the count of objects. Raises :class:`ManifestError` naming the value."""
    frame, raw = _container(data, where, limits)
    doc = decompress_exact(frame, raw, subject=f"Manifest {where}: the document",
                           sized_by="preamble", error=ManifestError)
    _check_document(f"Manifest {where}", doc, limits)
    return doc


_HEAD = re.compile(rb'\{"format":"dcr-manifest","format_version":(\d{1,9}),"base_version":\d+,'
                   rb'"target_version":\d+,"attempt":"([^"\\]{1,128})"')
_HEAD_BYTES = 512


def manifest_attempt(data: bytes | memoryview, where: str,
                     limits: ManifestLimits = DEFAULT_MANIFEST_LIMITS) -> str:
    """The attempt a manifest object names, from its container and the head of its
    document only: what a relay checks. Writers put the fields in schema order
    (:meth:`Manifest.document`), so the attempt is in the first few hundred bytes; the
    rest is never decompressed or parsed (each receiver does that, with its own limits)."""
    frame, _ = _container(data, where, limits)
    try:
        head = zstandard.ZstdDecompressor().stream_reader(frame).read(_HEAD_BYTES)
    except zstandard.ZstdError as e:
        raise ManifestError(f"Manifest {where}: the document's frame is corrupt: {e}.") from e
    m = _HEAD.match(head)
    if m is not None:
        MANIFEST_DOCUMENT.check(f"Manifest {where}", int(m[1]), ManifestError)
    if m is None or not ATTEMPT_RE.fullmatch(m[2].decode("ascii", "replace")):
        raise ManifestError(f"Manifest {where} does not begin as a version 2 or 3 document "
                            "naming its attempt (fields in schema order).")
    return m[2].decode()


def _container(data: bytes | memoryview, where: str, limits: ManifestLimits
               ) -> tuple[memoryview, int]:
    """The checked zstd frame of a manifest object and the JSON size it declares."""
    buf = memoryview(data).cast("B")
    if len(buf) > limits.max_bytes:
        raise ManifestError(f"Manifest {where} is {len(buf)} bytes, over the limit of "
                            f"{limits.max_bytes}.")
    if len(buf) < PREAMBLE_SIZE:
        raise ManifestError(f"Manifest {where} is truncated: {len(buf)} bytes, shorter than "
                            f"the {PREAMBLE_SIZE}-byte preamble.")
    magic, version, flags, packed, raw, reserved = _PREAMBLE.unpack_from(buf)
    if magic != MAGIC:
        raise ManifestError(f"Manifest {where} is not a DCR manifest: magic is "
                            f"{bytes(magic)!r}{_what_it_is(bytes(magic))}, want {MAGIC!r}.")
    MANIFEST.check(f"Manifest {where}", version, ManifestError)
    if flags != 0 or reserved != 0:
        raise ManifestError(f"Manifest {where}: reserved preamble fields are nonzero "
                            f"(flags={flags}, reserved={reserved}).")
    if len(buf) != PREAMBLE_SIZE + packed:
        raise ManifestError(f"Manifest {where} is truncated or padded: {len(buf)} bytes, but "
                            f"its preamble declares {PREAMBLE_SIZE + packed} "
                            f"({PREAMBLE_SIZE} + document {packed}).")
    frame = buf[PREAMBLE_SIZE:]
    want, got = bytes(buf[_PREAMBLE.size : PREAMBLE_SIZE]), _digest(buf[: _PREAMBLE.size], frame)
    if got != want:
        raise ManifestError(f"Manifest {where}: digest mismatch (expected {want.hex()}, got "
                            f"{got.hex()}): the bytes were corrupted in transit or storage.")
    if raw > limits.max_json_bytes:
        raise ManifestError(f"Manifest {where} declares {raw} bytes of JSON, over the limit "
                            f"of {limits.max_json_bytes} (refused before decompressing).")
    return frame, raw


def _digest(preamble: bytes | memoryview, frame: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=DIGEST_PERSON)
    h.update(preamble)
    h.update(frame)
    return h.digest()


def _what_it_is(magic: bytes) -> str:
    if magic.startswith(b"{"):
        return " (a version 1 manifest, plain JSON)"
    if magic == _PAYLOAD_MAGIC:
        return " (a payload)"
    return ""


def _check_document(what: str, doc: bytes, limits: ManifestLimits) -> None:
    """Refuse a document over the size limit or with too many entries, before parsing.

    Every payload and tensor entry is a JSON object, as are the stats and the document
    itself, so ``{`` bytes (names may hold more) bound the entries from above.
    """
    if len(doc) > limits.max_json_bytes:
        raise ManifestError(f"{what} is {len(doc)} bytes of JSON, over the limit of "
                            f"{limits.max_json_bytes}.")
    objects = doc.count(b"{")
    if objects > limits.max_entries + 2:
        raise ManifestError(f"{what} holds {objects} JSON objects: more payloads and tensors "
                            f"than the limit of {limits.max_entries} (refused before parsing).")


def json_schema() -> str:
    return json.dumps(Manifest.model_json_schema(), indent=2, sort_keys=True) + "\n"


def merge_manifests(parts: list[Manifest], where: str) -> Manifest:
    """One manifest from the parts several owners wrote for the same attempt.

    Owners split tensors by name, so the parts must agree on the transition, attempt
    and mode, and must not share a payload id, nor a tensor unless every part lists it
    with sums: owners of parts of one tensor (trainer ranks) each write their part of its
    sums, added here into the whole tensor's. Their region sums are kept side by side.
    """
    if not parts:
        raise ManifestError(f"No manifest parts to merge for {where}.")
    first = parts[0]
    for p in parts[1:]:
        got = (p.base_version, p.target_version, p.attempt, p.mode)
        want = (first.base_version, first.target_version, first.attempt, first.mode)
        if got != want:
            raise ManifestError(
                f"Manifest parts of {where} disagree: (base, target, attempt, mode) {got} "
                f"vs {want}."
            )
    try:
        return Manifest(
            base_version=first.base_version, target_version=first.target_version,
            attempt=first.attempt, mode=first.mode,
            payloads=tuple(e for p in parts for e in p.payloads),
            format_version=max(p.format_version for p in parts),
            tensors=_added(parts, where),
            sums=tuple(r for p in parts for r in p.sums),
            stats=Stats(**{
                f: sum(getattr(p.stats, f) for p in parts) for f in Stats.model_fields
            }),
        )
    except ValidationError as e:
        raise ManifestError(f"Manifest parts of {where} overlap: {e.errors()[0]['msg']}.") from e


def _added(parts: list[Manifest], where: str) -> tuple[TensorEntry, ...]:
    """The parts' tensors, each summed tensor's parts added into one entry (in the order
    each name first appears); a tensor listed with ``xxh3-128`` stays as it is, and a
    repeat of it is left for the model to refuse."""
    out: list[TensorEntry] = []
    summed: dict[str, int] = {}  # name -> its index in out
    for t in (t for p in parts for t in p.tensors):
        at = summed.get(t.name)
        if at is None or not t.summed:
            if t.summed:
                summed[t.name] = len(out)
            out.append(t)
            continue
        have = out[at]
        if (have.dtype, have.shape) != (t.dtype, t.shape):
            raise ManifestError(f"Manifest parts of {where} list tensor {t.name!r} as "
                                f"{have.dtype}{list(have.shape)} and {t.dtype}{list(t.shape)}.")
        out[at] = have.model_copy(update={
            "base": sum_text(sum_value(have.base) + sum_value(t.base)),
            "target": sum_text(sum_value(have.target) + sum_value(t.target))})
    return tuple(out)
