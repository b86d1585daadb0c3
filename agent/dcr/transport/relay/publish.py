"""The relay root as a write-only ``Store``: what an owner publishes goes to the tree.

``open_store("relay+http://host:port")`` gives it; the publish token comes from
``$DCR_RELAY_TOKEN``, never the URI. Each key (parsed by :mod:`dcr.format.layout`) becomes a
``PUT`` that returns once the root has queued it. Each owner's manifest part travels as its
own (relay wire 2), so an attempt may have any number of owners, trainer ranks included; a
single owner's file-level version manifest travels as owner 0's part, its attempt read from
its body.
"""

from __future__ import annotations

import os

from dcr.errors import ConfigError, ManifestError
from dcr.format.layout import parse_manifest_key, parse_manifest_part_key, parse_payload_key
from dcr.format.manifest import manifest_attempt
from dcr.http.tokens import check_token
from dcr.transport.relay.client import BlockingRelay

TOKEN_ENV = "DCR_RELAY_TOKEN"


class RelayPublisher:
    """A ``Store`` whose ``put`` streams to the relay root; reads are not offered."""

    def __init__(self, url: str, token: str | None = None) -> None:
        source = "relay publish token" if token is not None else (
            f"relay publish token from ${TOKEN_ENV}")
        token = token if token is not None else os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise ConfigError(f"Publishing to the relay at {url} needs its bearer token in "
                              f"${TOKEN_ENV} (the relay's publish token).")
        check_token(token, source)
        self.uri = url
        self._relay = BlockingRelay(url.replace("relay+", "", 1), token, name="relay-publish")
        self._run, self._client = self._relay.run, self._relay.client

    def put(self, key: str, data: bytes) -> None:
        if (p := parse_payload_key(key)) is not None:
            self._run(self._client.put_payload(p.attempt, p.owner, p.seq, data))
        elif (part := parse_manifest_part_key(key)) is not None:
            self._run(self._client.put_manifest(part.attempt, data, part.owner))
        elif parse_manifest_key(key) is not None:
            try:
                attempt = manifest_attempt(data, key)
            except ManifestError as e:
                raise ConfigError(f"{key} is not a manifest naming its attempt: {e}") from e
            self._run(self._client.put_manifest(attempt, data))
        else:
            raise ConfigError(f"{key!r} is neither a payload nor a manifest key; the relay "
                              "carries only those.")

    def get(self, key: str) -> bytes:
        raise ConfigError(f"The relay publisher {self.uri} is write-only; read {key!r} from a "
                          "relay node (RelaySource).")

    def exists(self, key: str) -> bool:
        return False  # nothing is ever known to exist: every put goes to the root

    def list(self, prefix: str) -> list[str]:
        return []

    def close(self) -> None:
        self._relay.close()
