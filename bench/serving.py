"""What the client door and the engine's client guard cost: concurrent streaming
completions straight to the engine, through the agent's door (``dcr agent
--client-listen``) and to an engine with the guard inside (``vllm serve --middleware
dcr.http.engine_guard.EngineGuard``), side by side in one run.

Runs from vLLM's CPU build (``DCR_VLLM_FLAVOUR=cpu tools/engines/setup.sh``): a real
``vllm serve`` (the tests' small Llama, ``--max-num-seqs 256``) and one ``dcr serve`` of the
same checkpoint, each with a door in front of it (the door's code as the agent runs it,
in a process of its own), and a second ``vllm serve`` of the same checkpoint with the guard
(``dcr serve`` has its checks inside, so it has no guard column). For each engine and each
concurrency level (1, 64, 256, 1,024 by default) the same requests go straight to the
engine, through the door and to the guarded engine, in the order direct, door, guard,
guard, door, direct (``--rounds`` times), so a drift of the machine's load falls on all.
Per run: wall time, tokens per second, time to first token and the gap between tokens
(p50 and p99 over every request), and errors; per level: door and guard over direct
(throughput ratio, added p50 time to first token).

``dcr serve`` answers server-sent events where it streams; where it refuses
``stream=true`` the run records ``"streamed": false`` and times whole answers
(first token = the answer). Writes ``bench/results/serving.json``; nothing is judged.
``--guard-off`` starts the second ``vllm serve`` without the guard: an A/A run that shows
what the second server alone changes, which the guard's column must be read against.

    DCR_VLLM_FLAVOUR=cpu tools/engines/setup.sh --where   # the python to run this with
    $PY bench/serving.py [--levels 1,64,256,1024] [--max-tokens 16] [--rounds 1] [--guard-off]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import itertools
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "serving.json"
MAIN_PY = ROOT / ".venv" / "bin" / "python"  # dcr serve runs where torch and transformers are
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
TARGETS = {"throughput_ratio_at_least": 0.97, "added_p50_ttft_ms_at_most": 2.0}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(http: ClientSession, url: str, body: dict[str, Any], stream: bool
              ) -> dict[str, Any]:
    """One completion: its first-token time, the gaps between its tokens, its tokens."""
    start = time.perf_counter()
    stamps: list[float] = []
    async with http.post(url + "/v1/completions", json={**body, "stream": stream}) as r:
        if r.status != 200:
            return {"error": f"{r.status} {(await r.text())[:200]}"}
        if not stream:
            answer = await r.json()
            n = int(answer.get("usage", {}).get("completion_tokens") or body["max_tokens"])
            return {"ttft": time.perf_counter() - start, "gaps": [], "tokens": n}
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": str(event["error"])[:200]}
                stamps.append(time.perf_counter())
    if not stamps:
        return {"error": "no tokens"}
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - start, "gaps": gaps, "tokens": len(stamps)}


async def level(url: str, n: int, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """``n`` completions at once: the run's numbers."""
    async with ClientSession(connector=TCPConnector(limit=0),
                             timeout=ClientTimeout(total=1800)) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(http, url, {**body, "prompt": PROMPT[:4 + i % 4]},
                                                 stream) for i in range(n)))
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] * 1e3 for r in ok]
    gaps = [g * 1e3 for r in ok for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in ok)
    errors = [r["error"] for r in results if "error" in r]
    return {"requests": n, "errors": len(errors), "first_error": errors[0] if errors else None,
            "wall_s": round(wall, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1),
            "ttft_ms_p50": _r(pct(ttft, 0.5)), "ttft_ms_p99": _r(pct(ttft, 0.99)),
            "gap_ms_p50": _r(pct(gaps, 0.5)), "gap_ms_p99": _r(pct(gaps, 0.99))}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one level and path: wall and tokens summed, percentiles' medians."""
    wall, tokens = sum(r["wall_s"] for r in runs), sum(r["tokens"] for r in runs)
    out = {"runs": len(runs), "requests": runs[0]["requests"],
           "errors": sum(r["errors"] for r in runs),
           "first_error": next((r["first_error"] for r in runs if r["first_error"]), None),
           "wall_s": round(wall / len(runs), 3), "tokens_per_s": round(tokens / wall, 1)}
    for key in ("ttft_ms_p50", "ttft_ms_p99", "gap_ms_p50", "gap_ms_p99"):
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = _r(statistics.median(values)) if values else None
    return out


ORDER = ("direct", "door", "guard", "guard", "door", "direct")  # one round


def versus(path: dict[str, Any], direct: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``path`` over ``direct``: the throughput ratio and the added p50 first-token time."""
    added = (_r(path["ttft_ms_p50"] - direct["ttft_ms_p50"])
             if path["ttft_ms_p50"] is not None and direct["ttft_ms_p50"] is not None
             else None)
    return {f"{prefix}throughput_ratio": round(path["tokens_per_s"] / direct["tokens_per_s"],
                                               3),
            f"{prefix}added_ttft_ms_p50": added}


async def compare(urls: dict[str, str], levels: list[int], body: dict[str, Any],
                  stream: bool, rounds: int) -> list[dict[str, Any]]:
    """``urls``: direct, door and (where there is one) guard."""
    rows = []
    for n in levels:
        for url in urls.values():  # warm every path's connections
            await level(url, min(n, 8), body, stream)
        runs: dict[str, list[dict[str, Any]]] = {path: [] for path in urls}
        for _ in range(rounds):
            for path in (p for p in ORDER if p in urls):
                runs[path].append(await level(urls[path], n, body, stream))
        got = {path: merged(r) for path, r in runs.items()}
        row = {"concurrency": n, **got, **versus(got["door"], got["direct"], "")}
        if "guard" in got:
            row.update(versus(got["guard"], got["direct"], "guard_"))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# --- the processes ------------------------------------------------------------------------

def door_main(upstream: str) -> None:
    """The door as the agent serves it (``--client-listen``), in a process of its own."""
    from dcr.http.admission import CLIENT_ROUTES
    from dcr.http.edge import start
    from dcr.http.gateway import make_gateway

    async def go() -> None:
        door = await start(make_gateway(upstream, CLIENT_ROUTES), "127.0.0.1:0", "door",
                           handler_cancellation=False)
        print(json.dumps({"url": door.url}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(go())


def spawn(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """A process that prints ``{"url": ...}`` first; it and its URL."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return proc, json.loads(line)["url"]
    raise RuntimeError(f"{argv[:3]} exited {proc.wait()} before printing its URL")


def door(upstream: str) -> tuple[subprocess.Popen[str], str]:
    return spawn([sys.executable, __file__, "--door", upstream])


def wait_health(url: str, proc: subprocess.Popen[Any], timeout_s: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the engine exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def support() -> Any:
    """tests/support/vllm_serve.py (bench/vllm_serve.py shares its name)."""
    return importlib.import_module("vllm_serve")


def start_vllm(model: Path, work: Path, max_seqs: int, *, guard_token: str | None = None
               ) -> tuple[subprocess.Popen[bytes], str]:
    from dcr.http.engine_guard import TOKEN_FILE_ENV
    from dcr.http.tokens import write_token_file
    from dcr.refit.launch import free_port

    ENV, SERVED = support().ENV, support().SERVED  # noqa: N806 (the module's constants)

    port = free_port()
    argv = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--served-model-name", SERVED, "--dtype",
            "bfloat16", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs",
            str(max_seqs), "--disable-uvicorn-access-log",
            "--worker-extension-cls", "dcr.runtimes.vllm.DcrWorkerExtension"]
    env = {**os.environ, **ENV, "DCR_STAGING_DIR": str(work / "staging"),
           "DCR_CHECKPOINT_ROOT": str(model.parent), "VLLM_CACHE_ROOT": str(work / "cache")}
    (work / "staging").mkdir(parents=True, exist_ok=True)
    if guard_token is not None:  # the guard inside, as a pod whose clients reach it runs it
        argv += ["--middleware", "dcr.http.engine_guard.EngineGuard"]
        env[TOKEN_FILE_ENV] = str(write_token_file(work / "engine-token", guard_token))
    log = open(work / "vllm.log", "ab")  # noqa: SIM115 (owned by the process)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc)
    return proc, url


def start_dcr_serve(model: Path, work: Path, max_running: int
                    ) -> tuple[subprocess.Popen[str], str]:
    (work / "staging").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DCR_STAGING_DIR": str(work / "staging")}
    env.pop("DCR_SERVE_API_KEY", None)
    return spawn([str(MAIN_PY), "-m", "dcr", "serve", "--model", str(model),
                  "--max-running", str(max_running), "--max-tokens", "64"], env)


async def streams(url: str) -> bool:
    async with ClientSession() as http, http.post(url + "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "stream": True}) as r:
        await r.read()
        return r.status == 200


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--door", metavar="UPSTREAM", help=argparse.SUPPRESS)
    p.add_argument("--levels", default="1,64,256,1024")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1,
                   help="direct, door, guard, guard, door, direct: times")
    p.add_argument("--max-num-seqs", type=int, default=256, help="vllm serve's batch")
    p.add_argument("--engines", default="vllm,dcr-serve")
    p.add_argument("--guard-off", action="store_true",
                   help="calibration: the guard column's vllm serve runs without the guard, "
                        "so the column shows what a second server alone changes")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    if a.door:
        door_main(a.door)
        return 0
    levels = [int(x) for x in a.levels.split(",")]
    procs: list[subprocess.Popen[Any]] = []
    result: dict[str, Any] = {
        "bench": "serving", "date": time.strftime("%Y-%m-%d"),
        "command": "bench/serving.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_start": os.getloadavg()},
        "max_tokens": a.max_tokens, "levels": levels, "rounds": a.rounds,
        "guard_off": a.guard_off,
        "targets": TARGETS, "engines": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="dcr-serving-") as tmp:
            model = support().serve_versions(Path(tmp) / "ckpt", steps=0, lr=0.0)[0]
            for engine in a.engines.split(","):
                proc: subprocess.Popen[Any]
                guard: str | None = None
                if engine == "vllm":
                    guarded, guard = start_vllm(
                        model, Path(tmp) / "vllm-guard", a.max_num_seqs,
                        guard_token=None if a.guard_off else secrets.token_hex(16))
                    procs.append(guarded)
                    proc, url = start_vllm(model, Path(tmp) / "vllm", a.max_num_seqs)
                    body: dict[str, Any] = {"model": "policy", "max_tokens": a.max_tokens,
                                            "temperature": 0, "ignore_eos": True}
                    what = {"engine": f"vllm serve (CPU build), --max-num-seqs {a.max_num_seqs}"}
                else:
                    proc, url = start_dcr_serve(model, Path(tmp) / "dcr-serve", max(levels))
                    body = {"max_tokens": a.max_tokens}
                    what = {"engine": f"dcr serve (hf runtime, CPU), --max-running {max(levels)}"}
                procs.append(proc)
                door_proc, door_url = door(url)
                procs.append(door_proc)
                stream = asyncio.run(streams(url))
                print(f"{engine}: streamed={stream}", flush=True)
                urls = {"direct": url, "door": door_url, **({"guard": guard} if guard else {})}
                rows = asyncio.run(compare(urls, levels, body, stream, a.rounds))
                result["engines"][engine] = {**what, "streamed": stream, "levels": rows}
                for q in procs:
                    if q.poll() is None:
                        os.killpg(q.pid, 9)
                        q.wait()
    finally:
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, 9)
        result["machine"]["load_average_at_end"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
