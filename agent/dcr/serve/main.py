"""``dcr serve``: the reference serving engine as a process of its own.

Options: :class:`~dcr.serve.settings.ServeSettings`; once listening it prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os

from dcr.errors import ConfigError
from dcr.http.tokens import check_token, read_token
from dcr.serve.settings import API_KEY_ENV, ServeSettings
from dcr.settings import add_options

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``dcr serve``'s options, from :class:`ServeSettings`."""
    add_options(p, ServeSettings)


def api_key(s: ServeSettings) -> str | None:
    """The checked API key from ``--api-key-file`` or ``$DCR_SERVE_API_KEY``; None when
    neither is given, which only a loopback address accepts."""
    if s.api_key_file is not None:
        key: str | None = read_token("serve API key", s.api_key_file)
    elif os.environ.get(API_KEY_ENV, "").strip():
        key = check_token(os.environ[API_KEY_ENV].strip(), f"serve API key from ${API_KEY_ENV}")
    else:
        key = None
    if key is None and not s.loopback:
        raise ConfigError(f"--listen {s.listen}: beyond loopback the server needs an API key "
                          f"(--api-key-file or ${API_KEY_ENV}); whoever reaches it can change "
                          "its weights.")
    return key


async def _serve(s: ServeSettings, key: str | None) -> None:
    from dcr.http.edge import start
    from dcr.serve.server import make_app, new_workers

    workers = new_workers(s, key)
    server = await start(make_app(s, workers, key), s.listen, "dcr serve")
    print(json.dumps({"url": server.url, "runtime": s.runtime, "ranks": s.ranks}), flush=True)
    log.info("serving %s (%s, ranks %s) on %s", s.model, s.runtime, s.ranks, server.url)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


def run(s: ServeSettings) -> int:
    key = api_key(s)
    os.environ.update(s.plugin_environment())  # what every worker's plugin reads
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(s, key))
    return 0


__all__ = ["add_arguments", "api_key", "run"]
