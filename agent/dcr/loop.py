"""The main job's trainer as FSDP2 ranks whose shards are a fleet's owners: the example loop.

One process per rank, in torch.distributed's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``: what torchrun sets, or a pod spec from its index)::

    python -m dcr.loop --checkpoint /checkpoints/policy-a/v5 --version 5 --steps 3 \\
        --fleet policy-a --namespace rl --store s3://rl-weights/policy-a \\
        --token-file /var/run/dcr/encoder-token --listen 0.0.0.0:8472

Every rank loads the first version's checkpoint (the only one this loop reads; it writes
none) into FP32 master weights, shards them with ``fully_shard`` over gloo (or, with
``--sharding ddp``, keeps them whole, averages gradients and owns its chunk of each
tensor's rows: FSDP2 on CPU needs torch 2.7, and the serve image holds Debian's 2.6), and
serves its shards as an owner (:func:`dcr.owner.rank.serve`: the warm-encoder protocol, so
the fleet's encoder profile names the ranks' URLs). Then per step: an AdamW step on the
main job's data (:class:`~dcr.refit.trainer.Trainer`'s text, a batch per rank), the shards
offered as BF16 (what an export would hold), and rank 0 asks for the refit with
:func:`dcr.client.refit` and waits for its commit while the others wait at a barrier,
serving publishes. With ``--fingerprint``, rank 0 prints (one JSON line per version) the
fingerprints a dense load of each version gives ``dcr serve``'s loader, computed from the
gathered weights in memory, for a check to compare receivers with. docs/trainer.md, "An
example loop".
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dcr.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from dcr.owner.shards import ShardMap

log = logging.getLogger("dcr.loop")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dcr.loop", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="the first version's Hugging Face checkpoint (the fleet's committed "
                        "version)")
    p.add_argument("--version", type=int, required=True, help="the checkpoint's version")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, one refit each")
    p.add_argument("--fleet", required=True, help="the RolloutFleet to refit")
    p.add_argument("--namespace", default=None,
                   help="its namespace (default: this pod's, else 'default')")
    p.add_argument("--profile", default="ranks",
                   help="the fleet's encoder profile that names these ranks' URLs")
    p.add_argument("--source", default=None,
                   help="the name refits give each version, with {version} (default "
                        "/ranks/<fleet>/v{version}); nothing is read from it")
    p.add_argument("--store", required=True, help="the fleet's store URI (writes payloads)")
    p.add_argument("--token-file", type=Path, required=True,
                   help="the encoder token (the fleet's profile names its Secret)")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT of this rank's owner")
    p.add_argument("--sharding", choices=("fsdp2", "ddp"), default="fsdp2",
                   help="fsdp2: fully_shard, each rank owns the rows it holds (torch >= 2.7 "
                        "on CPU, any on GPU); ddp: every rank holds the whole model, "
                        "averages gradients, and owns its chunk of each tensor's rows")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--timeout-s", type=float, default=900.0,
                   help="how long rank 0 waits for each refit, and every rank at a barrier")
    p.add_argument("--fingerprint", action="store_true",
                   help="rank 0 prints each version's dense-load fingerprints (a check)")
    return p


def pod_namespace() -> str:
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return sa.read_text().strip() if sa.is_file() else "default"


def rank_env() -> tuple[int, int]:
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise ConfigError(f"RANK and WORLD_SIZE must be set to integers ({e}); "
                          "torch.distributed's environment names this process.") from None
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world}).")
    return rank, world


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parser().parse_args(argv)
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: at least one step.")
    rank, world = rank_env()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from dcr.client import refit
    from dcr.owner.layouts import fsdp2_shards, replicated_shards
    from dcr.owner.rank import RankOwner, serve
    from dcr.refit.trainer import TrainerSettings, corpus
    from dcr.transport.store import open_store

    timeout = datetime.timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    model = LlamaForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32)
    if args.sharding == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    settings = TrainerSettings()
    text = torch.tensor(list(corpus(settings.corpus)), dtype=torch.long)
    seq = min(settings.seq, model.config.max_position_embeddings)
    batches = torch.Generator().manual_seed(settings.seed + rank)  # each rank its own data

    def shards() -> tuple[dict[str, ShardMap], dict[str, torch.Tensor]]:
        layout = fsdp2_shards if args.sharding == "fsdp2" else replicated_shards
        return layout(model, rank=rank, ranks=world, dtype=torch.bfloat16)

    maps, tensors = shards()
    owner = RankOwner(store=open_store(args.store), maps=maps, tensors=tensors,
                      version=args.version, rank=rank, ranks=world)
    server = serve(owner, token=args.token_file.read_text().strip(), listen=args.listen)
    log.info("Rank %d of %d serves its shards of version %d at %s.", rank, world,
             args.version, server.url)
    namespace = args.namespace or pod_namespace()
    source = args.source or f"/ranks/{args.fleet}/v{{version}}"
    try:
        dist.barrier()  # every rank serves before the first refit asks for it
        for version in range(args.version + 1, args.version + args.steps + 1):
            starts = torch.randint(0, len(text) - seq - 1, (settings.batch,), generator=batches)
            batch = torch.stack([text[i : i + seq] for i in starts.tolist()])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            if args.sharding == "ddp":  # what DDP's hooks do: every rank the mean gradient
                for param in model.parameters():
                    assert param.grad is not None
                    dist.all_reduce(param.grad)
                    param.grad /= world
            optim.step()
            optim.zero_grad()
            overlay = owner.offer(shards()[1], version)
            log.info("Rank %d: step to version %d, loss %.4f, %d elements changed.", rank,
                     version, float(loss), overlay.elements)
            dense = gathered(model) if args.fingerprint else {}  # collective: every rank
            if rank == 0:
                done = refit(args.fleet, version, source.format(version=version),
                             namespace=namespace, encoder_profile=args.profile, owners=world,
                             timeout_s=args.timeout_s, progress_bar=False)
                log.info("Refit %s committed version %d.", done.name, version)
                if dense:
                    print(json.dumps({"version": version, "fingerprint": fingerprint(
                        args.checkpoint, dense)}), flush=True)
            dist.barrier()
    finally:
        server.close()
        dist.destroy_process_group()
    return 0


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, in BF16 (``full_tensor`` gathers it from all ranks)."""
    import torch
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).to(torch.bfloat16)
            for n, p in model.named_parameters()}


def fingerprint(config_from: Path, dense: dict[str, torch.Tensor]) -> dict[str, str]:
    """What a dense load of ``dense`` through ``dcr serve``'s loader (``hf``) holds."""
    from dcr.runtimes import build_runtime
    from dcr.runtimes.weights import runtime_fingerprint

    built = build_runtime("hf", config_from)
    built.load_weights(iter(dense.items()))
    return runtime_fingerprint(built)


if __name__ == "__main__":
    sys.exit(main())
