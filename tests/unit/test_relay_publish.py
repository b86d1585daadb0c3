"""The relay root as a store: keys map to relay calls; what a relay cannot carry is refused."""

from __future__ import annotations

import pytest

from dcr.errors import ConfigError
from dcr.transport.relay.publish import RelayPublisher
from dcr.transport.store import open_store


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
