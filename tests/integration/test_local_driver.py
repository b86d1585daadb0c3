"""The in-process engine (``dcr.serve.local.LocalDriver``): ``dcr serve``'s workers behind
the agent's ``Driver`` seam, and the plugin calls the agent makes around an attempt.

Both ranks of the vLLM-layout reference at TP 2 (replicated norms are whole on each rank,
projections are shards), versions 0 and 1 on disk under the checkpoint root, payloads
made by the owner's diff and staged as files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.drivers import EngineError
from dcr.format.manifest import Manifest
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.runtimes.vllm_reference import ReferenceConfig, ReferenceModel, random_checkpoint
from dcr.runtimes.weights import runtime_fingerprint
from dcr.serve.local import LocalDriver
from dcr.settings import MiB
from dcr.transport.store import MemoryStore

pytestmark = pytest.mark.timeout(120)

CFG = ReferenceConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    state = random_checkpoint(CFG, 0)
    gen = torch.Generator().manual_seed(1)
    for v in (0, 1):
        (tmp_path / "ckpt" / f"v{v}").mkdir(parents=True)
        save_file(state, str(tmp_path / "ckpt" / f"v{v}" / "model.safetensors"))
        state = {n: (t.float() + 1e-2 * torch.randn(t.shape, generator=gen))
                 .to(torch.bfloat16) for n, t in state.items()}
    return tmp_path / "ckpt"


def canonical(ckpt: Path) -> list[CanonicalTensor]:
    with Checkpoint(ckpt) as c:
        return [CanonicalTensor(name=i.name, dtype=i.dtype.name, shape=i.shape) for i in c]


def engine_at(root: Path, staging: Path, v: int) -> LocalDriver:
    staging.mkdir(exist_ok=True)
    engine = LocalDriver([ReferenceModel(CFG, tp_size=2, tp_rank=r) for r in (0, 1)],
                         staging_dir=staging, checkpoint_root=root)
    engine.load_dense(f"v{v}")
    return engine


def stage(root: Path, staging: Path) -> tuple[list[str], Manifest]:
    store = MemoryStore()
    settings = EncodeSettings(target_version=1, base_version=0, mode="mixed", bucket_bytes=1 * MiB,
                              attempt_manifest=True)
    with Checkpoint(root / "v0") as b, Checkpoint(root / "v1") as t:
        manifest = diff_checkpoints(b, t, store, settings)
    names = []
    for p in sorted(manifest.payloads, key=lambda p: (p.owner, p.seq)):
        names.append(f"{manifest.attempt}-o{p.owner:04d}-s{p.seq:06d}.dcrp")
        (staging / names[-1]).write_bytes(store.get(p.key))
    return names, manifest


def test_an_attempt_through_the_local_engine_is_bit_exact_and_its_targets_check(
        root: Path, tmp_path: Path) -> None:
    engine = engine_at(root, tmp_path / "staging", 0)
    engine.prewarm(canonical(root / "v0"))
    names, manifest = stage(root, tmp_path / "staging")
    outcome = engine.apply(names)
    engine.sync()
    targets = {t.name: t.target for t in manifest.tensors if t.name in outcome.names}
    assert engine.check_targets(targets) == {}
    dense = engine_at(root, tmp_path / "staging", 1)
    assert engine.fingerprint() == dense.fingerprint()

    # A foreign bit in a replicated norm (whole on each rank): the check names it.
    norm = "model.norm.weight"
    held = dict(engine.runtimes[1].named_tensors())[norm]
    held.view(torch.int16)[0] ^= 1
    assert list(engine.check_targets(targets)) == [norm]
    assert runtime_fingerprint(engine.runtimes[0]) == dense.fingerprint()[0]


def test_a_refused_dense_check_writes_nothing_and_a_restart_forgets_the_prewarm(
        root: Path, tmp_path: Path) -> None:
    engine = engine_at(root, tmp_path / "staging", 0)
    tensors = canonical(root / "v0")
    engine.prewarm(tensors)
    before, first = engine.fingerprint(), engine.instance()
    wrong = {t.name: "xxh3-128:" + "0" * 32 for t in tensors}
    with pytest.raises(EngineError, match="fingerprint differs"):
        engine.check_dense("v1", wrong)
    engine.check_dense("v1")  # passes, and still writes nothing
    assert engine.fingerprint() == before

    engine.restart()
    assert engine.instance() != first
    names, _ = stage(root, tmp_path / "staging")
    with pytest.raises(EngineError, match="before dcr_prewarm"):
        engine.apply(names)
    engine.up = False
    with pytest.raises(EngineError, match="does not answer") as e:
        engine.instance()
    assert e.value.status is None

