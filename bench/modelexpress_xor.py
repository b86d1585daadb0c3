"""Bytes per step: ModelExpress's canonical XOR deltas next to DCR's payloads.

ModelExpress is a bench-only dependency, not one of the project's. Next to the project's
venv (``dcr[torch]`` brings everything else it imports), for instance:

    pip install --no-deps --target /tmp/mxpkgs modelexpress==0.7.0 grpcio 'protobuf<7'
    PYTHONPATH=/tmp/mxpkgs .venv/bin/python bench/modelexpress_xor.py   # 64 MiB, 1%, 5 steps

A BF16 model (four tensors, ``--mib`` MiB in all) takes ``--steps`` updates, each a uniform
``--pct`` % of elements moved by one ulp (bench/catchup.py's ``step``). Every version is
published two ways:

* **ModelExpress 0.7.0**: its trainer-side writer (``CanonicalDeltaPublicationMethod``:
  version 0 as a full HF checkpoint, then one XOR delta per version) into an in-memory
  stand-in for its S3 client, in a one-process gloo group, with a stand-in for the server's
  ``GetWeightVersion``. Its receiver (``_LocalCheckpoint``) applies each delta as it comes;
  a second receiver replays the chain ``resolve_replay_chain`` resolves from version 0.
* **DCR**: the in-process encoder into a ``FileStore``, each version committed in the
  store's history. ``materialize(route="replay")`` brings one pod up a version at a time
  and a second from version 0 along the whole chain.

A step's bytes are the objects its writer adds to the store (DCR: payloads and manifest;
the history object, rewritten on each commit, is reported apart). Every checkpoint a
receiver ends with is compared bit for bit, on integer views, with the version it should
hold. The file name keeps clear of the ``modelexpress`` package, which a script of that
name would shadow.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from catchup import bits_of, commit, save, source, step
from dcr.files.history import HistoryStore
from dcr.files.materialize import materialize
from dcr.format.history import HISTORY_KEY
from dcr.owner.encoder import Encoder
from dcr.transport.store import FileStore

try:
    from modelexpress_rl import refit_pb2
    from modelexpress_rl.control import WeightVersion, _weight_version
    from modelexpress_rl.inference.receiver import (
        ObjectStorageGeneratorConfig,
        _LocalCheckpoint,
        _S3Version,
    )
    from modelexpress_rl.inference.version_chain import resolve_replay_chain
    from modelexpress_rl.object_storage import ObjectStorageType
    from modelexpress_rl.train.client import ObjectStorageConfig
    from modelexpress_rl.train.methods.canonical_delta import CanonicalDeltaPublicationMethod
    from modelexpress_rl.version import WeightVersionRef
except ImportError as e:
    sys.exit(f"This bench needs ModelExpress ({e}): "
             "pip install --no-deps modelexpress==0.7.0 grpcio 'protobuf<7'")

PREFIX, MODEL = "s3://bench/policy", "bench-model"
PARTS = {  # name: share of the model's elements
    "model.embed_tokens.weight": 0.25,
    "model.layers.0.self_attn.qkv_proj.weight": 0.1875,
    "model.layers.0.mlp.gate_up_proj.weight": 0.3125,
    "model.layers.0.mlp.down_proj.weight": 0.25,
}


class MemoryS3:
    """The calls ModelExpress's writer and receiver make on their S3 client, in memory."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.read = 0  # bytes handed out by get()

    def put(self, *, uri: str, data: bytes) -> None:
        self.objects[uri] = bytes(data)

    def get(self, uri: str) -> bytes:
        self.read += len(self.objects[uri])
        return self.objects[uri]

    def size(self, uri: str) -> int:
        return len(self.objects[uri])

    def close(self) -> None:
        pass

    def bytes_under(self, prefix: str) -> int:
        return sum(len(d) for u, d in self.objects.items() if u.startswith(prefix))


class Registry:
    """ModelExpress's control plane for this run: v0 a full checkpoint, each later one a
    delta on the one before, all ready."""

    def __init__(self) -> None:
        self.records: dict[str, Any] = {}

    def add(self, v: int) -> None:
        uid = f"v{v}"
        record = refit_pb2.WeightVersion(
            uid=uid, model_name=MODEL, state=refit_pb2.WEIGHT_VERSION_STATE_READY,
            payload_format=(refit_pb2.WEIGHT_PAYLOAD_FORMAT_XOR_DELTA if v
                            else refit_pb2.WEIGHT_PAYLOAD_FORMAT_FULL_HF_CHECKPOINT),
            object_storage=refit_pb2.ObjectStorageSource(
                uri=f"{PREFIX}/{uid}/model.safetensors.index.json",
                storage_type=refit_pb2.OBJECT_STORAGE_TYPE_S3))
        if v:
            record.base_version_id = f"v{v - 1}"
        self.records[uid] = record

    def GetWeightVersion(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return refit_pb2.GetWeightVersionResponse(version=self.records[request.uid])

    def ready(self, uid: str) -> WeightVersion:
        return _weight_version(self.records[uid])

    def s3_version(self, uid: str) -> _S3Version:
        w = self.ready(uid)
        return _S3Version(version_id=uid, base_version_id=w.base_version_id,
                          payload_format=w.payload_format, uri=w.object_storage.uri)


def mx_receiver(cache: Path, seed: Path, s3: MemoryS3) -> _LocalCheckpoint:
    config = ObjectStorageGeneratorConfig(
        storage_type=ObjectStorageType.S3, initial_base_version_id="v0",
        seed_checkpoint_path=seed, refit_checkpoint_dir=cache, refit_checkpoint_max_size_gb=None)
    receiver = _LocalCheckpoint(model_name=MODEL, config=config, s3=s3)
    receiver.initialize()
    return receiver


def as_torch(bits: dict[str, np.ndarray]) -> list[list[tuple[str, torch.Tensor]]]:
    """ModelExpress's ``hf_tensor_iter``: buckets of (name, tensor), one tensor each."""
    return [[(n, torch.from_numpy(b.view(np.int16)).view(torch.bfloat16))] for n, b in bits.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--pct", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/modelexpress.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dcr-mx-"))
    rng = np.random.default_rng(0)
    total = int(args.mib * (1 << 20)) // 2
    versions = [{n: ((rng.standard_normal(int(total * f), dtype=np.float32) * 0.02)
                     .view(np.uint32) >> 16).astype(np.uint16) for n, f in PARTS.items()}]
    for _ in range(args.steps):
        versions.append(step(versions[-1], args.pct, rng))
    want = [{n: b.tobytes() for n, b in bits.items()} for bits in versions]
    seed = work / "seed-v0"
    save(versions[0], seed)

    s3, registry = MemoryS3(), Registry()
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=0, world_size=1)
    writer = CanonicalDeltaPublicationMethod(
        config=ObjectStorageConfig(storage_type=ObjectStorageType.S3, uri_prefix=PREFIX,
                                   initial_base_version_id="v0", seed_checkpoint_path=seed),
        model_name=MODEL, service=lambda: registry, rpc_timeout_seconds=5,
        process_group=dist.group.WORLD, read_seed_tensor=None, s3=s3)
    mx_pod = None
    store = FileStore(work / "dcr-store")
    history = HistoryStore(store)
    owner = Encoder(store=store, baseline=source(versions[0]), version=0)
    dcr_pod = work / "dcr-pod"
    shutil.copytree(seed, dcr_pod)
    rows: list[dict[str, Any]] = []
    try:
        for v, bits in enumerate(versions):
            registry.add(v)
            ref = WeightVersionRef(f"v{v}")
            writer.publish(version=ref, staged=writer.stage(version=ref,
                                                            hf_tensor_iter=iter(as_torch(bits))))
            if not v:
                mx_pod = mx_receiver(work / "mx-pod", seed, s3)
                continue
            assert mx_pod is not None
            read = s3.read
            prepared = mx_pod.prepare_chain((registry.s3_version(f"v{v}"),))
            mx_pod.activate(prepared)
            mx_row = {"mx_bytes": s3.bytes_under(f"{PREFIX}/v{v}/"),
                      "mx_read_bytes": s3.read - read,
                      "mx_bit_exact": bits_of(prepared.path) == want[v]}

            before = {p: p.stat().st_size for p in store.root.rglob("*") if p.is_file()}
            commit(owner, history, bits, v)
            added = {p: p.stat().st_size for p in store.root.rglob("*")
                     if p.is_file() and p.stat().st_size != before.get(p)}
            hist = added.pop(store.root / HISTORY_KEY, 0)
            done = materialize(store, dcr_pod, held=v - 1, route="replay")
            dcr_bytes = sum(added.values())
            rows.append({"step": v, "changed_elements": sum(
                            int(np.count_nonzero(bits[n] != versions[v - 1][n])) for n in bits),
                         **mx_row, "dcr_bytes": dcr_bytes, "dcr_history_bytes": hist,
                         "dcr_read_bytes": done.fetched_bytes,
                         "dcr_bit_exact": bits_of(dcr_pod) == want[v],
                         "mx_over_dcr": round(mx_row["mx_bytes"] / dcr_bytes, 3)})
            print(json.dumps(rows[-1]), flush=True)
        dist.destroy_process_group()

        last = f"v{args.steps}"
        chain = resolve_replay_chain(target_version_id=last, fetch_ready_version=registry.ready,
                                     max_chain_length=64, stop_before_version_id="v0")
        read = s3.read
        replayer = mx_receiver(work / "mx-chain", seed, s3)
        prepared = replayer.prepare_chain(tuple(registry.s3_version(w.version_id)
                                                for w in chain))
        replayer.activate(prepared)
        mx_chain = {"versions": [w.version_id for w in chain], "read_bytes": s3.read - read,
                    "bit_exact": bits_of(prepared.path) == want[-1]}
        done = materialize(store, work / "dcr-chain", held=0, seed=seed, route="replay")
        dcr_chain = {"route": done.plan.route, "deltas": done.plan.steps,
                     "read_bytes": done.fetched_bytes,
                     "bit_exact": bits_of(work / "dcr-chain") == want[-1]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    totals = {"mx_bytes": sum(r["mx_bytes"] for r in rows),
              "dcr_bytes": sum(r["dcr_bytes"] for r in rows)}
    totals["mx_over_dcr"] = round(totals["mx_bytes"] / totals["dcr_bytes"], 3)
    doc = {
        "benchmark": "modelexpress",
        "command": " ".join(["python", "bench/modelexpress_xor.py", *sys.argv[1:]]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": {"dense_bytes": sum(b.nbytes for b in versions[0].values()),
                  "tensors": {n: b.size for n, b in versions[0].items()},
                  "changed_pct": args.pct, "steps": args.steps,
                  "modelexpress": "0.7.0, CanonicalDeltaPublicationMethod and _LocalCheckpoint",
                  "dcr": "Encoder, mixed mode, default settings",
                  "cpus": os.cpu_count(), "python": platform.python_version(),
                  "torch": torch.__version__},
        "results": {"steps": rows, "totals": totals,
                    "replay_chain": {"modelexpress": mx_chain, "dcr": dcr_chain}},
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
