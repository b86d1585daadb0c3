"""``dcr agent``: one rollout rank's sidecar as a process, serving a local model.

The embedded runtimes load a Hugging Face checkpoint directory (``config.json`` and
safetensors) through their own loaders: ``hf`` (a transformers causal LM, which also
serves greedy generation behind the request gate) or ``vllm-ref`` (the vLLM-layout
reference runtime on one tensor-parallel rank). Payloads come from an object store
(``--store``) or a relay node (``--relay``). Once listening, the process prints one
JSON line ``{"url": ..., "name": ..., "version": ...}`` on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dcr.errors import ConfigError

if TYPE_CHECKING:  # torch loads only when an agent runs, not for ``dcr --help``
    from dcr.receiver.service import AgentService

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="receiver name the coordinator uses")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free one)")
    p.add_argument("--token-file", type=Path,
                   help="file holding the bearer token (default: $DCR_AGENT_TOKEN)")
    p.add_argument("--state-dir", type=Path, required=True, help="where the journal lives")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--store", help="object store URI the owners publish to")
    src.add_argument("--relay", help="URL of this node's relay (dcr relay)")
    p.add_argument("--relay-token-file", type=Path, help="bearer token of the relay")
    p.add_argument("--model", type=Path, required=True,
                   help="Hugging Face checkpoint directory (config.json + safetensors)")
    p.add_argument("--model-version", type=int, default=0, help="version --model holds")
    p.add_argument("--runtime", choices=("hf", "vllm-ref"), default="hf")
    p.add_argument("--tp-size", type=int, default=1, help="vllm-ref: tensor-parallel ranks")
    p.add_argument("--tp-rank", type=int, default=0, help="vllm-ref: this rank")
    p.add_argument("--fp8", action="append", default=[],
                   help="vllm-ref: module suffix stored as FP8 (repeatable)")
    p.add_argument("--staging-mib", type=int, default=1024,
                   help="staged, unapplied payload bytes before back-pressure")


def _token(path: Path | None, env: str) -> str:
    token = path.read_text().strip() if path else os.environ.get(env, "")
    if len(token) < 16:
        raise ConfigError(f"The bearer token (from {path or '$' + env}) must be at least 16 "
                          f"characters; got {len(token)}.")
    return token


def build_service(args: argparse.Namespace) -> AgentService:
    from dcr.apply.engine import CanonicalTensor
    from dcr.checkpoint import Checkpoint
    from dcr.protocol.agent_api import AttemptSpec
    from dcr.receiver.host import RuntimeHost
    from dcr.receiver.journal import Journal
    from dcr.receiver.service import AgentService, SourceFor
    from dcr.runtimes import build_runtime
    from dcr.transport.receive import Source, StoreSource
    from dcr.transport.store import open_store

    runtime = build_runtime(args.runtime, args.model, tp_size=args.tp_size,
                            tp_rank=args.tp_rank, fp8=tuple(args.fp8))
    with Checkpoint(args.model) as ckpt:
        canonical = [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=i.shape)
                     for i in ckpt]
    host = RuntimeHost(runtime, canonical)
    host.load_dense(args.model)
    source_for: SourceFor
    if args.store:
        store = open_store(args.store)

        def source_for(spec: AttemptSpec) -> Source:
            return StoreSource(store=store, version=spec.target_version, attempt=spec.attempt,
                               owners=spec.owners)
    else:
        from dcr.transport.relay.source import RelaySource

        relay_token = _token(args.relay_token_file, "DCR_RELAY_TOKEN")

        def source_for(spec: AttemptSpec) -> Source:
            if spec.owners != 1:
                raise ConfigError(f"The relay carries one owner's manifest; attempt "
                                  f"{spec.attempt} has {spec.owners} owners.")
            return RelaySource(args.relay, relay_token, spec.attempt)

    return AgentService(args.name, host, source_for, version=args.model_version,
                        journal=Journal(args.state_dir / "journal.json"),
                        staging_bytes=args.staging_mib << 20)


async def _serve(service: AgentService, token: str, listen: str) -> None:
    from aiohttp import web

    from dcr.receiver.server import make_app

    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(make_app(service, token), access_log=None)
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


def run(args: argparse.Namespace) -> int:
    token = _token(args.token_file, "DCR_AGENT_TOKEN")
    service = build_service(args)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(service, token, args.listen))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dcr agent", description=__doc__)
    add_arguments(p)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(p.parse_args(argv))
