"""``dcr agent``'s settings: one rollout pod's sidecar, declared once.

The options and the argv of agents the main job starts both come from :class:`AgentSettings`
(:mod:`dcr.settings`). Tokens come from files or the environment, never the command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dcr.errors import ConfigError
from dcr.http.admission import CLIENT_ROUTES
from dcr.http.direct import check_url
from dcr.http.edge import host_port
from dcr.settings import GiB, MiB, option

AGENT_TOKEN_ENV = "DCR_AGENT_TOKEN"
RELAY_TOKEN_ENV = "DCR_RELAY_TOKEN"
ENGINE_KEY_ENV = "DCR_ENGINE_API_KEY"
PEER_TOKEN_ENV = "DCR_PEER_TOKEN"
SOURCES = ("store", "relay")  # where payloads come from: the relay where given, else the store


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """One agent process: who it is, where it listens, where payloads come from, which
    engine it drives. Units are in the names (``*_bytes`` is MiB on the command line)."""

    name: str = option(doc="receiver name the coordinator uses (a pod's name: unique in "
                       "its fleet, the same across restarts)")
    listen: str = option("127.0.0.1:0", metavar="HOST:PORT",
                         doc="address of the control API; port 0 takes any free one (the "
                         "process prints the URL it got)")
    client_listen: str | None = option(None, metavar="HOST:PORT",
                                       doc="where the pod's clients reach the engine: only "
                                       "--client-route requests are forwarded to "
                                       "--engine-url, so the engine's admin routes (dev "
                                       "mode's /collective_rpc, /pause) stay on loopback")
    client_route: tuple[str, ...] = option(
        CLIENT_ROUTES, metavar="'METHOD /path'",
        doc="a request clients may make through --client-listen (exact path; repeat for "
        "more; default: " + ", ".join(CLIENT_ROUTES) + ")")
    client_max_connections: int = option(
        4096, metavar="N", doc="connections the client door keeps to the engine at once, "
        "so requests in flight through it (0: no bound): far above what an engine batches "
        "(vLLM's max_num_seqs is 256 to 1024), so the engine, not the door, queues; the "
        "bound only caps the pod's sockets")
    token_file: Path | None = option(None, metavar="PATH",
                                     doc="file holding the control API's bearer token: 16 "
                                     "or more printable ASCII characters, not a change-me "
                                     f"placeholder (default: ${AGENT_TOKEN_ENV})")
    state_dir: Path = option(metavar="DIR",
                             doc="where the journal lives: it tells a restarted agent which "
                             "version its weights hold, so keep it across restarts")
    store: str | None = option(None, metavar="URI",
                               doc="object store URI the owners publish to (file://, s3://); "
                               "with --relay, the relay fleet's store holding its history, "
                               "which rejoins and catch-up read")
    relay: str | None = option(None, metavar="URL", doc="URL of this node's relay (dcr relay)")
    relay_token_file: Path | None = option(None, metavar="PATH",
                                           doc="file holding the relay's read token (it "
                                           "cannot push); checked as --token-file (default: "
                                           f"${RELAY_TOKEN_ENV})")
    role: Literal["agent", "member"] = option(
        "agent", doc="agent: drive the engine beside it (a replica's pod, or a group's "
        "leader pod); member: a worker pod of a group, which stages payloads for the "
        "leader's agent and drives no engine (docs/replica-groups.md, \"Replicas across pods\")")
    members: tuple[str, ...] = option((), flag="--member", metavar="URL",
                                      doc="a member agent of this agent's group (a worker "
                                      "pod; repeatable): each payload is applied once "
                                      "every member has staged it")
    member_token_file: Path | None = option(None, metavar="PATH",
                                            doc="file holding the members' bearer token "
                                            "(default: this agent's own token)")
    engine: Literal["vllm", "sglang"] = option(
        "vllm", doc="the serving engine beside the agent: vllm (vLLM, or dcr serve, which "
        "speaks its dialect) or sglang")
    engine_url: str = option("", metavar="URL", doc="the engine's HTTP API, e.g. "
                             "http://127.0.0.1:8000 (in the pod: loopback); required but "
                             "for a member")
    engine_api_key_file: Path | None = option(None, metavar="PATH",
                                              doc="file holding the engine's API key (SGLang: "
                                              "its admin key); checked as --token-file "
                                              f"(default: ${ENGINE_KEY_ENV}; neither: none)")
    staging_dir: Path = option(metavar="DIR",
                               doc="the directory shared with the engine (its "
                               "$DCR_STAGING_DIR; a memory-backed volume in a pod) where "
                               "verified payloads wait as files for the engine to apply")
    canonical: Path = option(metavar="DIR",
                             doc="a checkpoint directory whose safetensors headers name the "
                             "canonical tensors the engine's ranks are prewarmed with (the "
                             "one the engine started from; only headers are read)")
    model_version: int | None = option(None, metavar="N", doc="the version the engine's "
                                       "weights hold when the agent first meets it (default: "
                                       "what dcr materialize recorded in --canonical, else 0)")
    checkpoint_root: Path | None = option(None, metavar="DIR",
                                          doc="directory every dense load (/v1/dense) must "
                                          "come from, links resolved, as this container "
                                          "sees it; the engine gets the path relative to it "
                                          "and resolves it under its own $DCR_CHECKPOINT_ROOT "
                                          "(default: the directory holding --canonical, "
                                          "where the versions lie side by side)")
    mirror: Path | None = option(None, metavar="DIR",
                                 doc="a rollout-side mirror (dcr mirror --dir): a rejoin "
                                 "starts from its current generation, at local disk speed, "
                                 "where that is newer than what this pod holds (checked by "
                                 "fingerprints like any start)")
    donors: tuple[str, ...] = option((), flag="--donor", metavar="URL",
                                     doc="a peer agent's control URL (repeatable, asked in "
                                     "order): a rejoin built from the store first takes the "
                                     "copy of a committed version that peer lends, checked "
                                     "against the history's fingerprints, and falls back to "
                                     "the store; needs the peer read token")
    peer_token_file: Path | None = option(None, metavar="PATH",
                                          doc="file holding the fleet's peer read token, "
                                          "checked as --token-file (default: "
                                          f"${PEER_TOKEN_ENV}; neither: this agent lends "
                                          "nothing and asks no peer): with it, the agent "
                                          "lends its copy built from the store to peers "
                                          "(/v1/peer/*) and reads its --donor peers")
    pause_mode: Literal["wait", "abort", "keep"] = option(
        "wait", doc="how closing the gate pauses the engine: wait (requests in flight "
        "finish: the sync-RL gate), abort (they end now), keep (they freeze and continue "
        "after the refit: partial rollouts); SGLang has no wait")
    staging_bytes: int = option(GiB, unit=MiB,
                                doc="staged, unapplied payload bytes before back-pressure: "
                                "a few of the owners' buckets, so receiving runs ahead of "
                                "apply without holding a whole large attempt")
    max_waits: int = option(8, metavar="N",
                            doc="concurrent /v1/staged and /v1/flush waits; more are refused "
                            "with 503 at once: a coordinator needs one, and each holds a "
                            "thread of their own pool, never status's or stop's")
    max_wait_s: float = option(3600.0, metavar="S",
                               doc="seconds one wait may last whatever timeout_s it asks: "
                               "longer than any attempt's deadline, short enough that a "
                               "forgotten wait ends")
    liveness_timeout_s: float = option(10.0, metavar="S",
                                       doc="/healthz answers 503 when the agent's state lock "
                                       "cannot be taken within this many seconds (a wedged "
                                       "control loop); no call holds it longer than a "
                                       "journal write")

    @property
    def start_version(self) -> int:
        """``model_version``, else what ``dcr materialize`` recorded in ``canonical``."""
        from dcr.files.materialize import recorded_version

        if self.model_version is not None:
            return self.model_version
        return recorded_version(self.canonical) or 0

    @property
    def dense_root(self) -> Path:
        """Where dense loads may come from, resolved (``checkpoint_root`` or the directory
        holding --canonical)."""
        return (self.checkpoint_root or self.canonical.resolve().parent).resolve()

    def __post_init__(self) -> None:
        if not self.store and not self.relay:
            raise ConfigError(f"Agent {self.name!r}: give --store, --relay, or both (a relay "
                              "fleet's store with its history); got neither.")
        host_port(self.listen, f"Agent {self.name!r}: --listen")
        if self.client_listen is not None:
            host_port(self.client_listen, f"Agent {self.name!r}: --client-listen")
            from dcr.http.admission import parse_routes

            try:
                parse_routes(self.client_route)
            except ValueError as e:
                raise ConfigError(f"Agent {self.name!r}: {e}.") from None
        if self.engine == "sglang" and self.pause_mode == "wait":
            raise ConfigError(f"Agent {self.name!r}: SGLang cannot pause with requests in "
                              "flight finishing; give --pause-mode abort or keep.")
        if self.role == "agent" and not self.engine_url.startswith(("http://", "https://")):
            raise ConfigError(f"Agent {self.name!r}: --engine-url {self.engine_url[:80]!r} "
                              "is not an http(s) URL.")
        if self.role == "member" and (self.members or self.client_listen):
            raise ConfigError(f"Agent {self.name!r}: a member stages for its leader; "
                              "--member and --client-listen belong on the leader's agent.")
        for url in self.members:
            check_url(url, f"Agent {self.name!r}: --member")
        for url in self.donors:
            check_url(url, f"Agent {self.name!r}: --donor")
        if self.client_max_connections < 0:
            raise ConfigError(f"Agent {self.name!r}: --client-max-connections "
                              f"{self.client_max_connections} is negative (0: no bound).")
        limits = (self.max_waits, self.max_wait_s, self.liveness_timeout_s)
        if min(limits) <= 0:
            raise ConfigError(f"Agent {self.name!r}: max_waits, max_wait_s and "
                              f"liveness_timeout_s must be positive; got {limits}.")
        if self.staging_bytes <= 0 or (self.model_version or 0) < 0:
            raise ConfigError(f"Agent {self.name!r}: staging_bytes={self.staging_bytes} must "
                              f"be positive and --model-version {self.model_version} not "
                              "negative.")

