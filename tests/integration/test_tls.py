"""DCR over TLS between real processes, every certificate signed by a test CA.

Two FSDP2 training ranks serve their shards over HTTPS, two ``dcr agent`` processes and
their ``dcr serve`` engines listen on HTTPS, and the trainer's coordinator
(``dcr.coordinate.LocalFleet``) verifies each of them against the CA: the refit commits
and every engine holds the bits of a dense load of the ranks' export. A warm encoder
publishes through a three-node relay tree over HTTPS (owner to root, member to member)
and a leaf hands out exactly the payloads the same publish writes into a file store.
Each server refuses a plain-HTTP caller; a coordinator holding another CA reaches none.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fsdp2_rank import CONFIG
from hf_pods import hf_pods
from safetensors.torch import save_file
from tlsca import Authority, Leaf, plain_get
from trainer_ranks import TrainerRanks
from transformers import LlamaForCausalLM

from dcr.coordinate import LocalFleet
from dcr.errors import RelayError
from dcr.format.layout import parse_payload_key
from dcr.format.profile import ReceiverProfile
from dcr.protocol.agent_api import AgentClient, AgentError
from dcr.protocol.coordinator import CoordinatorSettings
from dcr.protocol.encoder_api import PublishRequest
from dcr.refit.job import start_relays
from dcr.refit.launch import EncoderProcess
from dcr.refit.trainer import reference_fingerprint
from dcr.transport.relay import RelayClient
from dcr.transport.store import FileStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RANK_TOKEN = "tls-rank-token-0123456789abcdef"
AGENT_TOKEN = "tls-agent-token-0123456789abcdef"
ENCODER_TOKEN = "tls-encoder-token-0123456789abc"


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority.mint(tmp_path / "ca")


@pytest.fixture
def tls_env(ca: Authority, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Leaf:
    """Every process started from here serves with a leaf of the CA and trusts the CA."""
    leaf = ca.leaf(tmp_path / "tls")
    for key, value in leaf.env().items():
        monkeypatch.setenv(key, value)
    return leaf


def plain_refused(url: str, path: str = "/healthz") -> None:
    """A plain-HTTP request to a TLS server's port gets no HTTP answer."""
    assert url.startswith("https://127.0.0.1:"), url
    with pytest.raises((http.client.HTTPException, OSError)):
        plain_get(int(url.rsplit(":", 1)[1]), path)


@pytest.fixture
def agents(tmp_path: Path, tls_env: Leaf) -> Iterator[tuple[Path, list[AgentClient]]]:
    """Two rollout pods of v0, ``dcr serve`` and ``dcr agent`` both on HTTPS."""
    torch.manual_seed(0)
    v0 = tmp_path / "v0"
    LlamaForCausalLM(CONFIG).to(torch.bfloat16).save_pretrained(v0)
    with hf_pods(tmp_path, v0, tmp_path / "store", AGENT_TOKEN) as clients:
        yield v0, clients


def test_a_refit_over_https_between_processes_is_bit_exact(
        tmp_path: Path, agents: tuple[Path, list[AgentClient]]) -> None:
    v0, clients = agents
    store = FileStore(tmp_path / "store")
    with TrainerRanks.start(2, v0, 0, store.uri, RANK_TOKEN, tmp_path) as ranks:
        assert all(u.startswith("https://127.0.0.1:") for u in ranks.urls)
        fleet = LocalFleet(name="policy", store=store.uri, record=tmp_path / "commit.db",
                           owners=ranks.urls, owner_token=RANK_TOKEN,
                           agents=[a.url for a in clients], agent_token=AGENT_TOKEN,
                           settings=CoordinatorSettings(attempt_timeout_s=300.0))
        for version in (1, 2):
            assert min(ranks.step(version)) > 0
            done = fleet.refit(version)
            assert done.attempts[-1].outcome == "committed"
            want = reference_fingerprint(ranks.out / f"v{version}", "hf")
            for c in clients:
                assert c.fingerprint() == want, f"{c.name} differs at v{version}"
        for url in [*ranks.urls, *(a.url for a in clients)]:
            plain_refused(url)


def test_a_coordinator_holding_another_ca_reaches_no_agent(
        tmp_path: Path, agents: tuple[Path, list[AgentClient]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, clients = agents
    assert all(a.url.startswith("https://") for a in clients)
    monkeypatch.setenv("DCR_TLS_CA", str(Authority.mint(tmp_path / "other", "other").path))
    for a in clients:
        with pytest.raises(AgentError) as e:
            AgentClient(a.name, a.url, AGENT_TOKEN, timeout_s=30).status()
        assert a.url in str(e.value)
        assert "TLS certificate did not verify" in str(e.value)
        assert AGENT_TOKEN not in (tmp_path / a.name / "agent" / "agent.log").read_text()


# --- the relay ----------------------------------------------------------------------

NAMES = [f"model.layers.{i}.mlp.weight" for i in range(4)]
ATTEMPT = "a-tlsrelay00001"


def checkpoints(root: Path) -> tuple[Path, Path]:
    gen = torch.Generator().manual_seed(3)
    base = {n: torch.randn(512, 512, generator=gen).to(torch.bfloat16) for n in NAMES}
    target = {n: (t.float() * 1.01).to(torch.bfloat16) for n, t in base.items()}
    for name, tensors in (("v0", base), ("v1", target)):
        (root / name).mkdir(parents=True)
        save_file(tensors, str(root / name / "model.safetensors"))
    return root / "v0", root / "v1"


async def leaf_payloads(url: str, token: str, expected: int) -> list[bytes]:
    """Every payload of the attempt the leaf at ``url`` holds, once it holds ``expected``."""
    async with RelayClient(url, token) as c:
        deadline = time.monotonic() + 120
        while True:
            try:
                listed = await c.list_payloads(ATTEMPT)
            except RelayError:
                listed = []
            if len(listed) >= expected or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        return [await c.get_payload(ATTEMPT, p.owner, p.seq) for p in listed]


def test_a_warm_encoder_publishes_through_a_relay_tree_over_https(
        tmp_path: Path, tls_env: Leaf) -> None:
    base, target = checkpoints(tmp_path / "ckpt")
    tree = start_relays(tmp_path / "relay", 3)  # a root and two leaves
    urls, publish = tree.urls, tree.publish_token_file.read_text().strip()
    encoders = []
    try:
        for name, store in (("relay", f"relay+{urls[0]}"),
                            ("file", (tmp_path / "store").as_uri())):
            enc = EncoderProcess(name=name, workdir=tmp_path / name, token=ENCODER_TOKEN,
                                 env={"DCR_RELAY_TOKEN": publish},
                                 args=["--store", store, "--checkpoint-root",
                                       str(tmp_path / "ckpt")])
            encoders.append(enc)
            enc.start()
            enc.wait_ready()
        request = PublishRequest(
            attempt=ATTEMPT, mode="mixed", base_version=0, target_version=1, owner=0,
            owners=1, base=str(base), target=str(target), bucket_mib=1,
            profile=ReceiverProfile(tensors=dict.fromkeys(NAMES, "xor")))
        for enc in encoders:
            assert enc.client().publish(request, timeout_s=300)["payloads"] >= 1
        files = {k: p for p in (tmp_path / "store").rglob("*.dcrp")
                 if (k := parse_payload_key(str(p.relative_to(tmp_path / "store"))))}
        assert files
        assert {k.attempt for k in files} == {ATTEMPT}
        read = tree.read_token_file.read_text().strip()
        got = asyncio.run(leaf_payloads(urls[2], read, len(files)))
        digest = hashlib.sha256
        assert sorted(digest(b).hexdigest() for b in got) == sorted(
            digest(p.read_bytes()).hexdigest() for p in files.values())
        for url in [*urls, *(e.url for e in encoders)]:
            plain_refused(url)
        for i in range(3):
            log = (tmp_path / "relay" / f"relay-{i}.log").read_text()
            assert publish not in log
            assert "Traceback" not in log, log[-2000:]
    finally:
        for enc in encoders:
            enc.stop()
        for p in tree.procs:
            p.kill()
            p.wait(10)
