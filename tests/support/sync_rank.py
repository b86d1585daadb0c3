"""One FSDP2 rank of a trainer whose weights reach the fleet through ``DcrWeightSync.for_ranks``.

``python sync_rank.py RANK WORLD PORT CHECKPOINT VERSION STORE TOKEN_FILE OUT [LAYOUT]``
(:mod:`fsdp2_rank`'s arguments; ``OUT/fleet.json`` names the agents, their token and the
commit record) joins a gloo group, loads ``CHECKPOINT`` (a Hugging Face directory of BF16
weights) as FP32 master weights, shards it with ``fully_shard`` and builds the callback
over it, rank 0 with a :class:`~dcr.coordinate.LocalFleet` of the agents; it prints its
endpoint as ``{"url"}``. Per line ``{"step": V}`` it takes an AdamW step and calls what
TRL calls after one, ``on_step_end`` at global step V: every rank offers its shards, rank
0 refits the agents. Then every rank gathers the weights for rank 0 to write the dense
BF16 export of V to ``OUT/vV/``, for the test to compare with and for nothing else, and
answers ``{"changed": N, "committed": V}``.
"""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from fsdp2_rank import joined, shard
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from dcr.coordinate import LocalFleet
from dcr.integrations.trl import DcrWeightSync
from dcr.protocol.coordinator import CoordinatorSettings

LR = 1e-3  # high enough that every rank's shards change at each step


def main() -> None:
    a = joined(sys.argv)
    rank, version, store, out = a.rank, a.version, a.store, a.out
    fleet = json.loads((out / "fleet.json").read_text())
    token = a.token_file.read_text().strip()
    model = LlamaForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32)
    export_config = copy.deepcopy(model.config)
    export_config.dtype = "bfloat16"
    shard(model, a.layout, a.world)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)

    def fleet_for(urls: list[str]) -> LocalFleet:
        return LocalFleet(name="policy", store=store, record=fleet["record"], owners=urls,
                          owner_token=token, agents=fleet["agents"],
                          agent_token=fleet["agent_token"], initial_version=version,
                          settings=CoordinatorSettings(attempt_timeout_s=300.0))

    sync = DcrWeightSync.for_ranks(model, store=store, token=token, fleet_for=fleet_for,
                                   version=version, dtype=torch.bfloat16)
    print(json.dumps({"url": sync.group.server.url if sync.group else None}), flush=True)
    data = torch.Generator().manual_seed(1)
    for line in sys.stdin:
        step = int(json.loads(line)["step"])
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=data)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
        sync.on_step_end(None, SimpleNamespace(global_step=step - version), None,
                         model=model)
        dense = {n: p.full_tensor().to(torch.bfloat16) for n, p in model.named_parameters()}
        if rank == 0:
            there = out / f"v{step}"
            there.mkdir(parents=True)
            save_file({n: t.contiguous() for n, t in dense.items()},
                      str(there / "model.safetensors"))
            export_config.to_json_file(there / "config.json")
        print(json.dumps({"changed": sync.steps[-1].changed_elements,
                          "committed": sync.committed}), flush=True)
    sync.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
