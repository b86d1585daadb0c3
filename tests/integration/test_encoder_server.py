"""The warm encoder (``dcr encoder``): what it writes, and each of its defences.

A real ``dcr encoder`` process on loopback publishes a two-owner attempt, and ``dcr
encode`` (what an encoder Job runs) publishes the same attempt into a second store:
the two stores hold the same objects, byte for byte. Then every defence of
:mod:`dcr.owner.server` against a caller: the token, the checkpoint roots (``..``,
symlinks, paths outside), no store in a request, strict bodies of bounded size. The
in-process app, in front of a store that holds its writes until told, shows one
publish per (attempt, owner) at a time, a stop that ends a publish between buckets
before its manifest part, and a caller that goes away stopping its publish too.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dcr.format.profile import ReceiverProfile, dumps
from dcr.owner.server import (
    BackgroundServer,
    CheckpointPublisher,
    EncoderService,
    publish_settings,
)
from dcr.owner.settings import EncodeSettings
from dcr.protocol.encoder_api import EncoderClient, EncoderError, PublishRequest
from dcr.refit.launch import EncoderProcess
from dcr.settings import MiB
from dcr.transport.store import FileStore

TOKEN = "warm-encoder-token-3f9a1c2e7b"
NAMES = [f"model.layers.{i}.mlp.weight" for i in range(6)]
ATTEMPT = "a-0123456789ab"


@dataclass
class Pair:
    root: Path  # the checkpoint root
    base: Path
    target: Path
    profile: ReceiverProfile


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """Two sharded BF16 checkpoints 2 MiB per tensor apart by ~1% of their elements."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("ckpts")
    gen = torch.Generator().manual_seed(7)
    base = {n: torch.randn(1024, 1024, generator=gen).to(torch.bfloat16) for n in NAMES}
    target = {}
    for i, (n, t) in enumerate(base.items()):
        t = t.clone()
        if i != 2:  # one tensor stays as it was
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=gen)
            flat[idx] = flat[idx] * 1.5 + 0.01
        target[n] = t
    for name, tensors in (("v0", base), ("v1", target)):
        d = root / name
        d.mkdir()
        weight_map = {}
        for k in range(2):
            shard = f"model-{k + 1:05d}-of-00002.safetensors"
            save_file({n: tensors[n] for n in NAMES[k::2]}, str(d / shard))
            weight_map.update(dict.fromkeys(NAMES[k::2], shard))
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    profile = ReceiverProfile(tensors={**dict.fromkeys(NAMES, "xor"), NAMES[1]: "overwrite",
                                       NAMES[3]: "dense"})
    return Pair(root=root, base=root / "v0", target=root / "v1", profile=profile)


@pytest.fixture(scope="module")
def encoder(pair: Pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EncoderProcess]:
    work = tmp_path_factory.mktemp("encoder")
    proc = EncoderProcess(name="warm", workdir=work, token=TOKEN,
                          args=["--store", (work / "store").as_uri(),
                                "--checkpoint-root", str(pair.root), "--threads", "2"])
    proc.start()
    try:
        said = proc.wait_ready()
        assert said["store"] == (work / "store").as_uri()
        yield proc
    finally:
        proc.stop()


def request(pair: Pair, **changes: Any) -> PublishRequest:
    fields: dict[str, Any] = {
        "attempt": ATTEMPT, "mode": "mixed", "base_version": 0, "target_version": 1,
        "owner": 0, "owners": 1, "base": str(pair.base), "target": str(pair.target),
        "bucket_mib": 1, "profile": pair.profile, **changes}
    return PublishRequest(**fields)


def post(url: str, path: str, body: bytes | dict[str, Any],
         authorization: str | None = f"Bearer {TOKEN}") -> tuple[int, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        conn.request("POST", path, body=data, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")
    finally:
        conn.close()


def files(root: Path) -> dict[str, str]:
    """path -> SHA-256 of every object under a file store."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def store_dir(proc: EncoderProcess) -> Path:
    return proc.workdir / "store"


# --- what it writes -------------------------------------------------------------------


@pytest.mark.slow
def test_a_publish_writes_byte_for_byte_what_dcr_encode_writes(
        pair: Pair, encoder: EncoderProcess, tmp_path: Path) -> None:
    """Both owners of a two-owner attempt with a profile (XOR, overwrite and dense
    tensors) and 1 MiB buckets: the warm encoder's store and ``dcr encode``'s hold the
    same objects with the same bytes, and the answers are ``dcr encode``'s summaries."""
    attempt = "a-sameasencode1"
    profile_file = tmp_path / "profile.json"
    profile_file.write_text(dumps(pair.profile))
    cold = tmp_path / "cold"
    client = encoder.client()
    for owner in (0, 1):
        req = request(pair, attempt=attempt, owner=owner, owners=2)
        warm = client.publish(req, timeout_s=120)
        settings = EncodeSettings(target_version=1, base_version=0, mode="mixed", attempt=attempt,
                                  owner=owner, owners=2, bucket_bytes=1 * MiB,
                                  profile_path=profile_file)
        # What an encoder Job's container runs (jobs.encode_args builds it the same way).
        argv = settings.argv(str(pair.base), str(pair.target), store=cold.as_uri())
        done = subprocess.run([sys.executable, "-m", "dcr", *argv], capture_output=True,
                              text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        cold_summary = json.loads(done.stdout)
        assert warm.pop("store") == store_dir(encoder).as_uri()
        assert cold_summary.pop("store") == cold.as_uri()
        warm.pop("seconds")
        cold_summary.pop("seconds")
        assert warm == cold_summary
        assert warm["payloads"] >= 2  # 1 MiB buckets of 2 MiB tensors: several payloads
    warm_files = {k: v for k, v in files(store_dir(encoder)).items() if attempt in k}
    assert warm_files == files(cold)
    assert {Path(k).name for k in warm_files} >= {"manifest-o0000.dcrm", "manifest-o0001.dcrm"}


def test_the_settings_are_those_dcr_encode_parses_from_a_jobs_arguments(pair: Pair) -> None:
    """publish_settings equals what ``dcr encode`` builds from the Job's argv (the
    profile aside: the Job reads it from a file, the request carries it)."""
    from dcr.cli import build_parser, encode_settings

    req = request(pair, owner=1, owners=3, mode="overwrite", bucket_mib=64)
    warm = publish_settings(req, threads=EncodeSettings.threads)
    argv = EncodeSettings(target_version=1, base_version=0, mode="overwrite", attempt=ATTEMPT,
                          owner=1, owners=3, bucket_bytes=64 * MiB).argv(
        str(pair.base), str(pair.target), store="file:///x")
    cold = encode_settings(build_parser("encode").parse_args(argv))
    assert warm == EncodeSettings(**{**cold.__dict__, "profile": pair.profile})
    assert warm.per_attempt_manifest


# --- defences over HTTP -----------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token-0123456789",
                                           TOKEN, f"Bearer {TOKEN}x", f"bearer {TOKEN}"],
                         ids=["absent", "wrong", "no-bearer", "longer", "lowercase"])
def test_every_route_but_healthz_needs_the_exact_token(
        pair: Pair, encoder: EncoderProcess, authorization: str | None) -> None:
    before = files(store_dir(encoder))
    body = json.loads(request(pair, attempt="a-unauthorized1").model_dump_json())
    for path, sent in (("/v1/publish", body), ("/v1/stop", {"attempt": "a-unauthorized1"})):
        status, answer = post(encoder.url, path, sent, authorization)
        assert (status, answer["kind"]) == (401, "Unauthorized"), answer
    assert files(store_dir(encoder)) == before
    conn = http.client.HTTPConnection("127.0.0.1", encoder.port, timeout=10)
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200
    conn.close()


def test_the_token_never_reaches_the_log(pair: Pair, encoder: EncoderProcess) -> None:
    encoder.client().publish(request(pair, attempt="a-logged0001"), timeout_s=120)
    post(encoder.url, "/v1/publish", {"attempt": "bad attempt"})  # a 400 is logged too
    log = encoder.log_path.read_text()
    assert "a-logged0001" in log  # the publish was logged ...
    assert TOKEN not in log  # ... and the token was not


@pytest.mark.parametrize("where", ["outside", "dotdot", "symlink", "symlinked-file",
                                   "relative"])
def test_a_checkpoint_outside_every_root_is_refused_naming_the_path(
        pair: Pair, encoder: EncoderProcess, tmp_path: Path, where: str) -> None:
    """A copy of the real checkpoint outside the root (readable, valid) is still refused:
    the refusal is the root check, not a failed read."""
    import shutil

    outside = tmp_path / "outside" / "v1"
    shutil.copytree(pair.target, outside)
    link = pair.root / f"link-{where}"
    if where == "symlink":
        link.symlink_to(outside, target_is_directory=True)
    elif where == "symlinked-file":
        link.mkdir()
        for f in outside.iterdir():  # the directory is inside; its files point out
            (link / f.name).symlink_to(f)
    shard = next(f.name for f in outside.iterdir() if f.suffix == ".safetensors")
    dotdot = f"{pair.root}/../{outside.relative_to(pair.root.parent)}"
    path = {"outside": str(outside), "dotdot": dotdot, "symlink": str(link),
            "symlinked-file": str(link / shard), "relative": "v1"}[where]
    before = files(store_dir(encoder))
    body = json.loads(request(pair, attempt="a-escape00001").model_dump_json())
    status, answer = post(encoder.url, "/v1/publish", {**body, "target": path})
    assert status == 400, answer
    assert path in answer["error"] or where == "relative", answer
    assert "outside every checkpoint root" in answer["error"] or (
        where == "relative" and "absolute" in answer["error"]), answer
    assert files(store_dir(encoder)) == before


def test_a_request_cannot_name_the_store(pair: Pair, encoder: EncoderProcess,
                                         tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    body = json.loads(request(pair, attempt="a-redirect0001").model_dump_json())
    for extra in ({"store": elsewhere.as_uri()}, {"store_uri": elsewhere.as_uri()}):
        status, answer = post(encoder.url, "/v1/publish", {**body, **extra})
        assert status == 400, answer
        assert "Extra inputs are not permitted" in answer["error"]
    assert not elsewhere.exists()
    assert not any("a-redirect0001" in k for k in files(store_dir(encoder)))


@pytest.mark.parametrize(("change", "field"), [
    ({"owner": 2, "owners": 2}, "owner 2 is outside"),
    ({"target_version": 0}, "target_version"),
    ({"base_version": 3, "target_version": 2}, "not greater than"),
    ({"mode": "xor"}, "mode"),
    ({"attempt": "../a-1"}, "attempt"),
    ({"owners": 257}, "owners"),
    ({"bucket_mib": 0}, "bucket_mib"),
    ({"owner": "0"}, "owner"),  # strict: no string for a number
    ({"profile": {"tensors": {"w": "maybe"}}}, "profile"),
])
def test_bad_fields_are_400s_that_name_the_field(pair: Pair, encoder: EncoderProcess,
                                                 change: dict[str, Any], field: str) -> None:
    body = {**json.loads(request(pair, attempt="a-badfield0001").model_dump_json()), **change}
    status, answer = post(encoder.url, "/v1/publish", body)
    assert (status, answer["kind"]) == (400, "BadPublish"), answer
    assert field in answer["error"], answer
    status, answer = post(encoder.url, "/v1/publish", b"{not json")
    assert status == 400, answer


def test_an_oversized_body_is_refused_with_413(encoder: EncoderProcess) -> None:
    from dcr.protocol.encoder_api import MAX_BODY_BYTES

    status, _ = post(encoder.url, "/v1/publish", b" " * (MAX_BODY_BYTES + 1))
    assert status == 413


def test_an_unreadable_checkpoint_under_the_root_is_a_400_that_quotes_none_of_it(
        pair: Pair, encoder: EncoderProcess) -> None:
    """A missing target and a file that is not safetensors get the same sentence: it
    neither quotes the file's bytes (a header length is its first eight) nor says
    whether the path exists; the encoder's log has the reason. Fails on 0961110, whose
    answer was ``...: header length 3271150899513092979 does not fit a file of 31 bytes``."""
    secret = pair.root / "creds"
    secret.mkdir(exist_ok=True)
    (secret / "model.safetensors").write_bytes(b"sk-live-0123456789abcdefghijklm")
    said = []
    for n, target in enumerate((pair.root / "v9", secret)):
        with pytest.raises(EncoderError) as e:
            encoder.client().publish(request(pair, attempt=f"a-unreadable{n}",
                                             target=str(target)), timeout_s=60)
        assert e.value.status == 400
        assert e.value.kind == "CheckpointError"
        said.append(str(e.value).replace(str(target), "TARGET"))
    assert said[0] == said[1]
    assert "not a readable safetensors checkpoint" in said[0]
    for text in said:
        assert "sk-live" not in text
        assert str(int.from_bytes(b"sk-live-", "little")) not in text


# --- one at a time, stop, and a caller that leaves (in process) ---------------------------


class GatedStore(FileStore):
    """A file store whose puts wait until ``gate`` opens; ``entered`` is set by the first."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put(self, key: str, data: bytes) -> None:
        self.entered.set()
        assert self.gate.wait(120), "the test never opened the gate"
        super().put(key, data)


@dataclass
class App:
    service: EncoderService
    store: GatedStore
    url: str

    def client(self) -> EncoderClient:
        return EncoderClient(self.url, TOKEN, name="in-process")

    def manifests(self) -> list[Path]:
        return sorted(self.store.root.rglob("manifest*"))

    def payloads(self) -> list[Path]:
        return sorted(self.store.root.rglob("*.dcrp"))


@pytest.fixture
def app(pair: Pair, tmp_path: Path) -> Iterator[App]:
    store = GatedStore(tmp_path / "store")
    service = EncoderService(store, CheckpointPublisher((pair.root.resolve(),), threads=1),
                             stop_wait_s=60)
    server = BackgroundServer(service, TOKEN)
    try:
        yield App(service=service, store=store, url=server.url)
    finally:
        store.gate.set()
        server.close()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_second_publish_of_the_same_owner_and_attempt_is_a_409(app: App, pair: Pair
                                                                  ) -> None:
    client = app.client()
    first, out = in_thread(lambda: client.publish(request(pair), timeout_s=120))
    assert app.store.entered.wait(60)
    with pytest.raises(EncoderError) as e:
        client.publish(request(pair), timeout_s=60)
    assert (e.value.status, e.value.kind) == (409, "PublishConflict")
    # Another owner of the same attempt is not a duplicate.
    other, other_out = in_thread(lambda: client.publish(request(pair, owner=1, owners=2),
                                                        timeout_s=120))
    eventually(lambda: len(app.service._running) == 2, "the other owner running")
    app.store.gate.set()
    first.join(120)
    other.join(120)
    assert "error" not in out, out
    assert "error" not in other_out, other_out
    assert out["value"]["payloads"] >= 5
    # Once it ended, the same owner may publish the attempt again (a retry of the call).
    assert client.publish(request(pair), timeout_s=120)["payloads"] == out["value"]["payloads"]


def test_stop_ends_a_publish_between_buckets_before_its_manifest(app: App, pair: Pair
                                                                 ) -> None:
    client = app.client()
    publish, out = in_thread(lambda: client.publish(request(pair), timeout_s=120))
    assert app.store.entered.wait(60)  # the first payload is being written
    stop, stopped = in_thread(lambda: client.stop(ATTEMPT, timeout_s=120))
    eventually(lambda: ATTEMPT in app.service._stopped, "the stop to arrive")
    app.store.gate.set()  # the payload in flight finishes; nothing after the next item
    stop.join(120)
    publish.join(120)
    assert (stopped["value"].stopped, stopped["value"].running) == (1, 0)
    err = out["error"]
    assert isinstance(err, EncoderError)
    assert (err.status, err.kind) == (409, "Stopped")
    assert app.manifests() == []  # no receiver can take the attempt as complete
    assert len(app.payloads()) < len(NAMES) - 1  # stopped early, not after the last bucket
    # A stopped attempt publishes nothing more, even later.
    with pytest.raises(EncoderError) as e:
        client.publish(request(pair, owner=1, owners=2), timeout_s=60)
    assert (e.value.status, e.value.kind) == (409, "PublishConflict")
    assert "was stopped" in str(e.value)


def test_a_publish_whose_caller_went_away_stops(app: App, pair: Pair) -> None:
    with pytest.raises(EncoderError) as e:  # the socket times out while the put waits
        app.client().publish(request(pair), timeout_s=1.0)
    assert e.value.status is None
    assert app.store.entered.is_set()
    eventually(lambda: any(p.stop.is_set() for p in app.service._running.values())
               or not app.service._running, "the server to notice its caller left")
    app.store.gate.set()
    eventually(lambda: not app.service._running, "the publish to end")
    assert app.manifests() == []
    assert app.service.published == 0


def test_the_store_is_fixed_at_start(pair: Pair, tmp_path: Path) -> None:
    """``dcr encoder`` refuses to start without a store or a root, or with a weak token."""
    for args, said in (
        (["--checkpoint-root", str(pair.root)], "--store"),
        (["--store", str(tmp_path / "s")], "--checkpoint-root"),
    ):
        (tmp_path / "token").write_text(TOKEN)
        done = subprocess.run([sys.executable, "-m", "dcr", "encoder", "--token-file",
                               str(tmp_path / "token"), *args], capture_output=True,
                              text=True, timeout=60, check=False)
        assert (done.returncode, said in done.stderr) == (2, True), done.stderr
    (tmp_path / "weak").write_text("short")
    done = subprocess.run([sys.executable, "-m", "dcr", "encoder", "--token-file",
                           str(tmp_path / "weak"), "--store", str(tmp_path / "s"),
                           "--checkpoint-root", str(pair.root)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert (done.returncode, "at least 16" in done.stderr) == (1, True), done.stderr
    assert "short" not in done.stderr
