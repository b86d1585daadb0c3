"""``dcr agent``'s settings: one rollout rank's sidecar, declared once.

The options of ``dcr agent`` are generated from :class:`AgentSettings`
(:func:`dcr.settings.add_options`), and the main job builds the argv of the agents it
starts from the same class (:func:`dcr.settings.to_argv`), so a flag or a default is
spelled here and nowhere else. Tokens are read from files or the environment, never
taken on the command line, where ``ps`` would show them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dcr.errors import ConfigError
from dcr.settings import GiB, MiB, option

AGENT_TOKEN_ENV = "DCR_AGENT_TOKEN"
RELAY_TOKEN_ENV = "DCR_RELAY_TOKEN"
SOURCES = ("store", "relay")  # where payloads come from: exactly one of these fields


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """One agent process: who it is, where it listens, where payloads come from, what it
    serves. Units are in the names (``*_bytes`` is MiB on the command line)."""

    name: str = option(doc="receiver name the coordinator uses (a pod's name: unique in "
                       "its fleet, the same across restarts)")
    listen: str = option("127.0.0.1:0", metavar="HOST:PORT",
                         doc="address of the control API; port 0 takes any free one (the "
                         "process prints the URL it got)")
    token_file: Path | None = option(None, metavar="PATH",
                                     doc="file holding the control API's bearer token: 16 "
                                     "or more printable ASCII characters, not a change-me "
                                     f"placeholder (default: ${AGENT_TOKEN_ENV})")
    state_dir: Path = option(metavar="DIR",
                             doc="where the journal lives: it tells a restarted agent which "
                             "version its weights hold, so keep it across restarts")
    store: str | None = option(None, metavar="URI",
                               doc="object store URI the owners publish to (file://, s3://)")
    relay: str | None = option(None, metavar="URL", doc="URL of this node's relay (dcr relay)")
    relay_token_file: Path | None = option(None, metavar="PATH",
                                           doc="file holding the relay's read token (it "
                                           "cannot push); checked as --token-file (default: "
                                           f"${RELAY_TOKEN_ENV})")
    model: Path = option(metavar="DIR", doc="Hugging Face checkpoint directory (config.json "
                         "+ safetensors) loaded at start")
    model_version: int = option(0, metavar="N", doc="version --model holds: 0 when a fleet "
                                "starts; a later pod starts from the committed version")
    checkpoint_root: Path | None = option(None, metavar="DIR",
                                          doc="directory every dense load (/v1/dense) must "
                                          "come from, links resolved (default: the directory "
                                          "holding --model, where the versions lie side by "
                                          "side); nothing else on the host can be loaded")
    runtime: Literal["hf", "vllm-ref"] = option(
        "hf", doc="hf: a transformers causal LM that also serves generation; vllm-ref: "
        "one tensor-parallel rank of the vLLM-layout reference runtime")
    tp_size: int = option(1, metavar="T", doc="vllm-ref: tensor-parallel ranks")
    tp_rank: int = option(0, metavar="R", doc="vllm-ref: this rank, 0..T-1")
    fp8: tuple[str, ...] = option((), metavar="MODULE",
                                  doc="vllm-ref: module suffix stored as FP8 (repeatable)")
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
    max_input_tokens: int = option(4096, metavar="N",
                                   doc="/v1/generate: input ids per request, so one request "
                                   "cannot hold the gate open for long")

    @property
    def dense_root(self) -> Path:
        """Where dense loads may come from, resolved (``checkpoint_root`` or --model's
        directory)."""
        return (self.checkpoint_root or self.model.resolve().parent).resolve()

    def __post_init__(self) -> None:
        given = [s for s in SOURCES if getattr(self, s)]
        if len(given) != 1:
            raise ConfigError(f"Agent {self.name!r}: give exactly one of --store and --relay; "
                              f"got store={self.store!r}, relay={self.relay!r}.")
        _, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"Agent {self.name!r}: --listen {self.listen!r} is not "
                              "HOST:PORT.")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"Agent {self.name!r}: --tp-rank {self.tp_rank} is outside "
                              f"0..{self.tp_size - 1} (--tp-size {self.tp_size}).")
        limits = (self.max_waits, self.max_wait_s, self.liveness_timeout_s,
                  self.max_input_tokens)
        if min(limits) <= 0:
            raise ConfigError(f"Agent {self.name!r}: max_waits, max_wait_s, "
                              "liveness_timeout_s and max_input_tokens must be positive; got "
                              f"{limits}.")
        if self.staging_bytes <= 0 or self.model_version < 0:
            raise ConfigError(f"Agent {self.name!r}: staging_bytes={self.staging_bytes} must "
                              f"be positive and --model-version {self.model_version} not "
                              "negative.")

