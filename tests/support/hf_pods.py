"""Rollout pods of ``dcr serve`` (hf) and ``dcr agent`` processes, for a trainer's own fleet.

:func:`hf_pods` starts ``n`` pods serving a Hugging Face checkpoint as version 0, each a
reference server and the agent beside it reading a file store, and yields the agents'
clients; leaving the ``with`` block kills them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from dcr.protocol.agent_api import AgentClient
from dcr.refit.launch import AgentProcess, ServeProcess


@contextlib.contextmanager
def hf_pods(root: Path, v0: Path, store: Path | str, token: str, n: int = 2
            ) -> Iterator[list[AgentClient]]:
    """``n`` pods under ``root`` serving ``v0``, their agents reading ``store`` (a file
    store's directory, or a store URI)."""
    procs: list[AgentProcess | ServeProcess] = []
    clients = []
    try:
        for k in range(n):
            pod = root / f"pod{k}"
            (pod / "staging").mkdir(parents=True)
            server = ServeProcess(name=f"serve-{k}", workdir=pod / "serve", args=[
                "--runtime", "hf", "--model", str(v0), "--staging-dir", str(pod / "staging"),
                "--checkpoint-root", str(root), "--weight-version", "0"])
            procs.append(server)
            server.start()
            server.wait_ready()
            uri = store.as_uri() if isinstance(store, Path) else store
            agent = AgentProcess(name=f"pod{k}", state_dir=pod / "agent", token=token,
                                 args=["--store", uri, "--engine-url", server.url,
                                       "--staging-dir", str(pod / "staging"),
                                       "--canonical", str(v0), "--model-version", "0"])
            procs.append(agent)
            agent.start()
            agent.wait_ready()
            clients.append(agent.client(timeout_s=120.0))
        yield clients
    finally:
        for p in procs:
            p.kill()
