"""``dcr serve``'s settings: the reference serving engine, declared once.

``--staging-dir`` and ``--checkpoint-root`` set ``$DCR_STAGING_DIR`` and
``$DCR_CHECKPOINT_ROOT``, which the plugin reads in every worker, as in vLLM's.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dcr.errors import ConfigError
from dcr.http.direct import check_url
from dcr.http.edge import host_port
from dcr.settings import option

API_KEY_ENV = "DCR_SERVE_API_KEY"
STAGING_ENV = "DCR_STAGING_DIR"
CHECKPOINT_ROOT_ENV = "DCR_CHECKPOINT_ROOT"


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """One reference server: which model, where it listens, what it accepts."""

    runtime: Literal["hf", "vllm-ref"] = option(
        "hf", doc="hf: a transformers causal LM (serves completions); vllm-ref: the "
        "vLLM-layout reference model (weights and loader only, no forward pass)")
    model: Path = option(metavar="DIR", doc="Hugging Face checkpoint directory (config.json "
                         "+ safetensors) loaded densely at start")
    listen: str = option("127.0.0.1:0", metavar="HOST:PORT",
                         doc="address of the HTTP API; port 0 takes any free one (the "
                         "process prints the URL it got); beyond loopback only with an "
                         "API key")
    device: Literal["cpu", "cuda"] = option(
        "cpu", doc="where the model's weights live (hf only: cuda holds them on the "
        "current CUDA device, and DCR's plugin applies there)")
    tp_size: int = option(1, metavar="T", doc="vllm-ref: tensor-parallel ranks")
    tp_rank: int | None = option(None, metavar="R",
                                 doc="vllm-ref: hold only this rank (default: every rank "
                                 "of --tp-size, each a worker in this process)")
    pp_size: int = option(1, metavar="P",
                          doc="vllm-ref: pipeline stages, each of --tp-size ranks, every "
                          "one a worker in this process; rank = stage * tp-size + TP rank, "
                          "as vLLM numbers them")
    expert_parallel: bool = option(False, doc="vllm-ref: split a MoE model's experts "
                                   "across the --tp-size ranks (each holds whole experts, "
                                   "vLLM's --enable-expert-parallel) instead of sharding every "
                                   "expert")
    peers: tuple[str, ...] = option((), flag="--peer", metavar="URL",
                                    doc="another dcr serve holding more ranks of this "
                                    "replica (a worker pod of a group; repeatable): plugin "
                                    "calls reach its ranks too, with this server's API "
                                    "key; the completions and the gate stay here")
    fp8: tuple[str, ...] = option((), metavar="MODULE",
                                  doc="vllm-ref: module suffix stored as FP8 (repeatable)")
    api_key_file: Path | None = option(None, metavar="PATH",
                                       doc="file holding the API key every call but "
                                       "/health must carry as a bearer token (default: "
                                       f"${API_KEY_ENV}; neither: no key is checked)")
    staging_dir: Path | None = option(None, metavar="DIR",
                                      doc="where staged payloads are read from: sets "
                                      f"${STAGING_ENV} for the plugin (default: "
                                      f"${STAGING_ENV} as set)")
    checkpoint_root: Path | None = option(None, metavar="DIR",
                                          doc="where dense loads come from: sets "
                                          f"${CHECKPOINT_ROOT_ENV} for the plugin (default: "
                                          f"${CHECKPOINT_ROOT_ENV} as set, else the "
                                          "directory holding --model)")
    weight_version: str = option("default", metavar="LABEL",
                                 doc="the weight-version label at start, as "
                                 "/update_weight_version would set it (vLLM starts with "
                                 "'default')")
    max_running: int = option(8, metavar="N",
                              doc="completions in flight at once; one more is answered "
                              "503 at once (each holds a thread)")
    max_input_tokens: int = option(4096, metavar="N",
                                   doc="prompt token ids per completion")
    max_tokens: int = option(256, metavar="N",
                             doc="the largest max_tokens a completion may ask for, so one "
                             "request cannot hold a drain for long")
    min_step_s: float = option(0.0, metavar="S",
                               doc="seconds one generation step takes at least (0: as fast "
                               "as the model): lets a test or a demo catch a tiny model's "
                               "completion in flight")
    max_body_bytes: int = option(64 << 20, cli=False,
                                 doc="bytes of one request body: a prewarm or a dense load "
                                 "of a large model lists every tensor")

    def __post_init__(self) -> None:
        host_port(self.listen, "--listen")
        if self.runtime == "hf" and (self.tp_size != 1 or self.pp_size != 1 or self.fp8
                                     or self.expert_parallel):
            raise ConfigError(f"--runtime hf holds one rank in BF16; --tp-size {self.tp_size}, "
                              f"--pp-size {self.pp_size}, --fp8 {list(self.fp8)} and "
                              "--expert-parallel are for vllm-ref.")
        if self.tp_rank is not None and self.pp_size != 1:
            raise ConfigError(f"--tp-rank {self.tp_rank} holds one rank of one stage; with "
                              f"--pp-size {self.pp_size} this process holds every rank.")
        if self.tp_rank is not None and not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"--tp-rank {self.tp_rank} is outside 0..{self.tp_size - 1} "
                              f"(--tp-size {self.tp_size}).")
        for url in self.peers:
            check_url(url, "--peer")
        if self.min_step_s < 0:
            raise ConfigError(f"--min-step-s {self.min_step_s} is negative.")
        limits = (self.tp_size, self.pp_size, self.max_running, self.max_input_tokens,
                  self.max_tokens, self.max_body_bytes)
        if min(limits) <= 0:
            raise ConfigError("tp_size, pp_size, max_running, max_input_tokens, max_tokens "
                              f"and max_body_bytes must be positive; got {limits}.")

    @property
    def host(self) -> str:
        return host_port(self.listen, "--listen")[0]

    @property
    def port(self) -> int:
        return host_port(self.listen, "--listen")[1]

    @property
    def loopback(self) -> bool:
        host = self.host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    @property
    def ranks(self) -> list[int]:
        """The ranks this process holds (stage * tp_size + TP rank)."""
        if self.tp_rank is not None:
            return [self.tp_rank]
        return list(range(self.tp_size * self.pp_size))

    def plugin_environment(self) -> dict[str, str]:
        """``$DCR_STAGING_DIR`` and ``$DCR_CHECKPOINT_ROOT`` as the plugin must see them
        (the options win over the environment), or :class:`ConfigError`."""
        staging = self.staging_dir or _env_path(STAGING_ENV)
        if staging is None:
            raise ConfigError(f"No staging directory: give --staging-dir or set ${STAGING_ENV} "
                              "(the directory the agent stages payloads in).")
        root = self.checkpoint_root or _env_path(CHECKPOINT_ROOT_ENV) or self.model.parent
        for what, path in (("staging directory", staging), ("checkpoint root", root)):
            if not path.resolve().is_dir():
                raise ConfigError(f"The {what} {str(path)!r} is not a directory.")
        return {STAGING_ENV: str(staging.resolve()), CHECKPOINT_ROOT_ENV: str(root.resolve())}


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name, "")
    return Path(value) if value else None


__all__ = ["API_KEY_ENV", "CHECKPOINT_ROOT_ENV", "STAGING_ENV", "ServeSettings"]
