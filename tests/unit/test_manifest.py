"""The manifest model, its committed JSON schema, and its validation."""

from __future__ import annotations

import json

import pytest

from dcr.errors import ManifestError
from dcr.format.manifest import SCHEMA_PATH, Manifest, json_schema

FP = "xxh3-128:" + "0" * 32


def manifest(**over: object) -> dict[str, object]:
    m: dict[str, object] = {
        "base_version": 1, "target_version": 2, "attempt": "a-1", "mode": "mixed",
        "payloads": [{"key": "v0000000002/a-1/o0000-s000000.dcrp", "owner": 0, "seq": 0,
                      "size": 100, "digest": "ab" * 16, "items": 1, "records": 5}],
        "tensors": [{"name": "w", "dtype": "BF16", "shape": [2, 2], "base": FP, "target": FP}],
        "stats": {"tensors": 1, "changed_elements": 5, "total_elements": 4,
                  "dense_bytes": 8, "payload_bytes": 100},
    }
    m.update(over)
    return m


def test_committed_schema_matches_the_model() -> None:
    assert SCHEMA_PATH.read_text() == json_schema(), "run `make schema`"


def test_valid_manifest_roundtrips() -> None:
    m = Manifest.parse(json.dumps(manifest()).encode(), "t")
    assert Manifest.parse(m.to_json(), "t") == m


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"target_version": 1}, "both 1"),
        ({"attempt": "../x"}, "attempt"),
        ({"mode": "fast"}, "mode"),
        ({"extra": 1}, "extra"),
        ({"format_version": 2}, "format_version"),
        ({"payloads": [{"key": "k", "owner": 0, "seq": 0, "size": 100, "digest": "zz",
                        "items": 1, "records": 1}]}, "digest"),
    ],
)
def test_invalid_manifest_is_rejected_naming_the_field(override: dict[str, object],
                                                       needle: str) -> None:
    with pytest.raises(ManifestError, match=needle):
        Manifest.parse(json.dumps(manifest(**override)).encode(), "store/v2/manifest.json")
