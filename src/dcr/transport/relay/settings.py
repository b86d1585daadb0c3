"""One relay node's settings: the member list, its place in it, budgets and timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dcr.errors import ConfigError
from dcr.transport.relay.tree import parse_address

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class RelaySettings:
    """One relay node's settings. Units are in the names; why each default is what it is."""

    members: tuple[str, ...]  # every node's "host:port", tree order; member 0 is the root
    index: int  # this node's position in ``members``
    token: str = field(repr=False)  # bearer token on every endpoint but /healthz; never logged
    fanout: int = 2  # children per node: 2 keeps per-node upload fan-out at twice the input
    listen: str = "127.0.0.1:8470"  # host:port to bind; often 0.0.0.0 with a Service in front
    budget_bytes: int = GiB  # staged bytes held in memory: a few buckets of a large model
    spool_dir: Path | None = None  # staged bytes beyond the memory budget go here; None: never
    spool_budget_bytes: int = 64 * GiB  # staged bytes on disk: a whole attempt of a 70B model
    admit_timeout_s: float = 30.0  # an upload waits this long for staging space, then 503
    chunk_bytes: int = MiB  # piece size when sending staged bytes (live forwards keep theirs)
    queue_chunks: int = 16  # chunks queued per child: bounds a slow child's memory to a few MiB
    stall_timeout_s: float = 30.0  # a child taking (a sender giving) no bytes this long is cut
    connect_timeout_s: float = 2.0  # TCP connect to another member; loopback/LAN is fast
    health_interval_s: float = 0.25  # how often the parent is probed
    health_timeout_s: float = 0.5  # one probe's limit; a slower parent counts as down
    parent_timeout_s: float = 1.0  # parent down this long -> re-attach to an ancestor
    join_grace_s: float = 10.0  # at start, the time the parent may take to come up
    resync_interval_s: float = 10.0  # a child re-sends its held ids this often; gaps get filled
    retries: int = 4  # re-sends of a payload a child did not take (connection error or 5xx)
    retry_delay_s: float = 0.25  # first re-send delay; doubles each time (0.25 .. 2 s)
    max_manifest_bytes: int = 64 * MiB  # manifests are JSON; a bigger one is refused

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
        if not self.token or any(c.isspace() for c in self.token):
            raise ConfigError("Relay token is empty or contains whitespace.")
        parse_address(self.listen)
        positive = {
            "budget_bytes": self.budget_bytes,
            "spool_budget_bytes": self.spool_budget_bytes,
            "admit_timeout_s": self.admit_timeout_s,
            "chunk_bytes": self.chunk_bytes,
            "queue_chunks": self.queue_chunks,
            "stall_timeout_s": self.stall_timeout_s,
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
        if self.retries < 0 or self.retry_delay_s < 0:
            raise ConfigError(
                f"Relay retries={self.retries} and retry_delay_s={self.retry_delay_s} "
                "must not be negative."
            )
