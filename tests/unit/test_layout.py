"""Store keys: every key a writer builds parses back to its ids; nothing else parses."""

from __future__ import annotations

import pytest

from dcr.errors import ConfigError
from dcr.format.layout import (
    ManifestPartKey,
    PayloadKey,
    check_key,
    manifest_key,
    owner_manifest_key,
    parse_manifest_key,
    parse_manifest_part_key,
    parse_payload_key,
    payload_key,
)


@pytest.mark.parametrize(("version", "attempt", "owner", "seq"), [
    (1, "a-1", 0, 0),
    (2, "a-7f2c19e0ab12", 3, 17),
    (10**10 + 5, "A.b_c-9", 12_345, 2_000_000),  # wider than the padding: still round-trips
])
def test_built_keys_parse_back_to_their_ids(version: int, attempt: str, owner: int,
                                            seq: int) -> None:
    assert parse_payload_key(payload_key(version, attempt, owner, seq)) == PayloadKey(
        version, attempt, owner, seq)
    assert parse_manifest_part_key(owner_manifest_key(version, attempt, owner)) == (
        ManifestPartKey(version, attempt, owner))
    assert parse_manifest_key(manifest_key(version)) == version


@pytest.mark.parametrize("key", [
    "v0000000001/a-1/o000-s000000.dcrp",  # owner too short
    "v0000000001/a-1/o00000-s000000.dcrp",  # owner padded past its width
    "v000000001/a-1/o0000-s000000.dcrp",  # version too short
    "v0000000001/-a/o0000-s000000.dcrp",  # not an attempt id
    "v0000000001/a-1/o0000-s000000.dcrp\n",
    "x/v0000000001/a-1/o0000-s000000.dcrp",
    "v0000000001/a-1/x/o0000-s000000.dcrp",
    "v0000000001/a-1/manifest-o0000.dcrm",
    "v0000000001/manifest.dcrm",
])
def test_keys_that_are_not_canonical_payload_keys_do_not_parse(key: str) -> None:
    assert parse_payload_key(key) is None


def test_each_parser_takes_only_its_own_kind_of_key() -> None:
    payload, part = payload_key(1, "a-1", 0, 0), owner_manifest_key(1, "a-1", 0)
    assert parse_manifest_part_key(payload) is None
    assert parse_manifest_key(part) is None
    assert parse_manifest_part_key("v0000000001/a-1/manifest-o00000.dcrm") is None
    assert parse_manifest_key("v00000000001/manifest.dcrm") is None
    # Version 1 manifests were JSON under .json keys; those keys are nobody's now.
    assert parse_manifest_part_key("v0000000001/a-1/manifest-o0000.json") is None
    assert parse_manifest_key("v0000000001/manifest.json") is None


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/./b", "../up", "a/.."])
def test_unsafe_store_keys_are_refused(key: str) -> None:
    with pytest.raises(ConfigError, match="must be a relative path"):
        check_key(key)
