"""Where a version's objects live in a store."""

from __future__ import annotations

import hashlib


def version_prefix(version: int) -> str:
    return f"v{version:010d}"


def manifest_key(version: int) -> str:
    return f"{version_prefix(version)}/manifest.json"


def owner_manifest_key(version: int, attempt: str, owner: int) -> str:
    """Where owner ``owner`` of a several-owner attempt writes its part of the manifest."""
    return f"{version_prefix(version)}/{attempt}/manifest-o{owner:04d}.json"


def payload_key(version: int, attempt: str, owner: int, seq: int) -> str:
    return f"{version_prefix(version)}/{attempt}/o{owner:04d}-s{seq:06d}.dcrp"


def owner_of(name: str, owners: int) -> int:
    """The owner of tensor ``name`` among ``owners``: a hash every process agrees on."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % owners
