"""The relay root as a store: keys map to relay calls; what a relay cannot carry is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcr.errors import ConfigError
from dcr.transport.relay.publish import RelayPublisher
from dcr.transport.store import FileStore, open_store


def test_open_store_gives_a_publisher_that_needs_the_token_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCR_RELAY_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"needs its bearer token in \$DCR_RELAY_TOKEN"):
        open_store("relay+http://127.0.0.1:9")
    monkeypatch.setenv("DCR_RELAY_TOKEN", "t" * 32)
    store = open_store("relay+http://127.0.0.1:9")
    try:
        assert isinstance(store, RelayPublisher)
        assert "t" * 32 not in repr(store.__dict__.get("uri"))
    finally:
        store.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("key", "message"), [
    ("v0000000001/a-1/notes.txt", "neither a payload nor a manifest"),
    ("v0000000001/manifest.dcrm", "not a manifest naming its attempt"),
])
def test_what_a_relay_cannot_carry_is_refused_before_anything_is_sent(
        key: str, message: str) -> None:
    store = RelayPublisher("relay+http://127.0.0.1:9", token="t" * 32)  # nothing listens
    try:
        with pytest.raises(ConfigError, match=message):
            store.put(key, b"{}")
        with pytest.raises(ConfigError, match="write-only"):
            store.get("v0000000001/a-1/o0000-s000000.dcrp")
    finally:
        store.close()


@pytest.mark.parametrize(("uri", "message"), [
    ("relay+http://127.0.0.1:9?through=", "the only query it takes is one through="),
    ("relay+http://127.0.0.1:9?other=x", "the only query it takes is one through="),
    ("relay+http://127.0.0.1:9?through=a&through=b", "the only query it takes is one through="),
    ("relay+http://127.0.0.1:9?through=relay%2Bhttp://x:1", "not another relay"),
])
def test_a_write_through_uri_takes_one_store_and_names_the_value_otherwise(
        uri: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        RelayPublisher(uri, token="t" * 32)
    assert repr(uri) in str(e.value)


def test_a_write_through_publisher_reads_its_store_and_refuses_a_foreign_key_before_writing(
        tmp_path: Path) -> None:
    """A key the relay cannot carry is refused before the store is written, so the store
    never holds what the tree does not; reads are the store's."""
    store = RelayPublisher(f"relay+http://127.0.0.1:9?through={tmp_path.as_uri()}",
                           token="t" * 32)  # nothing listens: no put reaches a relay
    try:
        assert isinstance(store.through, FileStore)
        with pytest.raises(ConfigError, match="neither a payload nor a manifest"):
            store.put("v0000000001/a-1/notes.txt", b"x")
        assert not any(tmp_path.iterdir())
        FileStore(tmp_path).put("v0000000001/manifest.dcrm", b"{}")
        assert store.get("v0000000001/manifest.dcrm") == b"{}"
        assert store.list("v0000000001/") == ["v0000000001/manifest.dcrm"]
    finally:
        store.close()
