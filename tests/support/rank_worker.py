"""One rank of a vLLM model, driven by the test like ``collective_rpc`` drives a worker.

``python rank_worker.py RANK WORLD PORT MODEL_DIR [DEVICE]`` joins a gloo group of
``WORLD`` ranks (vLLM's tensor-parallel groups over it), then answers one JSON line per
request read from stdin::

    {"call": "build", "target": T, "arg": {"model": DIR, "quantization": null,
                                           "expert_parallel": false}}
        -> {param name: [shape]}      a vLLM model, wrapped as a worker with DCR's
                                       extension under the name T
    {"call": "dcr_...", "target": T, "arg": "<json>" | null}
        -> the extension method's answer, exactly as /collective_rpc would pass it on
    {"call": "compare", "arg": [T1, T2]}
        -> [names]                    parameters and buffers whose bits differ

Answers are ``{"ok": ...}`` or ``{"error": "Type: message"}``. vLLM logs to stdout, so
the protocol keeps the original stdout for itself and points fd 1 at stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

import vllm_cpu  # noqa: E402  (after the fd juggling: vLLM prints while importing)


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    model_dir = Path(sys.argv[4])
    device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    vllm_cpu.init_distributed(model_dir, world=world, rank=rank, port=port)
    workers: dict[str, vllm_cpu.Worker] = {}
    PROTOCOL.write(json.dumps({"ok": "ready"}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            answer: Any = handle(req, workers, world, device)
        except Exception as e:
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"}
        else:
            answer = {"ok": answer}
        PROTOCOL.write(json.dumps(answer) + "\n")
        if req["call"] == "exit":
            return


def handle(req: dict[str, Any], workers: dict[str, vllm_cpu.Worker], world: int,
           device: str) -> Any:
    call, arg = req["call"], req.get("arg")
    if call == "exit":
        return None
    if call == "build":
        model = vllm_cpu.build_model(Path(arg["model"]), tp=world, device=device,
                                     quantization=arg.get("quantization"),
                                     expert_parallel=arg.get("expert_parallel", False))
        workers[req["target"]] = vllm_cpu.Worker(model)
        return {n: list(p.shape) for n, p in model.named_parameters()}
    if call == "compare":
        a, b = (workers[t].model for t in arg)
        return vllm_cpu.differing(a, b)
    if not call.startswith("dcr_"):
        raise ValueError(f"unknown call {call!r}")
    method = getattr(workers[req["target"]], call)
    answer = method() if arg is None else method(arg)
    json.dumps(answer)  # /collective_rpc passes on only what JSON can carry
    return answer


if __name__ == "__main__":
    main()
