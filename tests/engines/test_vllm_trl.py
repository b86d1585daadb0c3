"""``dcr.integrations.trl`` on a real ``vllm serve``: samples through the door, a refit per step.

A rollout pod as the chart runs it for vLLM (``vllm serve`` with DCR's worker extension,
``dcr agent --engine vllm`` beside it with its client door) and a trainer in this process
over the same Llama: after each real AdamW step, the callback TRL calls (``on_step_end``)
refits the pod by DCR from the trainer's live weights, and the rollout function TRL calls
(``rollout_func(prompts, trainer)``) draws the next batch through the door. Every token of
that batch carries the new version; the engine's weights and a greedy completion then equal
those of a dense load of the trainer's weights (BF16) through the same server.

The engine tier runs from vLLM's venv, which has no TRL: the two pieces need only
transformers, and this test calls them as GRPOTrainer does (tests/integration/test_trl.py
runs GRPOTrainer itself on ``dcr serve`` pods). vLLM 0.32 reports weight versions on its
token route alone, so the rollout asks ``/inference/v1/generate`` (``api="generate"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import vllm_serve

if vllm_serve.cpu_build() is None:
    pytest.skip("needs vLLM's CPU build (DCR_VLLM_FLAVOUR=cpu tools/engines/setup.sh): only "
                "it runs `vllm serve` without a GPU", allow_module_level=True)

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaForCausalLM

from dcr.format.profile import ReceiverProfile
from dcr.integrations.trl import DcrWeightSync, FleetRollout, RolloutSettings
from dcr.protocol.agent_api import AgentClient
from dcr.protocol.commitstore import SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings
from dcr.protocol.records import CommitRecord
from dcr.refit.launch import AgentProcess, free_port
from dcr.transport.store import FileStore

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow, pytest.mark.e2e]
LR = 1e-4
TOKEN = "vllm-trl-agent-token-0123456789abcd"
PROMPTS = ["t5 t6 t7 t8", "t9 t10 t11"]  # the checkpoints' word-level tokenizer
DOOR_ROUTES = ("POST /inference/v1/generate", "POST /v1/completions")


@dataclass(kw_only=True)
class Rig:
    """The pod (server, agent, its door) and the trainer over the same starting model."""

    root: Path  # the engine's checkpoint root
    server: vllm_serve.VllmServer
    client: AgentClient
    door: str
    model: LlamaForCausalLM
    sync: DcrWeightSync
    store: Path


@pytest.fixture
def rig(tmp_path: Path, checkpoint_root: Path) -> Iterator[Rig]:
    v0 = vllm_serve.serve_versions(checkpoint_root / "llama-trl", steps=0, lr=LR)[0]
    staging, store = tmp_path / "staging", tmp_path / "store"
    server = vllm_serve.VllmServer(name="rollout-0", model=v0, root=v0.parent,
                                   staging=staging, workdir=tmp_path / "vllm")
    door = f"127.0.0.1:{free_port()}"
    routes = [a for route in DOOR_ROUTES for a in ("--client-route", route)]
    agent = AgentProcess(name="rollout-0", state_dir=tmp_path / "agent", token=TOKEN,
                         args=["--store", store.as_uri(), "--engine", "vllm",
                               "--engine-url", server.url, "--staging-dir", str(staging),
                               "--canonical", str(v0), "--model-version", "0",
                               "--client-listen", door, *routes])
    coordinators: list[Coordinator] = []
    try:
        for proc in (server, agent):  # the agent finds its engine up, as in a pod
            proc.start()
            proc.wait_ready()
        client = agent.client(timeout_s=600)
        profile = ReceiverProfile.model_validate(client.profile())

        def coordinator_for(owner: Any) -> Coordinator:
            owner.profile = profile
            commits = SqliteCommitStore(tmp_path / "commit.db", CommitRecord(
                committed_version=0, baseline_id=str(v0), attempt=""))
            # vLLM's CPU build packs its linear layers after loading, so the agent starts
            # with its weights unknown and rejoins densely at version 0 once.
            coordinators.append(Coordinator(
                commits, [owner], [client], settings=CoordinatorSettings(
                    attempt_timeout_s=600), dense_checkpoint={0: str(v0)}.__getitem__))
            return coordinators[-1]

        model = LlamaForCausalLM.from_pretrained(v0, dtype=torch.float32)
        sync = DcrWeightSync.for_model(model, store=FileStore(store), dtype=torch.bfloat16,
                                       coordinator_for=coordinator_for)
        yield Rig(root=v0.parent, server=server, client=client, door=f"http://{door}",
                  model=model, sync=sync, store=store)
    finally:
        for c in coordinators:
            c.close()
        agent.kill()
        server.kill()


def step(rig: Rig, k: int, optim: torch.optim.Optimizer) -> None:
    """One AdamW step on random tokens, then the callback TRL calls after it."""
    ids = torch.randint(0, rig.model.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(k))
    rig.model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()
    rig.sync.on_step_end(None, SimpleNamespace(global_step=k), None, model=rig.model)


def export(rig: Rig, name: str) -> str:
    """The trainer's weights as BF16 under the engine's checkpoint root, for the test's
    dense load alone: the refit never reads it."""
    there = rig.root / name
    there.mkdir()
    save_file({n: p.detach().to(torch.bfloat16).contiguous()
               for n, p in rig.model.named_parameters()}, str(there / "model.safetensors"))
    return name


def test_a_grpo_step_refits_the_vllm_pod_and_the_next_batch_comes_from_the_new_weights(
        rig: Rig) -> None:
    optim = torch.optim.AdamW(rig.model.parameters(), lr=LR)
    trainer = SimpleNamespace(processing_class=AutoTokenizer.from_pretrained(
        rig.server.model))
    rollout = FleetRollout([rig.door], sync=rig.sync, settings=RolloutSettings(
        api="generate", model=vllm_serve.SERVED, max_tokens=8, max_staleness=0))
    greedy: list[tuple[str, list[float]]] = []
    for k in (1, 2):
        step(rig, k, optim)
        assert (rig.sync.version, rig.sync.committed) == (k, k)
        batch = rollout(PROMPTS, trainer)  # as GRPOTrainer calls its rollout_func
        assert len(batch["completion_ids"]) == len(PROMPTS)
        for ids, versions, logprobs in zip(batch["completion_ids"], batch["weight_versions"],
                                           batch["logprobs"], strict=True):
            assert 1 <= len(ids) <= 8  # sampled: an end-of-sequence token may end it early
            assert versions == [k] * len(ids)  # every token from the step's weights
            assert len(logprobs) == len(ids)
            assert all(x <= 0 for x in logprobs)
        assert rollout.calls[-1].dropped == 0
        assert rig.client.status().version == k
        greedy.append(vllm_serve.greedy(rig.server.url, [5, 6, 7, 8]))
    assert [s.record.committed_version for s in rig.sync.steps if s.record] == [1, 2]
    assert greedy[0][1] != greedy[1][1]  # the second batch's weights are not the first's
    assert not list(rig.store.rglob("*.safetensors"))  # the trainer wrote no checkpoint
    engine = rig.server.engine()
    refit = engine.fingerprint()
    engine.load_dense(export(rig, "trained-v2"))
    assert engine.fingerprint() == refit
    assert vllm_serve.greedy(rig.server.url, [5, 6, 7, 8]) == greedy[1]
