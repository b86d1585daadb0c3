"""``dcr agent``: one rollout pod's sidecar as a process, driving a serving engine.

It listens at once and meets the engine in the background, so a slow engine start does not
fail its probes; once listening it prints one JSON line. Options:
:class:`~dcr.receiver.settings.AgentSettings`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcr.errors import ConfigError
from dcr.http.tokens import check_token, read_token
from dcr.receiver.settings import (
    AGENT_TOKEN_ENV,
    ENGINE_KEY_ENV,
    PEER_TOKEN_ENV,
    RELAY_TOKEN_ENV,
    SOURCES,
    AgentSettings,
)
from dcr.settings import add_options, from_args

if TYPE_CHECKING:
    from dcr.drivers.base import CanonicalSpec, Driver
    from dcr.receiver.donor import Donor
    from dcr.receiver.fromstore import FromStore
    from dcr.receiver.member import MemberService
    from dcr.receiver.service import AgentService, SourceFor

ATTACH_RETRY_S = 1.0  # how often the agent tries again to meet an engine that is not up

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``dcr agent``'s options, from :class:`AgentSettings`; a store, a relay, or both."""
    add_options(p, AgentSettings, skip=SOURCES)
    sources = p.add_argument_group("where attempts come from (--store, --relay or both)")
    others = tuple(f.name for f in dataclasses.fields(AgentSettings) if f.name not in SOURCES)
    add_options(sources, AgentSettings, skip=others)


def _token(path: Path | None, env: str) -> str:
    what = "relay read token" if env == RELAY_TOKEN_ENV else "agent token"
    return read_token(what, path, env)  # one check for every token: dcr.http.tokens


def peer_token(s: AgentSettings) -> str | None:
    """The fleet's peer read token from ``--peer-token-file`` or ``$DCR_PEER_TOKEN``; None
    when neither is given (the agent then lends nothing and asks no peer)."""
    if s.peer_token_file is None and not os.environ.get(PEER_TOKEN_ENV, "").strip():
        if s.donors:
            raise ConfigError(f"Agent {s.name!r}: --donor needs the peer read token "
                              f"(--peer-token-file or ${PEER_TOKEN_ENV}).")
        return None
    return read_token("peer read token", s.peer_token_file, PEER_TOKEN_ENV)


def engine_key(s: AgentSettings) -> str | None:
    """The engine's API key from ``--engine-api-key-file`` or ``$DCR_ENGINE_API_KEY``;
    None when neither is given (an engine on loopback may have none)."""
    if s.engine_api_key_file is not None:
        return read_token("engine API key", s.engine_api_key_file)
    value = os.environ.get(ENGINE_KEY_ENV, "").strip()
    return check_token(value, f"engine API key from ${ENGINE_KEY_ENV}") if value else None


def build_engine(s: AgentSettings) -> Driver:
    """The adapter of ``--engine`` at ``--engine-url``."""
    from dcr.drivers import EngineTimeouts, SglangDriver, VllmDriver
    from dcr.http.engine_guard import admin_token
    from dcr.protocol.agent_api import DRAIN_S

    timeouts = EngineTimeouts(drain_s=DRAIN_S)  # a drain ends before the client gives up
    if s.engine == "sglang":
        return SglangDriver(s.engine_url, s.staging_dir, engine_key(s), timeouts=timeouts)
    return VllmDriver(s.engine_url, engine_key(s), timeouts=timeouts,
                      admin_token=admin_token())  # the engine's client guard's, if any


def canonical_tensors(checkpoint: Path) -> list[CanonicalSpec]:
    """The tensors a checkpoint directory's safetensors headers name (no data read)."""
    from dcr.checkpoint import Checkpoint
    from dcr.drivers.base import CanonicalSpec

    with Checkpoint(checkpoint) as ckpt:
        return [CanonicalSpec(name=i.name, dtype=i.dtype.name, shape=tuple(i.shape))
                for i in ckpt]


def _sources(s: AgentSettings) -> tuple[SourceFor, FromStore | None, list[CanonicalSpec]]:
    """Where an attempt's payloads come from (the relay where given, else the store), the
    store's history for dense loads (with a store: a relay fleet's too), and the canonical
    tensors."""
    from dcr.files.history import HistoryStore
    from dcr.format.manifest import limits_for
    from dcr.protocol.agent_api import AttemptSpec
    from dcr.receiver.fromstore import FromStore
    from dcr.transport.receive import Source, StoreSource
    from dcr.transport.store import open_store

    source_for: SourceFor
    from_store = None
    canonical = canonical_tensors(s.canonical)
    limits = limits_for(len(canonical))  # what this receiver can use, never more
    if s.store:
        store = open_store(s.store)
        from_store = FromStore(HistoryStore(store, limits=limits), s.dense_root,
                               seed=(s.start_version, s.canonical), mirror=s.mirror)

        def source_for(spec: AttemptSpec) -> Source:
            return StoreSource(store=store, version=spec.target_version, attempt=spec.attempt,
                               owners=spec.owners, limits=limits)
    if s.relay:
        from dcr.transport.relay.source import RelaySource

        relay, relay_token = s.relay, _token(s.relay_token_file, RELAY_TOKEN_ENV)

        def from_relay(spec: AttemptSpec) -> Source:
            return RelaySource(relay, relay_token, spec.attempt, limits, owners=spec.owners)

        source_for = from_relay

    return source_for, from_store, canonical


def build_service(s: AgentSettings, engine: Driver | None = None) -> AgentService:
    from dcr.receiver.group import Group
    from dcr.receiver.journal import Journal
    from dcr.receiver.member_api import MemberClient
    from dcr.receiver.service import AgentService

    source_for, from_store, canonical = _sources(s)
    token = peer_token(s)
    if s.donors and from_store is None:
        raise ConfigError(f"Agent {s.name!r}: --donor needs the store's history, which "
                          "judges a peer's copy; this agent reads none.")
    if from_store is not None and token is not None:
        from dcr.receiver.peers import PeerClient

        from_store.peers = tuple(PeerClient(url, token) for url in s.donors)
    group = None
    if s.members:
        token = (_token(s.member_token_file, AGENT_TOKEN_ENV) if s.member_token_file
                 else _token(s.token_file, AGENT_TOKEN_ENV))
        group = Group(tuple(MemberClient(url, token) for url in s.members))
    return AgentService(s.name, engine or build_engine(s), source_for,
                        canonical=canonical, staging_dir=s.staging_dir,
                        version=s.start_version, journal=Journal(s.state_dir / "journal.json"),
                        staging_bytes=s.staging_bytes, checkpoint_root=s.dense_root,
                        store=from_store,
                        max_wait_s=s.max_wait_s, pause_mode=s.pause_mode, group=group,
                        trust_labels=False)


def build_member(s: AgentSettings) -> MemberService:
    from dcr.receiver.member import MemberService

    source_for, from_store, _ = _sources(s)
    return MemberService(s.name, source_for, staging_dir=s.staging_dir,
                         staging_bytes=s.staging_bytes, store=from_store)


def attach_in_background(service: AgentService) -> threading.Thread:
    """Meet the engine (instance id, prewarm) as soon as it answers, on a thread."""
    def attach() -> None:
        while True:
            try:
                service.attach()
                return
            except Exception as e:  # not up yet, or restarting: try again
                log.info("%s: engine not ready: %s", service.name, e)
                time.sleep(ATTACH_RETRY_S)

    t = threading.Thread(target=attach, name="attach", daemon=True)
    t.start()
    return t


def _donor(service: AgentService, s: AgentSettings) -> tuple[Donor, str] | None:
    """What the agent lends peers (its build from the store), with the peer read token;
    None without a token or a store's history."""
    from dcr.receiver.donor import Donor, why_busy
    from dcr.receiver.fromstore import FROM_STORE

    token, store = peer_token(s), service.store
    if token is None or store is None or store.root is None:
        return None
    return Donor(service.name, store.root / FROM_STORE, store.leases,
                 lambda: why_busy(service)), token


async def _serve(service: AgentService, token: str, s: AgentSettings) -> None:
    from dcr.http.edge import start
    from dcr.http.gateway import DoorCounters, make_gateway
    from dcr.receiver.server import make_app

    door = DoorCounters() if s.client_listen else None
    app = make_app(service, token, max_waits=s.max_waits,
                   liveness_timeout_s=s.liveness_timeout_s,
                   more_metrics=door.families if door else None, donor=_donor(service, s))
    server = await start(app, s.listen, f"Agent {service.name!r}")
    shown: dict[str, Any] = {"url": server.url, "name": service.name,
                             "version": service.snapshot().version}
    if s.client_listen:
        gateway = make_gateway(s.engine_url, s.client_route,
                               max_connections=s.client_max_connections,
                               version=lambda: service.weights.version,
                               keep=s.pause_mode == "keep", counters=door)
        clients = await start(gateway, s.client_listen,
                              f"Agent {service.name!r}'s client door",
                              handler_cancellation=False)
        shown["client_url"] = clients.url
    print(json.dumps(shown), flush=True)
    attach_in_background(service)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


async def _serve_member(member: MemberService, token: str, s: AgentSettings) -> None:
    from dcr.http.edge import start
    from dcr.receiver.member import make_member_app

    server = await start(make_member_app(member, token), s.listen, f"Member {member.name!r}")
    print(json.dumps({"url": server.url, "name": member.name, "role": "member"}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


def run(s: AgentSettings) -> int:
    token = _token(s.token_file, AGENT_TOKEN_ENV)
    with contextlib.suppress(KeyboardInterrupt):
        if s.role == "member":
            asyncio.run(_serve_member(build_member(s), token, s))
        else:
            asyncio.run(_serve(build_service(s), token, s))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dcr agent", description=__doc__)
    add_arguments(p)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run(from_args(AgentSettings, p.parse_args(argv)))
