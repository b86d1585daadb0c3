"""Where a version's objects live in a store: key building, parsing and checking.

The one spelling in code of the keys ``FORMAT.md`` defines: writers build keys here and
readers that learn ids from a key parse them here, so the two cannot drift. A parser
accepts only the spelling its builder produces (``o0001``, not ``o001``), else None.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePosixPath
from typing import NamedTuple

from dcr.errors import ConfigError
from dcr.format.names import ATTEMPT_BODY

_VERSION = r"v(\d{10,})"
_PAYLOAD_KEY = re.compile(rf"{_VERSION}/({ATTEMPT_BODY})/o(\d{{4,}})-s(\d{{6,}})\.dcrp")
_PART_KEY = re.compile(rf"{_VERSION}/({ATTEMPT_BODY})/manifest-o(\d{{4,}})\.dcrm")
_MANIFEST_KEY = re.compile(rf"{_VERSION}/manifest\.dcrm")


class PayloadKey(NamedTuple):
    """The ids a payload key names: ``v<version>/<attempt>/o<owner>-s<seq>.dcrp``."""

    version: int
    attempt: str
    owner: int
    seq: int


class ManifestPartKey(NamedTuple):
    """The ids a manifest part key names: ``v<version>/<attempt>/manifest-o<owner>.dcrm``."""

    version: int
    attempt: str
    owner: int


def version_prefix(version: int) -> str:
    return f"v{version:010d}"


def attempt_prefix(version: int, attempt: str) -> str:
    """The prefix under which an attempt's payloads and manifest parts live."""
    return f"{version_prefix(version)}/{attempt}/"


def manifest_key(version: int) -> str:
    return f"{version_prefix(version)}/manifest.dcrm"


MAX_OWNERS = 4096  # owners of one attempt, so manifest parts of one committed version


def owner_manifest_key(version: int, attempt: str, owner: int) -> str:
    """Where owner ``owner`` of a several-owner attempt writes its part of the manifest."""
    return f"{attempt_prefix(version, attempt)}manifest-o{owner:04d}.dcrm"


def payload_key(version: int, attempt: str, owner: int, seq: int) -> str:
    return f"{attempt_prefix(version, attempt)}o{owner:04d}-s{seq:06d}.dcrp"


def parse_payload_key(key: str) -> PayloadKey | None:
    """The ids of a payload key, or None if ``key`` is not one."""
    m = _PAYLOAD_KEY.fullmatch(key)
    if m is None:
        return None
    parsed = PayloadKey(int(m[1]), m[2], int(m[3]), int(m[4]))
    return parsed if payload_key(*parsed) == key else None


def parse_manifest_part_key(key: str) -> ManifestPartKey | None:
    """The ids of an owner's manifest part key, or None if ``key`` is not one."""
    m = _PART_KEY.fullmatch(key)
    if m is None:
        return None
    parsed = ManifestPartKey(int(m[1]), m[2], int(m[3]))
    return parsed if owner_manifest_key(*parsed) == key else None


def parse_manifest_key(key: str) -> int | None:
    """The version of a file-level version manifest key, or None if ``key`` is not one."""
    m = _MANIFEST_KEY.fullmatch(key)
    if m is None:
        return None
    version = int(m[1])
    return version if manifest_key(version) == key else None


def check_key(key: str) -> str:
    """Return ``key`` if it is safe under any store root: relative, no empty, ``.`` or
    ``..`` segments. Every store checks keys with this before it touches an object."""
    p = PurePosixPath(key)
    if not key or p.is_absolute() or any(part in ("", ".", "..") for part in key.split("/")):
        raise ConfigError(f"Store key {key!r} must be a relative path without '.' or '..'.")
    return key


def owner_of(name: str, owners: int) -> int:
    """The owner of tensor ``name`` among ``owners``: a hash every process agrees on."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % owners
