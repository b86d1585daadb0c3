"""Where a version's objects live in a store."""

from __future__ import annotations


def version_prefix(version: int) -> str:
    return f"v{version:010d}"


def manifest_key(version: int) -> str:
    return f"{version_prefix(version)}/manifest.json"


def payload_key(version: int, attempt: str, owner: int, seq: int) -> str:
    return f"{version_prefix(version)}/{attempt}/o{owner:04d}-s{seq:06d}.dcrp"
