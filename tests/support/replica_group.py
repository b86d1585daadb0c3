"""A replica spanning two pods, as processes on loopback: the leader pod's ``dcr serve``
(TP rank 0, ``--peer`` the worker's) and its agent, the worker pod's ``dcr serve`` (TP
rank 1) and its member agent. The pods share nothing but the store: each has its own
staging directory and checkpoint root (its own copy of the starting checkpoint).

Used by tests/integration/test_replica_group.py (a coordinator drives the leader) and
tests/operator/test_operator_groups.py (the operator does, the pods being Pod objects at
the processes' loopback addresses).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from stubs import free_port_on

from dcr.drivers.base import merge_fingerprints
from dcr.protocol.agent_api import AgentClient
from dcr.refit.launch import AgentProcess, ServeProcess
from dcr.refit.trainer import reference_fingerprint

API_KEY = "group-test-api-key-0123456789abcd"
POD_NAMES = ("leader", "worker")


def export_llama_versions(root: Path, config: object, versions: int = 3) -> None:
    """Versions ``0..versions-1`` of a transformers Llama under ``root/v<N>``, each a
    ``save_pretrained`` directory in BF16, one real AdamW step (lr 1e-3, random tokens)
    apart; seeded, so every call with the same config writes the same bits."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for v in range(versions):
        if v:
            ids = torch.randint(0, config.vocab_size, (2, 16))  # type: ignore[attr-defined]
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        export = LlamaForCausalLM(config)
        export.load_state_dict(model.state_dict())
        export.to(torch.bfloat16).save_pretrained(root / f"v{v}")


def flip_bits(src: Path, dst: Path, flips: dict[str, int]) -> None:
    """A copy of checkpoint ``src`` at ``dst`` with the lowest bit of one element flipped
    in each tensor of ``flips`` (name -> flat element index): a rank that loads it holds
    bits no version has."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for file in sorted(dst.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        hit = flips.keys() & tensors.keys()
        for name in hit:
            bits = tensors[name].view(-1).view(torch.int16)  # BF16 checkpoints
            bits[flips[name]] ^= 1
        if hit:
            save_file(tensors, str(file), metadata=meta)


@dataclass(eq=False)
class TwoPodReplica:
    """The two pods of one replica, each with its server, agent, staging and root.

    ``hosts`` are the pods' addresses; both agents listen on ``agent_port`` there (a
    fleet's ``agent.port``), each server on another port of its pod.
    """

    tmp: Path
    versions: Path  # v0, v1, ... as the training side exports them
    store: Path
    token: str
    hosts: tuple[str, str] = ("127.0.0.1", "127.0.0.1")
    agent_port: int | None = None  # default: a free port per agent
    # Read from relay nodes instead of the store: (the leader pod's node, the worker's),
    # and the file holding the tree's read token.
    relays: tuple[str, str] | None = None
    relay_token_file: Path | None = None
    # The checkpoint the worker pod's server loads at start (default: its root's v0): one
    # other than the pod's seed holds bits the pod's agents were not told about.
    worker_model: Path | None = None

    def __post_init__(self) -> None:
        for pod in POD_NAMES:
            shutil.copytree(self.versions / "v0", self.root(pod) / "v0")
            self.staging(pod).mkdir(parents=True)
        self.worker_serve = self._serve("worker", ["--tp-rank", "1"])
        self.leader_serve = self._serve("leader", ["--tp-rank", "0", "--peer",
                                                   self.worker_serve.url])
        self.member = self._agent("worker", ["--role", "member"])
        self.leader = self._agent("leader", ["--engine-url", self.leader_serve.url,
                                             "--member", self.member.url])
        for p in (self.worker_serve, self.leader_serve, self.member, self.leader):
            p.start()
        for p in (self.worker_serve, self.leader_serve, self.member, self.leader):
            p.wait_ready()
        self.client: AgentClient = self.leader.client(timeout_s=120.0)
        self.client.profile()  # the leader's agent has met and prewarmed both ranks

    def host(self, pod: str) -> str:
        return self.hosts[POD_NAMES.index(pod)]

    def root(self, pod: str) -> Path:
        return self.tmp / pod / "ckpts"

    def staging(self, pod: str) -> Path:
        return self.tmp / pod / "staging"

    def _serve(self, pod: str, extra: list[str]) -> ServeProcess:
        host = self.host(pod)
        while (port := free_port_on(host)) == self.agent_port:
            pass
        model = self.root(pod) / "v0"
        if pod == "worker" and self.worker_model is not None:
            model = self.worker_model
        return ServeProcess(
            name=f"serve-{pod}", workdir=self.tmp / pod / "serve", api_key=API_KEY,
            host=host, port=port,
            args=["--runtime", "vllm-ref", "--model", str(model),
                  "--tp-size", "2", "--staging-dir", str(self.staging(pod)),
                  "--checkpoint-root", str(self.root(pod)), "--weight-version", "0", *extra])

    def _agent(self, pod: str, extra: list[str]) -> AgentProcess:
        key = self.tmp / pod / "engine-key"
        key.write_text(API_KEY + "\n")
        key.chmod(0o600)
        host = self.host(pod)
        source = ["--store", self.store.as_uri()]
        if self.relays is not None:  # this pod's own node of the tree
            source = ["--relay", self.relays[POD_NAMES.index(pod)],
                      "--relay-token-file", str(self.relay_token_file)]
        return AgentProcess(
            name=f"{pod}-agent", state_dir=self.tmp / pod / "agent", token=self.token,
            host=host, port=self.agent_port or free_port_on(host),
            args=[*source, "--staging-dir", str(self.staging(pod)),
                  "--canonical", str(self.root(pod) / "v0"), "--model-version", "0",
                  "--engine-api-key-file", str(key), "--staging-mib", "64", *extra])

    def instance(self) -> str:
        """The engine instance the leader's agent journaled: every rank's, joined."""
        return str(json.loads((self.tmp / "leader" / "agent" / "journal.json")
                              .read_text())["instance"])

    def restart_worker(self) -> None:
        """The worker pod dies and comes back: its rank loads v0 from its root again."""
        self.worker_serve.kill()
        self.member.kill()
        self.worker_serve.restart()
        self.member.restart()

    def close(self) -> None:
        for p in (self.leader, self.member, self.leader_serve, self.worker_serve):
            p.kill()

    def assert_holds(self, version: int) -> None:
        """Both ranks, across both pods, hold a dense load of ``version`` bit for bit."""
        want = merge_fingerprints([reference_fingerprint(self.versions / f"v{version}",
                                                         "vllm-ref", tp_size=2, tp_rank=r)
                                   for r in range(2)])
        got = self.client.fingerprint()
        assert got.keys() == want.keys()
        assert [n for n in want if got[n] != want[n]] == []
        st = self.client.status()
        assert (st.version, st.dirty, st.unknown) == (version, None, None)
        for pod in POD_NAMES:  # nothing left behind in either pod
            assert [p.name for p in self.staging(pod).iterdir()
                    if p.name.endswith(".dcrp")] == []
