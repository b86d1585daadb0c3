"""FSDP2 ranks are the owners of a refit: gloo processes, their shards, no checkpoint.

Each rank (:mod:`fsdp2_rank`) trains a small Llama sharded by ``fully_shard`` (three ranks:
chunked rows, the last rank's chunks shorter; four ranks as HSDP, two replicas of a
two-way shard; four ranks as FSDP2 over tensor parallelism, 2 x 2, the TP row and column
splits chunked again by FSDP and the norms on the data-parallel mesh alone), takes real
AdamW steps and serves the warm-encoder protocol from its own process. A coordinator
here asks every rank to publish, as the operator does, carrying the commit record of the
base in each request; vLLM-layout receivers (TP 2 and TP 1) end with the bits of a dense
export of each version. The coordinator writes the store's history after each commit, as
the operator does, and it vouches for every tensor: an engine restarted after the last
commit rejoins from the store, and ``dcr materialize --held 0 --seed`` reaches it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from shardrig import DENSE, V0, exact, profile_of, receivers
from trainer_ranks import TrainerRanks

from dcr.apply.plan import CanonicalTensor
from dcr.files.history import HistoryStore
from dcr.format.profile import ReceiverProfile
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator
from dcr.protocol.encoder_api import EncoderClient, PublishRequest
from dcr.protocol.records import Attempt, CommitRecord
from dcr.receiver.fromstore import FromStore
from dcr.receiver.service import AgentService
from dcr.runtimes.vllm_reference import ReferenceModel, random_checkpoint
from dcr.serve.local import LocalDriver
from dcr.transport.receive import StoreSource
from dcr.transport.store import FileStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TOKEN = "fsdp2-rank-token-0123456789abcdef"
# (layout, world): 3 does not divide the rows, so FSDP2 gives the last rank shorter chunks
LAYOUTS = [("fsdp", 3), ("hsdp", 4), ("fsdp-tp", 4)]


@dataclass
class RankEndpoint:
    """``OwnerHandle`` for one rank's endpoint, asked as the operator asks a warm encoder."""

    client: EncoderClient
    index: int
    owners: int
    profile: ReceiverProfile
    committed: str | None = None  # the attempt of the last commit record seen

    def publish(self, attempt: Attempt) -> None:
        t = attempt.transition
        self.client.publish(PublishRequest(
            attempt=attempt.id, mode=attempt.mode, base_version=t.base_version,
            target_version=t.target_version, owner=self.index, owners=self.owners,
            base=f"/ranks/v{t.base_version}", target=f"/ranks/v{t.target_version}",
            profile=self.profile, committed_attempt=self.committed), timeout_s=120)

    def advance_baseline(self, record: CommitRecord) -> None:
        self.committed = record.attempt


@pytest.fixture(params=LAYOUTS, ids=[layout for layout, _ in LAYOUTS])
def ranks(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TrainerRanks]:
    layout, world = request.param
    v0 = random_checkpoint(DENSE, 0)
    save_file(v0, str(tmp_path / "v0.safetensors"))
    with TrainerRanks.start(world, tmp_path / "v0.safetensors", 0,
                            (tmp_path / "store").as_uri(), TOKEN, tmp_path,
                            layout=layout) as started:
        yield started


def test_fsdp2_ranks_are_the_owners_and_late_receivers_rejoin_from_the_store_bit_exact(
        ranks: TrainerRanks, tmp_path: Path) -> None:
    """Every changed element is offered by exactly one rank (replicas and the copies a
    sub-mesh leaves on the other dimension included), receivers end bit-exact, and the
    history the coordinator writes vouches for every tensor by the ranks' sums: engines
    restarted after the last commit rejoin from the store, and a late pod's ``dcr
    materialize --held 0 --seed`` reaches it."""
    v0 = load_file(str(tmp_path / "v0.safetensors"))
    store = FileStore(tmp_path / "store")
    rx, models = receivers(DENSE, v0, store, (2, 1), tmp_path / "rx")
    world = len(ranks.urls)
    owners = [RankEndpoint(client=EncoderClient(url, TOKEN, name=f"rank-{r}"), index=r,
                           owners=world, profile=profile_of(rx))
              for r, url in enumerate(ranks.urls)]
    history = HistoryStore(store)

    def record(rec: CommitRecord, n: int) -> None:  # what the operator does at each commit
        history.commit(rec.committed_version, rec.attempt, n)

    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx,
                        on_commit=record)
    for version in (1, 2):
        changed = ranks.step(version)
        target = load_file(str(ranks.out / f"v{version}" / "model.safetensors"))
        # Offers are against the baseline each rank holds: version 0 both times, since a
        # rank learns of version 1's commit from the next publish request.
        differ = sum(int((a.view(torch.int16) != target[n].view(torch.int16)).sum())
                     for n, a in v0.items())
        assert sum(changed) == differ > 0  # every changed element offered by one rank
        coord.refit(version, f"/ranks/v{version}")
        assert [h.outcome for h in coord.history][-1] == "committed"
        assert exact(DENSE, models, target)
    parts = sorted(p.name for p in (tmp_path / "store").rglob("manifest-o*.dcrm"))
    assert parts == sorted([f"manifest-o{r:04d}.dcrm" for r in range(world)] * 2)
    coord.close()
    target = load_file(str(ranks.out / "v2" / "model.safetensors"))
    for tp in (1, 2):
        assert restarted_engine_rejoins(tmp_path / f"late-tp{tp}", v0, store, tp) == 2
    assert exact_files(materialized(tmp_path, store), target)


def restarted_engine_rejoins(root: Path, v0: dict[str, torch.Tensor], store: FileStore,
                             tp: int) -> int:
    """An engine restarted on the starting model (the last rank of a TP ``tp`` engine)
    rejoins from the store: its agent builds the committed version from its own copy of
    v0 and the committed deltas, every tensor checked against the history's sums before
    the load and the tensors it holds whole after. Its version once restored."""
    (root / "v0").mkdir(parents=True)
    save_file(v0, str(root / "v0" / "model.safetensors"))
    model = ReferenceModel(DENSE, tp_size=tp, tp_rank=tp - 1)
    model.load_weights(v0.items())
    staging = root.parent / f"{root.name}-staging"
    engine = LocalDriver([model], staging_dir=staging, checkpoint_root=root)
    canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                 for n, t in v0.items()]
    agent = AgentService(
        root.name, engine, lambda spec: StoreSource(store=store, version=spec.target_version,
                                                    attempt=spec.attempt, owners=spec.owners),
        canonical=canonical, staging_dir=staging, version=0, checkpoint_root=root,
        store=FromStore(HistoryStore(store), root, seed=(0, root / "v0")))
    committed = HistoryStore(store).read().committed
    version = agent.rejoin(committed).version
    assert version is not None
    return version


def materialized(tmp_path: Path, store: FileStore) -> Path:
    """A late pod's init container: ``dcr materialize --held 0 --seed`` from the public
    starting model reaches the committed version."""
    seed = tmp_path / "public-v0"
    seed.mkdir()
    shutil.copy(tmp_path / "v0.safetensors", seed / "model.safetensors")
    out = tmp_path / "pod" / "weights"
    run = subprocess.run([sys.executable, "-m", "dcr", "materialize", "--store", store.uri,
                          "--out", str(out), "--held", "0", "--seed", str(seed), "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["version"] == 2
    return out


def exact_files(out: Path, target: dict[str, torch.Tensor]) -> bool:
    built = load_file(str(out / "model.safetensors"))
    return built.keys() == target.keys() and all(
        torch.equal(built[n].view(torch.int16), t.view(torch.int16)) for n, t in target.items())


REFUSALS = """
import socket, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from dcr.errors import ConfigError
from dcr.owner.layouts import fsdp2_shards

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
world = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))

def placed(mesh, placements, **kwargs):
    module = torch.nn.Linear(8, 4, bias=False, dtype=torch.bfloat16)
    module.weight = torch.nn.Parameter(DTensor.from_local(module.weight.data, mesh,
                                                          placements))
    try:
        maps, _ = fsdp2_shards(module, rank=0, ranks=1, **kwargs)
        print("accepted", maps["weight"].kind)
    except ConfigError as e:
        print("refused", e)

placed(init_device_mesh("cpu", (1,)), [Partial()])
placed(world, [Shard(0), _StridedShard(0, split_factor=2)])
placed(world["dp"], [Shard(0)])
placed(world["dp"], [Shard(0)], copies=("dp",))
placed(world["dp"], [Shard(0)], copies=("tp",))
placed(world, [_StridedShard(0, split_factor=1), Shard(0)])
dist.destroy_process_group()
"""


def test_layouts_that_would_be_guessed_at_are_refused_by_name(tmp_path: Path) -> None:
    """Refused, naming the parameter, rather than published with a guessed owner or
    span: a ``Partial`` placement (summands, not elements); a strided shard that gives a
    rank interleaved rows; a parameter on a slice of the world mesh without ``copies``
    (is the other dimension copies, as TP's, or other parameters, as pipeline stages?)
    or with ``copies`` naming a dimension the slice has. Accepted: the slice with its
    copies named, and FSDP2-over-TP's strided shard."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", REFUSALS], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout
    assert lines[0].startswith("refused weight is placed (Partial(sum),)")
    assert "reduce it before offering" in lines[0]
    assert lines[1].startswith("refused weight is placed (Shard(dim=0), _StridedShard(")
    assert "do not run on contiguously" in lines[1]
    assert lines[2].startswith("refused weight lies on the slice ['dp'] of the world mesh "
                               "['dp', 'tp']: say which other dimensions hold copies")
    assert lines[3] == "refused copies names ['dp']: not dimensions of the world mesh " \
        "['dp', 'tp'] that weight's slice ['dp'] lacks."
    assert lines[4:] == ["accepted rows", "accepted rows"]


def test_data_parallel_ranks_own_every_element_once_in_the_dtype_asked() -> None:
    """``replicated_shards``: ranks that each hold the whole module (DDP) own
    ``torch.chunk``'s runs of every parameter's rows, cast as asked; a parameter of
    fewer rows than ranks leaves the last ranks owning none of it."""
    from dcr.owner.layouts import replicated_shards

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.LayerNorm(5),
                                 torch.nn.Linear(5, 1))
    params = {n: p.detach() for n, p in module.named_parameters()}
    owned = {n: torch.zeros(p.shape, dtype=torch.int32) for n, p in params.items()}
    for rank in range(3):
        maps, tensors = replicated_shards(module, rank=rank, ranks=3, dtype=torch.bfloat16)
        assert set(maps) == set(params)
        for name, m in maps.items():
            assert m.span is not None
            start, stop = m.span
            assert (m.kind, m.dtype, m.shape) == ("rows", "BF16", tuple(params[name].shape))
            assert torch.equal(tensors[name], params[name][start:stop].to(torch.bfloat16))
            owned[name][start:stop] += 1
    assert all(bool((count == 1).all()) for count in owned.values())
    assert replicated_shards(module, rank=2, ranks=3)[1]["2.weight"].shape[0] == 0
