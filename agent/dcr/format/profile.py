"""The receiver profile: how each canonical tensor reaches this rank's storage.

Prewarm classifies every tensor ``xor``, ``overwrite``, ``dense`` or ``skip``; the sender
merges the ranks' profiles (the most demanding class wins) and encodes each tensor
accordingly. docs/apply.md, "Prewarm and the receiver profile". A rank holding part of an
``xor`` tensor also names its region (``dcr.format.regions``); the merge keeps every rank's,
and the owner writes a fingerprint of each.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr.errors import ConfigError
from dcr.format.regions import Spans

TensorClass = Literal["xor", "overwrite", "dense", "skip"]
_RANK: dict[str, int] = {"skip": 0, "xor": 1, "overwrite": 2, "dense": 3}
MAX_REGIONS = 256  # distinct regions of one tensor: ranks holding different parts of it


class ReceiverProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["dcr-receiver-profile"] = "dcr-receiver-profile"
    version: Literal[1] = 1
    tensors: dict[str, TensorClass]
    # tensor -> the regions ranks hold of it, for xor tensors a rank holds in part
    # (left out of the JSON when empty: a profile of whole-tensor ranks reads as before)
    regions: dict[str, Annotated[tuple[Spans, ...], Field(max_length=MAX_REGIONS)]] = Field(
        default={}, exclude_if=lambda r: not r)


def load_profile(path: Path) -> ReceiverProfile:
    """Read a profile file, or fail naming it."""
    try:
        return ReceiverProfile.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as e:
        raise ConfigError(f"Receiver profile {path} is unreadable or invalid: {e}") from e


def merge(profiles: Iterable[ReceiverProfile]) -> ReceiverProfile:
    """One profile for the sender: per tensor, the most demanding class of any rank."""
    out: dict[str, TensorClass] = {}
    regions: dict[str, set[Spans]] = {}
    for p in profiles:
        for name, cls in p.tensors.items():
            if name not in out or _RANK[cls] > _RANK[out[name]]:
                out[name] = cls
        for name, held in p.regions.items():
            regions.setdefault(name, set()).update(held)
    return ReceiverProfile(tensors=dict(sorted(out.items())),
                           regions={n: tuple(sorted(r)) for n, r in sorted(regions.items())
                                    if out.get(n) == "xor"})


def coverage(profile: ReceiverProfile, nbytes: dict[str, int]) -> dict[str, float]:
    """Fraction of weight bytes per class (a tensor skipped everywhere counts as skip)."""
    total = sum(nbytes[n] for n in profile.tensors) or 1
    share = dict.fromkeys(_RANK, 0.0)
    for name, cls in profile.tensors.items():
        share[cls] += nbytes[name] / total
    return share


def dumps(profile: ReceiverProfile) -> str:
    return json.dumps(profile.model_dump(), indent=1)
