"""DCR's vLLM worker extension, called as ``POST /collective_rpc`` calls it, on vLLM's
real model classes (TP 1, in process; TP 2 is in ``test_vllm_tp2.py``).

The worker is the extension mixed into an object that has what vLLM's worker gives it
(``model_runner.model``, ``vllm_config``). Every argument is a JSON string and every
answer must survive ``json.dumps``: the route passes on nothing else. The staging
directory and the checkpoint root come from the engine's environment, never from a
request, and requests that try to leave them are refused before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM does not import in this interpreter: the engine "
                    "tier runs with `make test-engines` (tools/engines/setup.sh)")

import vllm_cpu

from dcr.apply.intercept import LoaderPathError
from dcr.checkpoint import Checkpoint
from dcr.errors import ConfigError
from dcr.format.payload import Mode
from dcr.format.profile import ReceiverProfile
from dcr.runtimes.rank import INSTANCE
from dcr.runtimes.weights import DenseRefused

pytestmark = pytest.mark.usefixtures("tp1")
FAMILY = "qwen2-moe"  # fused qkv with bias, gate_up, expert stacks, padded vocabulary


@pytest.fixture
def worker(versions: Callable[[str], list[Path]], staging: Path) -> vllm_cpu.Worker:
    """A worker at v0 (loaded densely through the extension), prewarmed."""
    dirs = versions(FAMILY)
    w = vllm_cpu.Worker(vllm_cpu.build_model(dirs[0]))
    assert rpc(w.dcr_load_dense, {"checkpoint": f"{FAMILY}/v0", "expect": None})["rank"] == 0
    rpc(w.dcr_prewarm, json.loads(vllm_cpu.canonical_request(dirs[0])))
    return w


def rpc(method: Callable[..., object], request: object = None) -> dict[str, object]:
    """One call as /collective_rpc makes it: a JSON string in, a JSON-able dict out."""
    answer = method() if request is None else method(json.dumps(request))
    assert isinstance(answer, dict)
    assert json.loads(json.dumps(answer)) == answer
    return answer


def profile_of(w: vllm_cpu.Worker, model_dir: Path) -> ReceiverProfile:
    answer = rpc(w.dcr_prewarm, json.loads(vllm_cpu.canonical_request(model_dir)))
    assert answer["rank"] == 0
    return ReceiverProfile(tensors=answer["profile"])


def test_instance_names_this_process_and_its_rank(worker: vllm_cpu.Worker) -> None:
    answer = rpc(worker.dcr_instance)
    assert answer == {"instance": INSTANCE, "rank": 0, "world": 1}
    assert len(INSTANCE) == 32
    assert int(INSTANCE, 16) >= 0
    assert rpc(worker.dcr_instance) == answer  # fixed for the life of the process
    assert rpc(worker.dcr_sync) == {"rank": 0}


@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
def test_refit_through_the_extension_matches_a_dense_load_through_it(
        mode: Mode, worker: vllm_cpu.Worker, versions: Callable[[str], list[Path]],
        staging: Path) -> None:
    dirs = versions(FAMILY)
    profile = profile_of(worker, dirs[0])
    assert set(profile.tensors.values()) == {"xor"}
    dense = vllm_cpu.Worker(vllm_cpu.build_model(dirs[0]))
    for v in range(1, len(dirs)):
        names, m = vllm_cpu.stage(staging, dirs, v, profile, mode)
        report = rpc(worker.dcr_apply, {"payloads": names})
        assert report["rank"] == 0
        assert report["records"] == m.stats.changed_elements
        assert report["classes"] == {"xor": report["tensors"]}
        expect = {t.name: t.target for t in m.tensors}
        rpc(dense.dcr_load_dense, {"checkpoint": f"{FAMILY}/v{v}", "expect": expect})
        assert rpc(worker.dcr_fingerprint) == rpc(dense.dcr_fingerprint)
        assert vllm_cpu.differing(worker.model, dense.model) == []


def test_a_restarted_worker_rejoins_by_a_dense_load(
        worker: vllm_cpu.Worker, versions: Callable[[str], list[Path]]) -> None:
    dirs = versions(FAMILY)
    fresh = vllm_cpu.Worker(vllm_cpu.build_model(dirs[0]))  # weights unknown
    rpc(fresh.dcr_load_dense, {"checkpoint": f"{FAMILY}/v0", "expect": None})
    assert rpc(fresh.dcr_fingerprint) == rpc(worker.dcr_fingerprint)


@pytest.mark.parametrize("name", ["../escape.dcrp", "/etc/hostname", "a/b.dcrp", "..",
                                  ".hidden", "a\\b", "x..y", "", "a\x00b"])
def test_a_staged_name_that_could_leave_the_staging_directory_is_refused(
        name: str, worker: vllm_cpu.Worker) -> None:
    before = rpc(worker.dcr_fingerprint)
    with pytest.raises(ConfigError, match="plain file name"):
        worker.dcr_apply(json.dumps({"payloads": [name]}))
    assert rpc(worker.dcr_fingerprint) == before


def test_a_symlinked_payload_is_refused(worker: vllm_cpu.Worker, staging: Path,
                                        versions: Callable[[str], list[Path]]) -> None:
    dirs = versions(FAMILY)
    names, _ = vllm_cpu.stage(staging, dirs, 1, profile_of(worker, dirs[0]))
    (staging / "link.dcrp").symlink_to(staging / names[0])
    before = rpc(worker.dcr_fingerprint)
    with pytest.raises(ConfigError, match="cannot be opened"):
        worker.dcr_apply(json.dumps({"payloads": ["link.dcrp"]}))
    assert rpc(worker.dcr_fingerprint) == before


@pytest.mark.parametrize("checkpoint", ["../elsewhere", "/abs/v0", f"{FAMILY}/../{FAMILY}/v1",
                                        f"{FAMILY}//v1", "./qwen2-moe/v1", "a\\b"])
def test_a_dense_checkpoint_outside_the_root_is_refused(
        checkpoint: str, worker: vllm_cpu.Worker) -> None:
    with pytest.raises(ConfigError, match="relative path"):
        worker.dcr_load_dense(json.dumps({"checkpoint": checkpoint, "expect": None}))


def test_a_checkpoint_linked_out_of_the_root_is_refused(
        worker: vllm_cpu.Worker, checkpoint_root: Path, tmp_path: Path,
        versions: Callable[[str], list[Path]]) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    for f in versions(FAMILY)[1].iterdir():  # a real copy, outside the root
        shutil.copy(f, outside / f.name)
    link = checkpoint_root / "linked-out"
    link.symlink_to(outside, target_is_directory=True)
    before = rpc(worker.dcr_fingerprint)
    with pytest.raises(ConfigError, match="resolves outside"):
        worker.dcr_load_dense(json.dumps({"checkpoint": "linked-out", "expect": None}))
    inside = checkpoint_root / "file-linked-out"
    inside.mkdir()
    shutil.copy(outside / "config.json", inside / "config.json")
    (inside / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(DenseRefused, match="outside"):
        worker.dcr_load_dense(json.dumps({"checkpoint": "file-linked-out", "expect": None}))
    assert rpc(worker.dcr_fingerprint) == before


def test_a_dense_checkpoint_that_is_not_the_expected_version_writes_nothing(
        worker: vllm_cpu.Worker, versions: Callable[[str], list[Path]]) -> None:
    dirs = versions(FAMILY)
    with Checkpoint(dirs[2]) as v2:
        expect = {name: v2.fingerprint(name) for name in v2.names()}
    before = rpc(worker.dcr_fingerprint)
    with pytest.raises(DenseRefused, match="fingerprint differs"):
        worker.dcr_load_dense(json.dumps({"checkpoint": f"{FAMILY}/v1", "expect": expect}))
    assert rpc(worker.dcr_fingerprint) == before


def test_a_checkpoint_of_another_model_is_refused(worker: vllm_cpu.Worker,
                                                  versions: Callable[[str], list[Path]]
                                                  ) -> None:
    versions("llama")
    with pytest.raises(DenseRefused, match="canonical tensors"):
        worker.dcr_load_dense(json.dumps({"checkpoint": "llama/v1", "expect": None}))


def test_apply_before_prewarm_is_refused(versions: Callable[[str], list[Path]],
                                         staging: Path) -> None:
    w = vllm_cpu.Worker(vllm_cpu.build_model(versions(FAMILY)[0]))
    with pytest.raises(ConfigError, match="before dcr_prewarm"):
        w.dcr_apply(json.dumps({"payloads": ["x.dcrp"]}))


def test_weights_reallocated_since_prewarm_are_refused_before_any_write(
        worker: vllm_cpu.Worker, staging: Path, versions: Callable[[str], list[Path]]
        ) -> None:
    dirs = versions(FAMILY)
    names, _ = vllm_cpu.stage(staging, dirs, 1, profile_of(worker, dirs[0]))
    param = worker.model.model.norm.weight
    param.data = param.data.clone()  # what a reload or sleep mode could do
    before = rpc(worker.dcr_fingerprint)
    with pytest.raises(LoaderPathError, match="changed since prewarm"):
        worker.dcr_apply(json.dumps({"payloads": names}))
    assert rpc(worker.dcr_fingerprint) == before
    with pytest.raises(ConfigError, match="before dcr_prewarm"):  # until prewarmed again
        worker.dcr_apply(json.dumps({"payloads": names}))


@pytest.mark.parametrize("request_json", [
    '{"payloads": ["a.dcrp"], "staging": "/tmp"}',  # no directory from the caller
    '{"payloads": []}', '{"payloads": "a.dcrp"}', '["a.dcrp"]', "not json"])
def test_a_malformed_apply_request_is_refused(request_json: str,
                                              worker: vllm_cpu.Worker) -> None:
    with pytest.raises(ConfigError, match="ApplyRequest"):
        worker.dcr_apply(request_json)


def test_without_a_staging_directory_the_engine_refuses_to_apply(
        worker: vllm_cpu.Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCR_STAGING_DIR")
    with pytest.raises(ConfigError, match="DCR_STAGING_DIR"):
        worker.dcr_apply(json.dumps({"payloads": ["a.dcrp"]}))
    assert os.environ.get("DCR_CHECKPOINT_ROOT")
