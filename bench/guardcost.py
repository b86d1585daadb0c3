"""What the engine's client guard costs per request and per streamed chunk, in process.

Two ``vllm serve`` processes side by side on two cores differ by more than the guard can
(``bench/serving.py --guard-off``), so the guard's own cost is measured where nothing else
moves: the same streaming ASGI app called as uvicorn calls it, bare and wrapped in
:class:`~dcr.http.engine_guard.EngineGuard` (a client route, an ``X-DCR-Min-Version``
header it admits), alternated in blocks so a drift of the machine's load falls on both.
The app answers a completion as server-sent events, one body message per token, as
vLLM's streaming response does. Per request: the median extra microseconds over the bare
app, and that over the number of chunks. Writes ``bench/results/guard-cost.json``.

    .venv/bin/python bench/guardcost.py [--requests 2000] [--tokens 16] [--blocks 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from dcr.http.engine_guard import EngineGuard

OUT = Path(__file__).resolve().parent / "results" / "guard-cost.json"
TOKEN = "bench-engine-admin-token-0123456789"
CHUNK = b'data: {"choices":[{"text":" tok","index":0}]}\n\n'


def app_for(tokens: int) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(tokens):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    return app


SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
         "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                          (b"x-dcr-min-version", b"1")]}


async def block(app: Any, n: int) -> float:
    """Seconds per request over ``n`` requests through ``app``."""
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

    async def send(_: Any) -> None:
        return None

    start = time.perf_counter()
    for _ in range(n):
        await app(dict(SCOPE), receive, send)
    return (time.perf_counter() - start) / n


async def measure(requests: int, tokens: int, blocks: int) -> dict[str, Any]:
    bare = app_for(tokens)
    guarded = EngineGuard(bare, token=TOKEN, registry=None)
    guarded.committed = 1  # the agent set label 1: the min-version header is admitted
    await block(bare, requests // 10)  # warm both
    await block(guarded, requests // 10)
    bare_s, guard_s = [], []
    for _ in range(blocks):
        bare_s.append(await block(bare, requests))
        guard_s.append(await block(guarded, requests))
    added = [g - b for g, b in zip(guard_s, bare_s, strict=True)]
    return {"bare_us_per_request": round(statistics.median(bare_s) * 1e6, 2),
            "guard_us_per_request": round(statistics.median(guard_s) * 1e6, 2),
            "added_us_per_request": round(statistics.median(added) * 1e6, 2),
            "added_us_per_chunk": round(statistics.median(added) * 1e6 / (tokens + 1), 3),
            "added_us_per_request_range": [round(min(added) * 1e6, 2),
                                           round(max(added) * 1e6, 2)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="requests per block")
    p.add_argument("--tokens", type=int, default=16, help="streamed chunks per request")
    p.add_argument("--blocks", type=int, default=10, help="bare, guard: times")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    load = os.getloadavg()
    got = asyncio.run(measure(a.requests, a.tokens, a.blocks))
    result = {"bench": "guard-cost", "date": time.strftime("%Y-%m-%d"),
              "command": "bench/guardcost.py " + " ".join(sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_average_at_start": load,
                          "load_average_at_end": os.getloadavg()},
              "requests_per_block": a.requests, "tokens": a.tokens, "blocks": a.blocks,
              **got}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
