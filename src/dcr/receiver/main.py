"""``dcr agent``: one rollout rank's sidecar as a process, serving a local model.

The embedded runtimes load a Hugging Face checkpoint directory (``config.json`` and
safetensors) through their own loaders: ``hf`` (a transformers causal LM, which also
serves greedy generation behind the request gate) or ``vllm-ref`` (the vLLM-layout
reference runtime on one tensor-parallel rank). Payloads come from an object store
(``--store``) or a relay node (``--relay``). Once listening, the process prints one
JSON line ``{"url": ..., "name": ..., "version": ...}`` on stdout. The options are
:class:`~dcr.receiver.settings.AgentSettings`, declared there once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dcr.errors import ConfigError
from dcr.receiver.settings import AGENT_TOKEN_ENV, RELAY_TOKEN_ENV, SOURCES, AgentSettings
from dcr.settings import add_options, from_args
from dcr.tokens import read_token

if TYPE_CHECKING:  # torch loads only when an agent runs, not for ``dcr --help``
    from dcr.receiver.service import AgentService

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``dcr agent``'s options, from :class:`AgentSettings`; one payload source required."""
    add_options(p, AgentSettings, skip=SOURCES)
    sources = p.add_mutually_exclusive_group(required=True)
    others = tuple(f.name for f in dataclasses.fields(AgentSettings) if f.name not in SOURCES)
    add_options(sources, AgentSettings, skip=others)


def _token(path: Path | None, env: str) -> str:
    what = "relay read token" if env == RELAY_TOKEN_ENV else "agent token"
    return read_token(what, path, env)  # one check for every token: dcr.tokens


def build_service(s: AgentSettings) -> AgentService:
    from dcr.apply.engine import CanonicalTensor
    from dcr.checkpoint import Checkpoint
    from dcr.protocol.agent_api import AttemptSpec
    from dcr.receiver.host import RuntimeHost
    from dcr.receiver.journal import Journal
    from dcr.receiver.service import AgentService, SourceFor
    from dcr.runtimes import build_runtime
    from dcr.transport.receive import Source, StoreSource
    from dcr.transport.store import open_store

    runtime = build_runtime(s.runtime, s.model, tp_size=s.tp_size, tp_rank=s.tp_rank,
                            fp8=s.fp8)
    with Checkpoint(s.model) as ckpt:
        canonical = [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=i.shape)
                     for i in ckpt]
    host = RuntimeHost(runtime, canonical)
    host.load_dense(s.model)
    source_for: SourceFor
    if s.store:
        store = open_store(s.store)

        def source_for(spec: AttemptSpec) -> Source:
            return StoreSource(store=store, version=spec.target_version, attempt=spec.attempt,
                               owners=spec.owners)
    else:
        from dcr.transport.relay.source import RelaySource

        relay, relay_token = s.relay, _token(s.relay_token_file, RELAY_TOKEN_ENV)
        assert relay is not None  # AgentSettings holds exactly one source

        def source_for(spec: AttemptSpec) -> Source:
            if spec.owners != 1:
                raise ConfigError(f"The relay carries one owner's manifest; attempt "
                                  f"{spec.attempt} has {spec.owners} owners.")
            return RelaySource(relay, relay_token, spec.attempt)

    return AgentService(s.name, host, source_for, version=s.model_version,
                        journal=Journal(s.state_dir / "journal.json"),
                        staging_bytes=s.staging_bytes, checkpoint_root=s.dense_root,
                        max_wait_s=s.max_wait_s)


async def _serve(service: AgentService, token: str, s: AgentSettings) -> None:
    from aiohttp import web

    from dcr.receiver.server import make_app

    host, _, port = s.listen.rpartition(":")
    app = make_app(service, token, max_waits=s.max_waits,
                   liveness_timeout_s=s.liveness_timeout_s,
                   max_input_tokens=s.max_input_tokens)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host or "127.0.0.1", int(port))
    await site.start()
    bound = runner.addresses[0][1]
    print(json.dumps({"url": f"http://{host or '127.0.0.1'}:{bound}", "name": service.name,
                      "version": service.status().version}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run(s: AgentSettings) -> int:
    token = _token(s.token_file, AGENT_TOKEN_ENV)
    service = build_service(s)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(service, token, s))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dcr agent", description=__doc__)
    add_arguments(p)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(from_args(AgentSettings, p.parse_args(argv)))
