"""The per-attempt manifest: the list of payloads a receiver must apply, written last.

A manifest is JSON (schema: ``manifest.schema.json`` beside this module, generated from
the model below). It names the transition, the attempt, every payload with its size and
BLAKE2b-128 digest in apply order, and the fingerprint of every tensor at the base and
the target version, so a file-level receiver can refuse a checkpoint that is not at the
base version and can prove it reached the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dcr.errors import ManifestError, first_validation_error
from dcr.format.names import ATTEMPT_PATTERN, Mode

MANIFEST_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")

_HEX32 = r"^[0-9a-f]{32}$"
_FINGERPRINT = r"^xxh3-128:[0-9a-f]{32}$"


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
    name: Annotated[str, Field(min_length=1)]
    dtype: str
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    base: Annotated[str, Field(pattern=_FINGERPRINT)]
    target: Annotated[str, Field(pattern=_FINGERPRINT)]


class Stats(_Model):
    tensors: Annotated[int, Field(ge=0)]
    changed_elements: Annotated[int, Field(ge=0)]
    total_elements: Annotated[int, Field(ge=0)]
    dense_bytes: Annotated[int, Field(ge=0)]
    payload_bytes: Annotated[int, Field(ge=0)]


class Manifest(_Model):
    format: Literal["dcr-manifest"] = "dcr-manifest"
    format_version: Literal[1] = 1
    base_version: Annotated[int, Field(ge=0)]
    target_version: Annotated[int, Field(ge=0)]
    attempt: Annotated[str, Field(pattern=ATTEMPT_PATTERN)]
    mode: Mode
    payloads: tuple[PayloadEntry, ...]
    tensors: tuple[TensorEntry, ...]
    stats: Stats

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
        return self

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            raise ManifestError(f"Manifest {where} is invalid: "
                                f"{first_validation_error(e)}.") from e


def json_schema() -> str:
    return json.dumps(Manifest.model_json_schema(), indent=2, sort_keys=True) + "\n"


def merge_manifests(parts: list[Manifest], where: str) -> Manifest:
    """One manifest from the parts several owners wrote for the same attempt.

    Owners split tensors by name, so the parts must agree on the transition, attempt
    and mode, and must not share a tensor or a payload id.
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
            tensors=tuple(t for p in parts for t in p.tensors),
            stats=Stats(**{
                f: sum(getattr(p.stats, f) for p in parts) for f in Stats.model_fields
            }),
        )
    except ValidationError as e:
        raise ManifestError(f"Manifest parts of {where} overlap: {e.errors()[0]['msg']}.") from e
