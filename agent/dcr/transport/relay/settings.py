"""One relay node's settings: the member list, its place in it, budgets and timings.

``dcr relay``'s options are generated from :class:`RelaySettings`, except those in
:data:`EDGE_PARSED`: ``--members`` is a comma list, and the two tokens come from files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcr.errors import ConfigError
from dcr.http.tokens import check_token
from dcr.settings import GiB, MiB, option
from dcr.transport.relay.tree import parse_address

# On the command line as a comma list and two token files.
EDGE_PARSED = ("members", "token", "publish_token")


def _secret(doc: str) -> Any:
    """A required field kept out of ``repr`` (and so out of logs) and off the command line."""
    f = option(doc=doc, cli=False)
    f.repr = False
    return f


@dataclass(frozen=True, kw_only=True)
class RelaySettings:
    """One relay node's settings. Units are in the names; each doc says why its default."""

    members: tuple[str, ...] = option(cli=False, doc="every node's host:port, in tree "
                                      "order; member 0 is the root")
    index: int = option(metavar="I", doc="this node's position in the members list")
    token: str = _secret("read token: bearer token for GET endpoints (agents' reads); "
                         "never logged")
    publish_token: str = _secret("publish token: bearer token for PUT, DELETE and "
                                 "subscribe (owners, and members forwarding to each other); "
                                 "also reads; never logged")
    fanout: int = option(2, metavar="K", doc="children per node: 2 keeps a node's upload "
                         "fan-out at twice its input")
    listen: str = option("127.0.0.1:8470", metavar="HOST:PORT", doc="address to bind; often "
                         "0.0.0.0 with a Service in front")
    budget_bytes: int = option(GiB, unit=MiB, doc="staged bytes held in memory: a few "
                               "buckets of a large model")
    spool_dir: Path | None = option(None, flag="--spool", metavar="DIR",
                                    doc="directory for staged bytes beyond the memory "
                                    "budget (default: none, such uploads wait)")
    spool_budget_bytes: int = option(64 * GiB, unit=MiB, doc="staged bytes held in the "
                                     "spool: a whole attempt of a 70B model")
    admit_timeout_s: float = option(30.0, metavar="S", doc="seconds an upload waits for "
                                    "staging space before 503 (the owner retries)")
    chunk_bytes: int = option(MiB, metavar="BYTES", doc="piece size in bytes when sending "
                              "staged bytes (live forwards keep the sender's pieces)")
    queue_chunks: int = option(16, metavar="N", doc="chunks queued per child: bounds a slow "
                               "child's memory to a few MiB")
    stall_timeout_s: float = option(30.0, metavar="S", doc="seconds a child may take (a "
                                    "sender may give) no bytes before it is cut")
    min_upload_bytes_per_s: int = option(MiB, metavar="BYTES", doc="slowest average rate, "
                                         "in bytes per second, an upload may arrive at: it "
                                         "must end within size / rate seconds plus "
                                         "stall_timeout_s per child and one more, so a "
                                         "sender trickling a byte at a time cannot hold its "
                                         "reserved budget for long (1 MiB/s: a 256 MiB "
                                         "bucket gets over 4 minutes)")
    connect_timeout_s: float = option(2.0, metavar="S", doc="seconds for a TCP connect to "
                                      "another member; loopback and LAN are fast")
    health_interval_s: float = option(0.25, metavar="S", doc="seconds between probes of "
                                      "the parent")
    health_timeout_s: float = option(2.0, metavar="S", doc="seconds one probe of the parent "
                                     "(or of an ancestor to re-attach to) may take before it "
                                     "counts as failed: a dead member refuses at once, so "
                                     "this only waits on a hung or starved one, and a busy "
                                     "host can take over a second to answer on loopback")
    parent_timeout_s: float = option(5.0, metavar="S", doc="seconds the parent may go "
                                     "without a successful probe before this node "
                                     "re-attaches to an ancestor: more than two timed-out "
                                     "probes, so one stall does not move a member")
    join_grace_s: float = option(10.0, metavar="S", doc="seconds the parent may take to come "
                                 "up when the node starts")
    resync_interval_s: float = option(10.0, metavar="S", doc="seconds between a node's "
                                      "reports of the ids it holds to its parent, which "
                                      "re-sends what it missed")
    retries: int = option(4, metavar="N", doc="re-sends of a payload a child did not take "
                          "(connection error or 5xx)")
    retry_delay_s: float = option(0.25, metavar="S", doc="seconds before the first re-send; "
                                  "doubles each time (0.25 .. 2 s)")
    keep_attempts: int = option(8, metavar="N", doc="attempts a node holds at most: before "
                                "the first blob of one more, it evicts the oldest that no "
                                "receiver is reading and no upload or forward is carrying; "
                                "a backstop for the coordinator's drop of replaced attempts "
                                "(a committer that died), twice the attempts one refit "
                                "tries by default (4)")
    max_manifest_bytes: int = option(64 * MiB, unit=MiB, doc="largest manifest accepted "
                                     "(as the manifest reader's own limit); manifests take "
                                     "about 40 bytes per tensor, far less")

    def __post_init__(self) -> None:
        n = len(self.members)
        if n == 0:
            raise ConfigError("Relay members list is empty.")
        for m in self.members:
            parse_address(m)
        if len(set(self.members)) != n:
            raise ConfigError(f"Relay members {list(self.members)} list an address twice.")
        if not 0 <= self.index < n:
            raise ConfigError(f"Relay index {self.index} is outside 0..{n - 1}.")
        if self.fanout < 1:
            raise ConfigError(f"Relay fan-out {self.fanout} must be at least 1.")
        check_token(self.token, "relay read token")
        check_token(self.publish_token, "relay publish token")
        if self.token == self.publish_token:
            raise ConfigError("The relay read and publish tokens are the same; a reader could "
                              "then push. Give each its own random secret.")
        parse_address(self.listen)
        positive = {
            "budget_bytes": self.budget_bytes,
            "spool_budget_bytes": self.spool_budget_bytes,
            "admit_timeout_s": self.admit_timeout_s,
            "chunk_bytes": self.chunk_bytes,
            "queue_chunks": self.queue_chunks,
            "stall_timeout_s": self.stall_timeout_s,
            "min_upload_bytes_per_s": self.min_upload_bytes_per_s,
            "connect_timeout_s": self.connect_timeout_s,
            "health_interval_s": self.health_interval_s,
            "health_timeout_s": self.health_timeout_s,
            "parent_timeout_s": self.parent_timeout_s,
            "join_grace_s": self.join_grace_s,
            "resync_interval_s": self.resync_interval_s,
            "max_manifest_bytes": self.max_manifest_bytes,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"Relay setting {name}={value} must be positive.")
        if self.keep_attempts < 2:
            raise ConfigError(f"Relay keep_attempts={self.keep_attempts} must be at least 2: "
                              "the committed attempt and the one arriving.")
        if self.retries < 0 or self.retry_delay_s < 0:
            raise ConfigError(
                f"Relay retries={self.retries} and retry_delay_s={self.retry_delay_s} "
                "must not be negative."
            )


__all__ = ["EDGE_PARSED", "GiB", "MiB", "RelaySettings"]
