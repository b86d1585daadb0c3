"""The gate's pause as a rollout sees it, and what recording per-token versions costs.

For each pause mode (``wait``, ``abort``, ``keep``) a real refit lands on ``dcr serve`` behind
``dcr agent --pause-mode MODE`` (``dcr encode`` owners, the coordinator ``dcr refit`` runs,
as tests/integration/test_reference_server.py drives them) while a rollout streams through
the agent's client door: completions of ``--chunk`` tokens, each continuing the last from
where it stopped, ``--tokens`` in all. A request the closed gate refuses (``wait``,
``abort``: 503) is sent again every 10 ms; one the pause ends (``abort``) is continued from
its last token. Per mode: the longest gap between two of the rollout's tokens (the pause as
it sees it) beside the usual one, how long the gate was closed (``close_gate`` called to
``open_gate`` answered), the refusals and aborts, and whether the tokens' versions switch
from 1 to 2.

Then the cost of the spans: ``dcr serve`` records the label with every token whether or not
a request asks for it, so asking (``return_weight_versions``) adds building and sending the
spans. Measured two ways: whole completions with and without asking, alternated, and the
recording itself in process against one decode step. Writes ``bench/results/pause.json``;
nothing is judged.

    .venv/bin/python bench/pause.py [--tokens 240] [--chunk 16] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from replica_group import export_llama_versions
from transformers import LlamaConfig

from dcr.client import read_events, token_versions
from dcr.refit.launch import AgentProcess, ServeProcess, free_port
from dcr.serve.completions import spans
from serving import pct, support

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "pause.json"
LLAMA = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False)  # the reference-server tests' model
PROMPT = [1, 2, 3]
MODES = ("wait", "abort", "keep")
RETRY_S = 0.01
TARGETS = {"spans_cost_fraction_at_most": 0.01}


@dataclass(eq=False)
class Rollout:
    """A rollout streamed in a thread through ``url``: every token's arrival time."""

    url: str
    tokens: int
    chunk: int
    stamps: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    refused: int = 0
    aborted: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while len(self.ids) < self.tokens:
                self._segment(min(self.chunk, self.tokens - len(self.ids)))
        except Exception as e:  # reported, not raised: the bench records what it saw
            self.error = f"{type(e).__name__}: {e}"

    def _segment(self, n: int) -> None:
        host, _, port = self.url.removeprefix("http://").partition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            conn.request("POST", "/v1/completions", json.dumps({
                "prompt": PROMPT + self.ids, "max_tokens": n, "stream": True,
                "return_weight_versions": True}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status == 503:  # the gate is closed: ask again
                resp.read()
                self.refused += 1
                time.sleep(RETRY_S)
                return
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
            chunks = []
            for line in resp:
                for chunk in read_events([line]):
                    chunks.append(chunk)
                    got = chunk["choices"][0]["token_ids"]
                    self.stamps.extend(time.perf_counter() for _ in got)
                    self.ids.extend(got)
            self.versions.extend(token_versions(chunks))
            self.aborted += chunks[-1]["choices"][0]["finish_reason"] == "abort"
        finally:
            conn.close()

    def join(self) -> Rollout:
        self.thread.join(600)
        return self


class Stamped:
    """The agent's client as the coordinator calls it; ``close_gate`` first waits until
    the rollout is under way, and the gate's closing and reopening are timed."""

    def __init__(self, client: Any, before: Callable[[], None]) -> None:
        self._client, self._before = client, before
        self.closed_at = self.opened_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def close_gate(self) -> Any:
        self._before()
        self.closed_at = time.perf_counter()
        return self._client.close_gate()

    def open_gate(self) -> Any:
        answer = self._client.open_gate()
        self.opened_at = time.perf_counter()
        return answer


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def one_mode(mode: str, dirs: list[Path], work: Path, a: argparse.Namespace
             ) -> dict[str, Any]:
    """Refit 0 -> 1 (warm), then 1 -> 2 with the rollout in flight; what it saw."""
    staging = work / "staging"
    staging.mkdir(parents=True)
    serve = ServeProcess(name="engine", workdir=work / "serve", args=[
        "--runtime", "hf", "--model", str(dirs[0]), "--staging-dir", str(staging),
        "--checkpoint-root", str(dirs[0].parent), "--weight-version", "0",
        "--min-step-s", str(a.step_ms / 1e3)])
    door = f"http://127.0.0.1:{free_port()}"
    agent = AgentProcess(name="rollout-0", state_dir=work / "agent",
                         token="agent-bench-token-0123456789abcdef", args=[
                             "--store", (work / "store").as_uri(), "--engine-url", serve.url,
                             "--staging-dir", str(staging), "--canonical", str(dirs[0]),
                             "--model-version", "0", "--pause-mode", mode,
                             "--client-listen", door.removeprefix("http://")])
    rollouts: list[Rollout] = []
    try:
        serve.start()
        serve.wait_ready()
        agent.start()
        agent.wait_ready()
        client = agent.client(timeout_s=300)

        def start_rollout() -> None:
            rollouts.append(Rollout(door, a.tokens, a.chunk))
            while len(rollouts[0].ids) < 8 and rollouts[0].error is None:
                time.sleep(0.005)

        _, coordinator = support().refitter(work, dirs, client, work / "store")
        coordinator.refit(1, str(dirs[1]))
        stamped = Stamped(client, start_rollout)
        coordinator.receivers = [stamped]
        coordinator.refit(2, str(dirs[2]))
        coordinator.close()
        r = rollouts[0].join()
    finally:
        agent.kill()
        serve.kill()
    gaps = [b - x for x, b in zip(r.stamps, r.stamps[1:], strict=False)]
    return {"mode": mode, "tokens": len(r.ids), "error": r.error,
            "longest_gap_ms": ms(max(gaps, default=None)),
            "gap_ms_p50": ms(pct(gaps, 0.5)),
            "gate_closed_ms": ms(stamped.opened_at - stamped.closed_at),
            "refused": r.refused, "aborted": r.aborted,
            "versions": sorted(set(r.versions), key=int),
            "switch_at_token": r.versions.index("2") if "2" in r.versions else None}


def spans_cost(dirs: list[Path], work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Whole completions with and without ``return_weight_versions`` (alternated, no step
    floor), and the per-token recording timed in process against a decode step."""
    (work / "cost-staging").mkdir()
    serve = ServeProcess(name="engine", workdir=work / "cost", args=[
        "--runtime", "hf", "--model", str(dirs[0]), "--staging-dir", str(work / "cost-staging"),
        "--checkpoint-root", str(dirs[0].parent)])
    times: dict[bool, list[float]] = {False: [], True: []}
    body = {"prompt": PROMPT, "max_tokens": a.cost_tokens}
    try:
        serve.start()
        serve.wait_ready()
        host, _, port = serve.url.removeprefix("http://").partition(":")
        for i in range(2 * a.cost_rounds + 2):
            ask = i % 4 in (1, 2)  # off, on, on, off: a drift falls on both
            conn = http.client.HTTPConnection(host, int(port), timeout=300)
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(
                {**body, "return_weight_versions": ask}), {"Content-Type": "application/json"})
            answer = json.loads(conn.getresponse().read())
            took = time.perf_counter() - t0
            conn.close()
            assert len(answer["choices"][0]["token_ids"]) == a.cost_tokens
            if i >= 2:  # the first pair warms the server
                times[ask].append(took)
    finally:
        serve.kill()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    step = off / a.cost_tokens
    lock, label, versions = threading.Lock(), "7", []  # as dcr serve's decode loop holds them

    def record() -> None:
        with lock:
            versions.append(label)

    n = 100_000
    per_token = timeit.timeit(record, number=n) / n
    build = timeit.timeit(lambda: spans(versions[:a.cost_tokens]), number=1000) / 1000
    return {"tokens": a.cost_tokens, "rounds": a.cost_rounds,
            "decode_ms_without": ms(off), "decode_ms_with": ms(on),
            "decode_ms_range_without": [ms(min(times[False])), ms(max(times[False]))],
            "decode_ms_range_with": [ms(min(times[True])), ms(max(times[True]))],
            "end_to_end_fraction": round(on / off - 1, 4),
            "decode_step_ms": round(step * 1e3, 3),
            "record_per_token_us": round(per_token * 1e6, 3),
            "build_spans_us": round(build * 1e6, 1),
            "in_process_fraction": round((per_token * a.cost_tokens + build) / off, 6)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=240, help="tokens of the rollout")
    ap.add_argument("--chunk", type=int, default=16, help="tokens per completion")
    ap.add_argument("--step-ms", type=float, default=20.0, help="dcr serve --min-step-s")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cost-tokens", type=int, default=256)
    ap.add_argument("--cost-rounds", type=int, default=10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcr-pause-") as tmp:
        work = Path(tmp)
        export_llama_versions(work / "ckpts", LLAMA)
        dirs = [work / "ckpts" / f"v{v}" for v in range(3)]
        rows = []
        for mode in a.modes.split(","):
            rows.append(one_mode(mode, dirs, work / mode, a))
            print(json.dumps(rows[-1]), flush=True)
        cost = spans_cost(dirs, work, a)
        print(json.dumps(cost), flush=True)
    result = {"bench": "pause", "machine": {"platform": platform.platform(),
                                            "cpus": os.cpu_count()},
              "settings": {"tokens": a.tokens, "chunk": a.chunk, "step_ms": a.step_ms,
                           "path": "the agent's client door, dcr serve --runtime hf"},
              "targets": TARGETS, "pause": rows, "spans_cost": cost}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
