"""The relay root as a write-only ``Store``: what an owner publishes goes to the tree.

``open_store("relay+http://host:port")`` gives it; the publish token comes from
``$DCR_RELAY_TOKEN``, never the URI. Each key (parsed by :mod:`dcr.format.layout`) becomes a
``PUT`` that returns once the root has queued it. Each owner's manifest part travels as its
own (relay wire 2), so an attempt may have any number of owners, trainer ranks included; a
single owner's file-level version manifest travels as owner 0's part, its attempt read from
its body.

``relay+http://root?through=s3://bucket/prefix`` also writes every object through to that
store (the fleet's store in the training cluster's region) before it goes to the root: the
store then holds every attempt beside the history the coordinator writes there, so a relay
fleet's pods catch up from the store's history while refits travel the tree
(docs/relay.md, "History and catch-up"). Reads of such a publisher are the store's.

It is also the coordinator's ``AttemptCache``: ``drop_attempts`` deletes attempts a commit
replaced at the root, which drops them at every member below (docs/relay.md, "What the
tree keeps"); the write-through store keeps them, under its own retention.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit, urlunsplit

from dcr.errors import ConfigError, ManifestError, RelayError
from dcr.format.layout import parse_manifest_key, parse_manifest_part_key, parse_payload_key
from dcr.format.manifest import manifest_attempt
from dcr.http.tokens import check_token
from dcr.transport.relay.client import BlockingRelay
from dcr.transport.store import Store, open_store

TOKEN_ENV = "DCR_RELAY_TOKEN"


def split_through(url: str) -> tuple[str, str | None]:
    """``relay+http://root[?through=URI]`` -> the root's URL and the write-through store's
    URI (None without one); ConfigError naming the value for any other query."""
    parts = urlsplit(url)
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    root = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    if not parts.query:
        return root, None
    through = query.pop("through", [])
    if query or len(through) != 1 or not through[0]:
        raise ConfigError(f"Relay URI {url!r}: the only query it takes is one "
                          "through=<store URI> (the store every object is written through to).")
    if urlsplit(through[0]).scheme.startswith("relay"):
        raise ConfigError(f"Relay URI {url!r}: through= names a store (file://, s3://), "
                          "not another relay.")
    return root, through[0]


class RelayPublisher:
    """A ``Store`` whose ``put`` streams to the relay root (and first to the write-through
    store, where the URI names one); reads are the write-through store's, else refused."""

    def __init__(self, url: str, token: str | None = None, through: Store | None = None) -> None:
        url, through_uri = split_through(url)
        self.through = through if through is not None else (
            open_store(through_uri) if through_uri is not None else None)
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
        if self.through is not None:  # durable first: the history names what the store holds
            self._check(key)
            self.through.put(key, data)
        self._put_relay(key, data)

    def _check(self, key: str) -> None:
        """Refuse a key the relay cannot carry before the store is written."""
        if parse_payload_key(key) is None and parse_manifest_part_key(key) is None \
                and parse_manifest_key(key) is None:
            raise ConfigError(f"{key!r} is neither a payload nor a manifest key; the relay "
                              "carries only those.")

    def _put_relay(self, key: str, data: bytes) -> None:
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

    def drop_attempts(self, attempts: Sequence[str]) -> None:
        """``DELETE`` each attempt at the root (it passes the DELETE to its children); every
        one is tried, then RelayError names those the root did not take."""
        failed: list[str] = []
        for attempt in attempts:
            try:
                self._run(self._client.delete_attempt(attempt))
            except RelayError as e:
                failed.append(f"{attempt} ({e})")
        if failed:
            raise RelayError(f"The relay root {self.uri} did not drop {len(failed)} of "
                             f"{len(attempts)} attempts: {'; '.join(failed)}.")

    def get(self, key: str) -> bytes:
        if self.through is not None:
            return self.through.get(key)
        raise ConfigError(f"The relay publisher {self.uri} is write-only; read {key!r} from a "
                          "relay node (RelaySource).")

    def exists(self, key: str) -> bool:
        # without a store nothing is ever known to exist: every put goes to the root
        return self.through.exists(key) if self.through is not None else False

    def list(self, prefix: str) -> list[str]:
        return self.through.list(prefix) if self.through is not None else []

    def close(self) -> None:
        self._relay.close()
