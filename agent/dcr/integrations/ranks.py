"""A distributed trainer's ranks as the owners of its refits: each serves its shards.

Under ``torch.distributed`` (FSDP2's ``fully_shard``, or data parallel where every rank
holds the whole model) each rank offers its own shards of the step's weights to a
:class:`~dcr.owner.rank.RankOwner` that it serves over the warm-encoder protocol from a
thread; rank 0 runs :class:`~dcr.coordinate.LocalFleet`'s coordinator over every rank's
endpoint and the fleet's agents, and tells every rank how the refit ended. No rank
gathers the model and nothing is written but the payloads. The collectives (one
``all_gather_object`` at :meth:`RankGroup.join`, a barrier and a broadcast per refit)
run in the trainer's thread, as the trainer's own do; the endpoints answer from theirs.
docs/trainer.md, "With TRL".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dcr.coordinate import LocalFleet
from dcr.errors import ConfigError, RefitError
from dcr.owner.layouts import fsdp2_shards, replicated_shards
from dcr.owner.rank import RankOwner, serve
from dcr.protocol.records import CommitRecord
from dcr.transport.store import Store, open_store

if TYPE_CHECKING:
    import torch

    from dcr.owner.server import BackgroundServer

log = logging.getLogger(__name__)
FleetFor = Callable[[list[str]], LocalFleet]  # rank 0's fleet over the ranks' endpoint URLs


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (FSDP2, TP) rather than whole tensors."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@dataclass(kw_only=True)
class RankGroup:
    """This rank's owner and endpoint, and on rank 0 the fleet it refits."""

    rank: int
    ranks: int
    owner: RankOwner
    server: BackgroundServer
    fleet: LocalFleet | None  # rank 0's
    dtype: torch.dtype | None
    copies: Sequence[str] | None
    sharded: bool  # FSDP2 DTensors (else each rank holds the model whole)

    @classmethod
    def join(cls, model: torch.nn.Module, *, store: str | Store, token: str,
             fleet_for: FleetFor, version: int = 0, dtype: torch.dtype | None = None,
             copies: Sequence[str] | None = None, listen: str = "127.0.0.1:0"
             ) -> RankGroup:
        """Collective: every rank of the default group makes its owner at ``version``
        over its shards of ``model`` and serves it on ``listen`` with ``token``; rank 0
        builds ``fleet_for(urls)`` over the endpoints, in rank order. ``copies``: as
        :func:`~dcr.owner.layouts.fsdp2_shards` takes it (FSDP2 over TP)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("RankGroup.join needs torch.distributed initialized (every "
                              "rank of the trainer calls it); one process uses "
                              "DcrWeightSync.for_model.")
        rank, ranks = dist.get_rank(), dist.get_world_size()
        sharded = _sharded(model)
        maps, tensors = cls._layout(model, rank, ranks, sharded, dtype, copies)
        owner = RankOwner(store=open_store(store) if isinstance(store, str) else store,
                          maps=maps, tensors=tensors, version=version, rank=rank,
                          ranks=ranks)
        server = serve(owner, token=token, listen=listen)
        try:
            urls: list[Any] = [None] * ranks
            dist.all_gather_object(urls, server.url)
            fleet = fleet_for([str(u) for u in urls]) if rank == 0 else None
        except BaseException:
            server.close()
            raise
        log.info("Rank %d of %d serves its shards at %s.", rank, ranks, server.url)
        return cls(rank=rank, ranks=ranks, owner=owner, server=server, fleet=fleet,
                   dtype=dtype, copies=copies, sharded=sharded)

    @staticmethod
    def _layout(model: torch.nn.Module, rank: int, ranks: int, sharded: bool,
                dtype: torch.dtype | None, copies: Sequence[str] | None
                ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if sharded:
            return fsdp2_shards(model, rank=rank, ranks=ranks, dtype=dtype, copies=copies)
        return replicated_shards(model, rank=rank, ranks=ranks, dtype=dtype)

    def shards(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's shards of ``model`` now, as its owner holds them."""
        return self._layout(model, self.rank, self.ranks, self.sharded, self.dtype,
                            self.copies)[1]

    def refit(self, version: int) -> tuple[CommitRecord, int]:
        """Collective, once every rank offered ``version``: rank 0 commits it on the
        fleet; every rank returns the record and the attempts it took, or raises (rank 0
        what the coordinator raised, the others a :class:`RefitError` saying it)."""
        import torch.distributed as dist

        dist.barrier()  # every rank's offer is in before rank 0 asks for a publish
        failure: BaseException | None = None
        outcome: list[Any] = [None]
        if self.fleet is not None:
            try:
                done = self.fleet.refit(version)
                outcome = [(done.record, len(done.attempts), None)]
            except Exception as e:  # every rank must hear of it, or the others hang
                failure = e
                outcome = [(None, 0, f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(outcome, src=0)
        record, attempts, failed = outcome[0]
        if failure is not None:
            raise failure
        if failed is not None:
            raise RefitError(f"Rank 0's refit to version {version} failed on rank "
                             f"{self.rank}'s behalf: {failed}")
        assert isinstance(record, CommitRecord)
        return record, int(attempts)

    def close(self) -> None:
        """Stop this rank's endpoint."""
        self.server.close()


__all__ = ["FleetFor", "RankGroup"]
