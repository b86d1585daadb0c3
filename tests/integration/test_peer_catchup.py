"""A pod that missed versions takes the committed version from a live peer, checked by the
store's history, and falls back to the store when no peer's copy is fit.

The training side commits v1..v4 of a tiny Llama into a real S3 server (``rclone serve
s3``) and records each in the store's history. Rollout pods are real processes: ``dcr
serve`` (the ``hf`` runtime) and its ``dcr agent`` on ``--store s3://...``, each holding
only the run's starting model (v0) on its own volume. The donor pod rejoins v4 from the
store; a new pod given ``--donor`` then takes the donor's copy, with only the history and
manifests read from the store; a relay fleet's pod (``--relay`` and ``--store``) takes an
older donor's v2 and replays the rest from the store. A hostile donor (a stub lending v3's
bits as v4), a donor in the middle of an attempt and requests without the peer read token
are refused; every pod ends bit-exact with a dense load of v4 (integer views of every
parameter and buffer).
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from aiohttp import web
from appserver import Server
from promtext import samples, value
from s3server import S3Server
from transformers import LlamaConfig, LlamaForCausalLM

from dcr.checkpoint import Checkpoint
from dcr.files.history import HistoryStore
from dcr.files.materialize import recorded_version
from dcr.http.tokens import write_token_file
from dcr.owner.encoder import Encoder
from dcr.protocol.agent_api import AgentClient, AgentError, AttemptSpec
from dcr.protocol.peer_api import LEASE_PATH, LentFile, Offer
from dcr.protocol.records import Attempt, CommitRecord, Transition
from dcr.receiver.fromstore import FROM_STORE
from dcr.refit.launch import AgentProcess, ServeProcess
from dcr.refit.trainer import reference_fingerprint
from dcr.transport.s3 import S3Store

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.e2e]

TOKEN = "agent-test-token-0123456789abcdef"
PEER_TOKEN = "peer-read-token-fedcba9876543210"
LAST = 4
LLAMA = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    tie_word_embeddings=False)


@dataclass
class Run:
    tmp: Path
    train: Path  # v0..v4, save_pretrained directories (never mounted by a pod)
    uri: str
    env: dict[str, str]  # the agents' AWS_* variables
    digest: str  # the history's, as the commit record carries it
    want: dict[str, str]  # a dense load of v4 through the hf runtime
    procs: list[ServeProcess | AgentProcess] = field(default_factory=list)

    def pod(self, name: str, *args: str) -> AgentClient:
        """A rollout pod holding v0 on its own volume: its server and its agent."""
        root = self.tmp / name / "ckpts"
        shutil.copytree(self.train / "v0", root / "v0")
        staging = self.tmp / name / "staging"
        staging.mkdir(parents=True)
        server = ServeProcess(name=f"serve-{name}", workdir=self.tmp / name / "serve",
                              args=["--runtime", "hf", "--model", str(root / "v0"),
                                    "--tp-size", "1", "--staging-dir", str(staging),
                                    "--checkpoint-root", str(root), "--weight-version", "0"])
        self.procs.append(server)
        server.start()
        server.wait_ready()
        peer = ["--peer-token-file", str(write_token_file(self.tmp / f"{name}.peer",
                                                          PEER_TOKEN))]
        agent = AgentProcess(name=name, state_dir=self.tmp / name / "agent", token=TOKEN,
                             env=self.env,
                             args=["--store", self.uri, "--engine-url", server.url,
                                   "--staging-dir", str(staging), "--canonical",
                                   str(root / "v0"), "--model-version", "0", *peer, *args])
        self.procs.append(agent)
        agent.start()
        agent.wait_ready()
        client = agent.client(timeout_s=120.0)
        client.profile()  # once the agent has met and prewarmed its server
        return client

    def log(self, name: str) -> str:
        return (self.tmp / name / "agent" / "agent.log").read_text()

    def assert_holds_last(self, client: AgentClient) -> None:
        got = client.fingerprint()
        assert got.keys() == self.want.keys()
        differ = [n for n in self.want if got[n] != self.want[n]]
        assert differ == [], f"{client.name} differs from a dense load of v{LAST}: {differ[:4]}"
        assert client.status().version == LAST


def metrics(client: AgentClient) -> dict[str, float]:
    with urllib.request.urlopen(f"{client.url}/metrics", timeout=30) as r:
        parsed = samples(r.read().decode())
    return {n: value(parsed, f"dcr_agent_{n}_total")
            for n in ("peer_bytes_fetched", "peer_refusals", "store_bytes_fetched",
                      "dense_loads")}


def lease(url: str, token: str | None, version: int = LAST) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"{url}{LEASE_PATH}", method="POST", headers=headers,
                                 data=json.dumps({"version": version}).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read() or b"{}")  # every DCR error is a JSON body


def release(url: str, lease_id: str) -> None:
    req = urllib.request.Request(f"{url}/v1/peer/release", method="POST",
                                 data=json.dumps({"lease": lease_id}).encode(),
                                 headers={"Authorization": f"Bearer {PEER_TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def commit_versions(train: Path, store: S3Store) -> str:
    """v1..v4 through the encoder, each recorded in the history as a coordinator does;
    the last history digest."""
    history, digest = HistoryStore(store), ""
    owner = Encoder(store=store, baseline=Checkpoint(train / "v0"), version=0)
    for v in range(1, LAST + 1):
        owner.set_candidate(Checkpoint(train / f"v{v}"), v)
        attempt = Attempt(transition=Transition(base_version=v - 1, target_version=v),
                          mode="mixed", receivers=("pods",), deadline=time.time() + 600)
        owner.publish(attempt)
        digest = history.commit(v, attempt.id, 1)
        owner.advance_baseline(CommitRecord(committed_version=v, baseline_id=f"v{v}",
                                            attempt=attempt.id))
    return digest


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("peers")
    train = tmp / "train"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LLAMA).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for v in range(LAST + 1):
        if v:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-2 * torch.randn(p.shape, generator=gen).to(p.dtype))
        model.save_pretrained(train / f"v{v}")
    creds = {"AWS_ACCESS_KEY_ID": s3_server.access_key,
             "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    uri = f"s3://{s3_server.bucket}/{tmp.name}"
    store = S3Store(uri, endpoint=s3_server.endpoint, region=s3_server.region,
                    credentials=creds)
    env = {**creds, "AWS_ENDPOINT_URL": s3_server.endpoint,
           "AWS_DEFAULT_REGION": s3_server.region, "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": str(tmp / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "none")}
    r = Run(tmp=tmp, train=train, uri=uri, env=env, digest=commit_versions(train, store),
            want=reference_fingerprint(train / f"v{LAST}", "hf"))
    before = reference_fingerprint(train / f"v{LAST - 1}", "hf")
    assert sum(before[n] != r.want[n] for n in r.want) >= len(r.want) - 1  # not vacuous
    try:
        yield r
    finally:
        for proc in r.procs:
            proc.kill()


@pytest.fixture(scope="module")
def donor(run: Run) -> AgentClient:
    """A pod that rejoined v4 from the store: its copy is lent to peers."""
    client = run.pod("donor")
    assert client.rejoin(LAST, None, run.digest).version == LAST
    m = metrics(client)
    assert m["peer_bytes_fetched"] == 0
    assert m["store_bytes_fetched"] > 0
    assert recorded_version(run.tmp / "donor" / "ckpts" / FROM_STORE) == LAST
    return client


def test_a_pod_that_missed_versions_catches_up_from_a_peer_bit_exact(
        run: Run, donor: AgentClient) -> None:
    """Held v0, missed v1..v4: the donor's copy of v4 is taken whole and checked by the
    history's fingerprints; the store gives only the history and the manifests."""
    pod = run.pod("reader", "--donor", donor.url)
    assert pod.rejoin(LAST, None, run.digest).version == LAST
    run.assert_holds_last(pod)
    m, d = metrics(pod), metrics(donor)
    copy = run.tmp / "donor" / "ckpts" / FROM_STORE / "model.safetensors"
    assert m["peer_bytes_fetched"] == copy.stat().st_size
    assert m["peer_refusals"] == 0
    assert 0 < m["store_bytes_fetched"] < d["store_bytes_fetched"] / 4  # no payload fetched
    assert recorded_version(run.tmp / "reader" / "ckpts" / FROM_STORE) == LAST
    config = run.tmp / "reader" / "ckpts" / FROM_STORE / "config.json"
    assert config.read_bytes() == (run.train / "v0" / "config.json").read_bytes()  # its seed's


def hostile_donor(run: Run) -> Server:
    """A stub that lends v3's file as v4: the right names, sizes and shapes, other bits."""
    lent = run.train / f"v{LAST - 1}" / "model.safetensors"

    async def lease(_: web.Request) -> web.StreamResponse:
        offer = Offer(lease="ab" * 16, version=LAST, lease_s=60.0,
                      files=(LentFile(name="model.safetensors", size=lent.stat().st_size),))
        return web.Response(body=offer.model_dump_json(), content_type="application/json")

    async def file(_: web.Request) -> web.StreamResponse:
        return web.FileResponse(lent)

    async def release(_: web.Request) -> web.StreamResponse:
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.post("/v1/peer/lease", lease), web.get("/v1/peer/file", file),
                    web.post("/v1/peer/release", release)])
    return Server(app)


def test_a_peer_offering_wrong_bits_is_refused_by_name_and_the_store_is_used(
        run: Run) -> None:
    """Without the check of the donor's copy against the history, the pod takes v3's bits
    as v4, the engine's own check refuses the dense load and the rejoin fails (409)."""
    stub = hostile_donor(run)
    try:
        pod = run.pod("misled", "--donor", stub.url)
        assert pod.rejoin(LAST, None, run.digest).version == LAST
    finally:
        stub.close()
    run.assert_holds_last(pod)
    m = metrics(pod)
    assert (m["peer_refusals"], m["peer_bytes_fetched"]) == (1, 0)
    log = run.log("misled")
    assert f"the copy of peer {stub.url} is refused" in log
    assert "differ from the fingerprints the history vouches for" in log
    assert not (run.tmp / "misled" / "ckpts" / ".dcr-from-peer").exists()


def test_a_donor_in_an_attempt_lends_nothing_and_the_reader_uses_the_store(
        run: Run, donor: AgentClient) -> None:
    """While the donor stages an attempt its copy is not lent (409 naming the attempt); a
    reader then builds from the store, and once the attempt is stopped it lends again.
    Without the check the lease answers 200 mid-attempt."""
    spec = AttemptSpec(attempt="a-peer-busy-0001", base_version=LAST,
                       target_version=LAST + 1, mode="mixed", deadline=time.time() + 600)
    donor.prepare(spec)
    try:
        status, body = lease(donor.url, PEER_TOKEN)
        assert status == 409
        assert "a-peer-busy-0001" in str(body["error"])
        pod = run.pod("busy-reader", "--donor", donor.url)
        assert pod.rejoin(LAST, None, run.digest).version == LAST
        run.assert_holds_last(pod)
        m = metrics(pod)
        assert (m["peer_refusals"], m["peer_bytes_fetched"]) == (1, 0)
        assert m["store_bytes_fetched"] > 0
        assert "lends nothing now: attempt a-peer-busy-0001" in run.log("busy-reader")
    finally:
        donor.stop_and_wait(spec.attempt)
    status, body = lease(donor.url, PEER_TOKEN)
    assert status == 200
    assert body["version"] == LAST
    release(donor.url, str(body["lease"]))


def test_the_donor_routes_ask_for_the_peer_read_token_and_nothing_else(
        run: Run, donor: AgentClient) -> None:
    """Without the donor routes' own token check a lease without a token answers 200."""
    assert lease(donor.url, None)[0] == 401
    assert lease(donor.url, TOKEN)[0] == 401  # the agent token drives refits, not this
    assert lease(donor.url, "x" * 32)[0] == 401
    file = urllib.request.Request(f"{donor.url}/v1/peer/file?lease={'ab' * 16}"
                                  "&name=model.safetensors")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(file, timeout=30)
    with e.value:
        assert e.value.code == 401
    peer_on_agent = AgentClient("donor", donor.url, PEER_TOKEN)
    with pytest.raises(AgentError) as refused:
        peer_on_agent.status()
    assert refused.value.status == 401  # the peer token drives nothing
    status, body = lease(donor.url, PEER_TOKEN)
    assert status == 200
    release(donor.url, str(body["lease"]))


def test_a_relay_fleets_pod_takes_an_older_peer_copy_and_replays_the_rest_from_the_store(
        run: Run, donor: AgentClient) -> None:
    """A donor whose copy is v2 (it rejoined then); a pod of a relay fleet (``--relay``
    for attempts, ``--store`` for the history) takes that copy, checked against the
    history's v2, and replays v3 and v4 from the store: bit-exact, with half the deltas a
    replay from its own v0 fetches (the donor's v0 -> v4)."""
    old = run.pod("old-donor")
    assert old.rejoin(2, None, run.digest).version == 2
    relay_token = write_token_file(run.tmp / "relay.token", "relay-read-token-0123456789ab")
    pod = run.pod("relay-reader", "--donor", old.url, "--relay", "http://127.0.0.1:9",
                  "--relay-token-file", str(relay_token))
    assert pod.rejoin(LAST, None, run.digest).version == LAST
    run.assert_holds_last(pod)
    m, whole = metrics(pod), metrics(donor)
    assert m["peer_refusals"] == 0
    assert m["peer_bytes_fetched"] > 0
    assert 0 < m["store_bytes_fetched"] < 0.75 * whole["store_bytes_fetched"]  # v3, v4 only
    assert "took version 2 from peer" in run.log("relay-reader")
