"""``S3Store`` against a real S3 server (``rclone serve s3``) on loopback.

Most tests talk to the server through ``FaultProxy``, a small aiohttp reverse proxy in a
background thread that records every request (method, path, Range, headers) and can be
told to answer the next requests itself with an S3 error (503 SlowDown, 500, 403, 404,
412), to hold a response back, or to cut a response body short. Counting requests at
the proxy proves what the store did: one PUT or a multipart upload, ranged GETs in
parallel, exactly three tries after two 503s, no retry of a 403.

Corruption is real: the test flips a byte of the object's file in the server's data
directory. rclone keeps user metadata in memory and forgets it for a file whose
modification time changed, so the flip restores the mtime to keep the digest the store
compares against (and a second test checks what happens when it is forgotten).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import itertools
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import aiohttp
import boto3
import pytest
import torch
from aiohttp import web
from botocore.config import Config
from multidict import CIMultiDict
from transitions import reference_transition
from yarl import URL

from dcr.errors import ConfigError, ObjectNotFound, StoreError
from dcr.transport.s3 import S3Settings, S3Store
from dcr.transport.store import open_store

MiB = 1 << 20

# Small enough for fast tests, large enough for real multipart (5 MiB minimum part).
MULTIPART = S3Settings(multipart_threshold=6 * MiB, part_size=5 * MiB, range_size=1 * MiB,
                       download_concurrency=4, base_backoff=0.01, max_backoff=0.05)
FAST = S3Settings(base_backoff=0.01, max_backoff=0.05, max_attempts=4)

# --- the fault-injecting proxy ---------------------------------------------------------

_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer",
                  "upgrade", "expect", "proxy-authorization", "proxy-connection"})


@dataclass
class Seen:
    method: str
    path: str  # raw path and query
    headers: dict[str, str]
    answer: str  # "forwarded" or the fault applied

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.path).query, keep_blank_values=True)

    @property
    def range(self) -> str | None:
        return self.headers.get("range")


@dataclass
class Fault:
    kind: str  # "status", "delay", "truncate" or "shorten"
    remaining: int
    method: str | None
    status: int = 0
    code: str = ""
    seconds: float = 0.0


@dataclass
class FaultProxy:
    """Forwards to ``upstream`` unchanged (headers, Host and body, so signatures hold)."""

    upstream: str
    seen: list[Seen] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    port: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # control, from the test thread

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def reset(self) -> None:
        with self._lock:
            self.seen.clear()
            self.faults.clear()
            self.max_in_flight = self.in_flight  # a late answer may still be held back

    def fail_next(self, n: int, status: int, code: str, method: str | None = None) -> None:
        with self._lock:
            self.faults.append(Fault("status", n, method, status=status, code=code))

    def delay_next(self, n: int, seconds: float, method: str | None = None) -> None:
        with self._lock:
            self.faults.append(Fault("delay", n, method, seconds=seconds))

    def truncate_next(self, n: int, method: str = "GET") -> None:
        """Declare the whole length, send half the body, drop the connection."""
        with self._lock:
            self.faults.append(Fault("truncate", n, method))

    def shorten_next(self, n: int, method: str = "GET") -> None:
        """Send half the body as if it were all of it (a Content-Length to match)."""
        with self._lock:
            self.faults.append(Fault("shorten", n, method))

    def requests(self, method: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.method == method]

    # the server, on the proxy's loop

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 * MiB)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    def _take(self, method: str) -> Fault | None:
        for f in self.faults:
            if f.remaining > 0 and f.method in (None, method):
                f.remaining -= 1
                return f
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        with self._lock:
            fault = self._take(request.method)
            self.seen.append(Seen(request.method, request.raw_path,
                                  {k.lower(): v for k, v in request.headers.items()},
                                  fault.kind if fault else "forwarded"))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request, body, fault)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _answer(self, request: web.Request, body: bytes,
                      fault: Fault | None) -> web.StreamResponse:
        if fault and fault.kind == "status":
            xml = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{fault.code}</Code>"
                   f"<Message>injected by the test proxy</Message></Error>").encode()
            return web.Response(status=fault.status, content_type="application/xml",
                                body=None if request.method == "HEAD" else xml)
        headers = CIMultiDict((k, v) for k, v in request.headers.items()
                              if k.lower() not in _HOP)
        async with self._session.request(
            request.method, URL(self.upstream + request.raw_path, encoded=True),
            headers=headers, data=io.BytesIO(body) if body else None, allow_redirects=False,
            skip_auto_headers=("Accept-Encoding", "Content-Type", "User-Agent", "Accept"),
        ) as up:
            payload = await up.read()
            out = CIMultiDict((k, v) for k, v in up.headers.items() if k.lower() not in _HOP)
            status = up.status
        if fault and fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
        if fault and fault.kind == "truncate" and payload:
            # Declare the whole length, send half, drop the connection.
            resp = web.StreamResponse(status=status, headers=out)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            assert request.transport is not None
            request.transport.abort()
            return resp
        if fault and fault.kind == "shorten":
            payload = payload[: len(payload) // 2]
        if request.method == "HEAD" or not payload:
            return web.Response(status=status, headers=out)
        out.popall("Content-Length", None)
        return web.Response(status=status, headers=out, body=payload)


@pytest.fixture(scope="module")
def proxy_server(s3_server):
    proxy = FaultProxy(s3_server.endpoint)
    proxy.start()
    yield proxy
    proxy.stop()


@pytest.fixture
def proxy(proxy_server, s3_env, monkeypatch) -> FaultProxy:
    """The proxy, reset, with AWS_ENDPOINT_URL pointing at it."""
    proxy_server.reset()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy_server.endpoint)
    return proxy_server


@pytest.fixture
def sleeps() -> list[float]:
    return []


@pytest.fixture
def make_store(s3_env, sleeps):
    """``make_store(settings)``: an S3Store on this test's prefix, recording its waits."""
    stores: list[S3Store] = []

    def make(settings: S3Settings = FAST, uri: str | None = None) -> S3Store:
        store = S3Store(uri or s3_env.uri, settings, sleep=sleeps.append)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def flip_byte(path: Path, offset: int) -> None:
    """Flip one bit on disk, keeping the mtime so rclone keeps the object's metadata."""
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# --- round trips -----------------------------------------------------------------------


def test_small_object_is_one_put_then_one_get_without_a_head(proxy, make_store, s3_env):
    """The GET's answer carries the size, ETag and digest: a HEAD first would cost a
    round trip per object over a WAN."""
    store = make_store(MULTIPART)
    data = os.urandom(300_000)
    store.put("payloads/a.dcrp", data)
    assert s3_env.object_path("payloads/a.dcrp").read_bytes() == data
    assert store.get("payloads/a.dcrp") == data
    assert [(s.method, s.range) for s in proxy.seen] == [
        ("PUT", None), ("GET", f"bytes=0-{MULTIPART.range_size - 1}")]
    put = proxy.seen[0]
    assert put.headers["x-amz-meta-dcr-blake2b"] == blake(data)
    assert "content-md5" in put.headers
    assert "if-none-match" not in put.headers


def test_digest_metadata_comes_back_with_changed_case_and_is_still_found(
    s3_env, make_store
):
    store = make_store()
    store.put("m", b"metadata")
    s = s3_env.server
    client = boto3.client("s3", endpoint_url=s.endpoint, aws_access_key_id=s.access_key,
                          aws_secret_access_key=s.secret_key, region_name=s.region,
                          config=Config(s3={"addressing_style": "path"}))
    try:
        meta = client.head_object(Bucket=s.bucket, Key=f"{s3_env.prefix}/m")["Metadata"]
    finally:
        client.close()
    assert meta == {"Dcr-Blake2b": blake(b"metadata")}  # rclone's case, not ours
    assert store.get("m") == b"metadata"


def test_empty_object_round_trips(make_store):
    store = make_store()
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_large_object_goes_multipart_in_parallel_parts_and_round_trips(
    proxy, make_store, s3_env
):
    store = make_store(MULTIPART)
    data = os.urandom(12 * MiB + 123)
    store.put("big.dcrp", data)
    assert s3_env.object_path("big.dcrp").read_bytes() == data
    posts = proxy.requests("POST")
    parts = proxy.requests("PUT")
    assert [list(p.query) for p in posts] == [["uploads"], ["uploadId"]]
    assert posts[0].headers["x-amz-meta-dcr-blake2b"] == blake(data)
    assert sorted(int(p.query["partNumber"][0]) for p in parts) == [1, 2, 3]
    assert sorted(int(p.headers["content-length"]) for p in parts) == [
        2 * MiB + 123, 5 * MiB, 5 * MiB]
    assert store.get("big.dcrp") == data


def test_parallel_ranged_gets_reassemble_the_object_exactly(proxy, make_store):
    store = make_store(MULTIPART)
    data = os.urandom(12 * MiB + 123)
    store.put("big.dcrp", data)
    proxy.reset()
    proxy.delay_next(100, 0.05, method="GET")  # hold responses so requests overlap
    assert store.get("big.dcrp") == data
    gets = proxy.requests("GET")
    spans = sorted(tuple(map(int, g.range.removeprefix("bytes=").split("-"))) for g in gets)
    assert len(spans) == 13
    assert spans[0][0] == 0
    assert spans[-1][1] == len(data) - 1
    assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(spans))
    first = [g for g in gets if "if-match" not in g.headers]
    assert [g.range for g in first] == [f"bytes=0-{MULTIPART.range_size - 1}"]  # learns the ETag
    assert 2 <= proxy.max_in_flight <= 4  # download_concurrency


def test_list_exists_and_delete(make_store):
    store = make_store()
    for key in ("v1/manifest.json", "v1/a/o1.dcrp", "v1/a/o2.dcrp", "v2/manifest.json"):
        store.put(key, key.encode())
    other = make_store(uri=store.uri + "-other")  # a sibling prefix must not leak in
    other.put("v1/x", b"x")
    assert store.list("") == ["v1/a/o1.dcrp", "v1/a/o2.dcrp", "v1/manifest.json",
                              "v2/manifest.json"]
    assert store.list("v1/a/") == ["v1/a/o1.dcrp", "v1/a/o2.dcrp"]
    assert store.list("v3") == []
    assert store.exists("v1/manifest.json")
    assert not store.exists("v1/missing")
    store.delete("v1/a/o1.dcrp")
    store.delete("v1/a/o1.dcrp")  # deleting a missing key succeeds, as on S3
    assert not store.exists("v1/a/o1.dcrp")
    assert store.list("v1/") == ["v1/a/o2.dcrp", "v1/manifest.json"]


def test_open_store_gives_an_s3_store_and_rejects_bad_uris(s3_env):
    store = open_store(s3_env.uri + "/")
    assert isinstance(store, S3Store)
    assert store.uri == s3_env.uri
    store.close()
    for bad in ("s3://", "s3://Bad_Bucket/x", "s3://user:pw@bucket/x", "s3://bkt/a//b",
                "s3://bkt/a/../b", "s3://bkt/x?versionId=1"):
        with pytest.raises(ConfigError, match="Store URI"):
            open_store(bad)
    with pytest.raises(ConfigError, match=r"part_size = 1048576"):
        S3Settings(part_size=MiB)
    with pytest.raises(ConfigError, match=r"max_attempts = 0"):
        S3Settings(max_attempts=0)


# --- missing and corrupt objects -------------------------------------------------------


def test_missing_key_raises_object_not_found_naming_the_key_without_retrying(
    proxy, make_store, s3_env
):
    store = make_store()
    with pytest.raises(ObjectNotFound, match=r"'v9/manifest.json'") as e:
        store.get("v9/manifest.json")
    assert s3_env.uri in str(e.value)
    assert "404" in str(e.value)
    assert [s.method for s in proxy.seen] == ["GET"]


@pytest.mark.parametrize(("size", "offset"), [(100_000, 77_777), (3 * MiB + 5, 2 * MiB + 1)],
                         ids=["one-get", "ranged-gets"])
def test_byte_flipped_on_disk_is_a_digest_mismatch_naming_both_digests(
    make_store, s3_env, size, offset
):
    store = make_store(MULTIPART)
    data = os.urandom(size)
    store.put("p.dcrp", data)
    path = s3_env.object_path("p.dcrp")
    flip_byte(path, offset)
    corrupt = path.read_bytes()
    with pytest.raises(StoreError, match="digest mismatch") as e:
        store.get("p.dcrp")
    assert type(e.value) is StoreError
    msg = str(e.value)
    assert "'p.dcrp'" in msg
    assert s3_env.uri in msg
    assert f"expected {blake(data)}, got {blake(corrupt)}" in msg


def test_object_changed_behind_the_server_loses_its_digest_and_is_refused(
    make_store, s3_env
):
    store = make_store()
    data = os.urandom(10_000)
    store.put("p.dcrp", data)
    path = s3_env.object_path("p.dcrp")
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # new mtime: rclone drops metadata
    with pytest.raises(StoreError, match="no dcr-blake2b metadata"):
        store.get("p.dcrp")
    lax = make_store(S3Settings(require_digest=False))
    assert lax.get("p.dcrp") == path.read_bytes()


# --- retries ---------------------------------------------------------------------------


def test_two_503_slowdowns_then_success_takes_three_tries(proxy, make_store, sleeps):
    store = make_store(S3Settings(base_backoff=0.02, max_backoff=1.0))
    proxy.fail_next(2, 503, "SlowDown", method="PUT")
    store.put("k", b"after two throttles")
    assert [s.answer for s in proxy.requests("PUT")] == ["status", "status", "forwarded"]
    assert len(sleeps) == 2
    assert 0 <= sleeps[0] <= 0.02
    assert 0 <= sleeps[1] <= 0.04
    proxy.fail_next(2, 503, "SlowDown", method="GET")
    assert store.get("k") == b"after two throttles"
    assert [s.answer for s in proxy.requests("GET")] == ["status", "status", "forwarded"]


def test_persistent_500_fails_after_max_attempts_with_capped_backoff(
    proxy, make_store, sleeps, s3_env
):
    store = make_store(S3Settings(max_attempts=5, base_backoff=0.05, max_backoff=0.08))
    store.put("k", b"data")
    proxy.reset()
    proxy.fail_next(100, 500, "InternalError", method="GET")
    with pytest.raises(StoreError, match="after 5 tries") as e:
        store.get("k")
    assert "GET of 'k'" in str(e.value)
    assert s3_env.uri in str(e.value)
    assert "HTTP 500 InternalError" in str(e.value)
    assert (len(proxy.requests("HEAD")), len(proxy.requests("GET"))) == (0, 5)
    assert len(sleeps) == 4
    assert all(0 <= s <= 0.08 for s in sleeps)


@pytest.mark.parametrize(("status", "code", "error"), [
    (403, "AccessDenied", StoreError), (404, "NoSuchKey", ObjectNotFound),
    (400, "InvalidArgument", StoreError),
])
def test_client_errors_are_not_retried(proxy, make_store, sleeps, status, code, error):
    store = make_store()
    store.put("k", b"data")
    proxy.reset()
    proxy.fail_next(1, status, code, method="GET")
    with pytest.raises(error, match=f"HTTP {status} {code}") as e:
        store.get("k")
    assert "after 1 try" in str(e.value) or error is ObjectNotFound
    assert len(proxy.requests("GET")) == 1
    assert sleeps == []


def test_wrong_secret_is_refused_by_the_server_once_and_not_retried(
    proxy, make_store, monkeypatch, sleeps
):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    store = make_store()
    with pytest.raises(StoreError, match="HTTP 403 SignatureDoesNotMatch"):
        store.put("k", b"data")
    assert len(proxy.seen) == 1
    assert sleeps == []


def test_refused_connections_are_retried_then_reported(s3_env, make_store, monkeypatch,
                                                       sleeps):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    store = make_store(S3Settings(max_attempts=3, base_backoff=0.01, max_backoff=0.01))
    with pytest.raises(StoreError, match="after 3 tries: EndpointConnectionError"):
        store.put("k", b"data")
    assert len(sleeps) == 2


def test_slow_response_past_the_read_timeout_is_retried(proxy, make_store, sleeps):
    store = make_store(S3Settings(read_timeout=0.5, base_backoff=0.01, max_backoff=0.01))
    data = os.urandom(50_000)
    store.put("k", data)
    proxy.reset()
    proxy.delay_next(1, 1.2, method="GET")
    assert store.get("k") == data
    assert [s.answer for s in proxy.requests("GET")] == ["delay", "forwarded"]
    assert len(sleeps) == 1


def test_slow_response_within_the_read_timeout_is_waited_for(proxy, make_store, sleeps):
    store = make_store(S3Settings(read_timeout=5.0))
    store.put("k", b"slow")
    proxy.reset()
    proxy.delay_next(1, 0.4, method="GET")
    t0 = time.monotonic()
    assert store.get("k") == b"slow"
    assert time.monotonic() - t0 >= 0.4
    assert len(proxy.requests("GET")) == 1
    assert sleeps == []


@pytest.mark.parametrize("size", [200_000, 3 * MiB + 7], ids=["one-get", "ranged-gets"])
@pytest.mark.parametrize("fault", ["truncate", "shorten"])
def test_truncated_body_is_detected_and_retried(proxy, make_store, sleeps, size, fault):
    store = make_store(MULTIPART)
    data = os.urandom(size)
    store.put("k", data)
    proxy.reset()
    getattr(proxy, f"{fault}_next")(1)
    assert store.get("k") == data
    answers = [s.answer for s in proxy.requests("GET")]
    assert answers.count(fault) == 1
    assert len(answers) == (2 if size < MiB else 5)  # the cut piece is fetched again
    assert len(sleeps) == 1


def test_persistently_truncated_body_raises_instead_of_returning_short_bytes(
    proxy, make_store
):
    store = make_store(S3Settings(max_attempts=3, base_backoff=0.01, max_backoff=0.01))
    store.put("k", os.urandom(200_000))
    proxy.reset()
    proxy.truncate_next(2)
    proxy.shorten_next(100)
    with pytest.raises(StoreError, match="after 3 tries: response body: 100000 bytes where 200000"):
        store.get("k")
    assert [s.answer for s in proxy.requests("GET")] == ["truncate", "truncate", "shorten"]


def test_failed_multipart_upload_is_aborted(proxy, make_store, s3_env):
    store = make_store(S3Settings(multipart_threshold=6 * MiB, part_size=5 * MiB,
                                  max_attempts=2, base_backoff=0.01, max_backoff=0.01))
    proxy.fail_next(100, 500, "InternalError", method="PUT")  # every UploadPart
    with pytest.raises(StoreError, match=r"UploadPart \d/3 of 'big' .* after 2 tries"):
        store.put("big", os.urandom(12 * MiB))
    deletes = proxy.requests("DELETE")
    assert len(deletes) == 1
    assert "uploadId" in deletes[0].query
    assert not store.exists("big")
    assert not s3_env.object_path("big").exists()


# --- conditional puts ------------------------------------------------------------------


@pytest.mark.parametrize("size", [1000, 7 * MiB], ids=["put", "multipart"])
def test_put_if_absent_sends_if_none_match_and_stores_a_new_key(proxy, make_store, size):
    store = make_store(MULTIPART)
    data = os.urandom(size)
    assert store.put_if_absent("lock", data) is True
    last = proxy.requests("PUT" if size < MiB else "POST")[-1]
    assert last.headers["if-none-match"] == "*"
    assert store.get("lock") == data


def test_put_if_absent_returns_false_on_412(proxy, make_store):
    # rclone serve s3 does not enforce If-None-Match (it overwrites), so the 412 an
    # enforcing server (AWS S3, MinIO) answers is injected here.
    store = make_store()
    proxy.fail_next(1, 412, "PreconditionFailed", method="PUT")
    assert store.put_if_absent("lock", b"second writer") is False
    assert len(proxy.requests("PUT")) == 1


# --- secrets ---------------------------------------------------------------------------


def test_credentials_never_appear_in_errors_or_logs(proxy, make_store, s3_env, caplog,
                                                    monkeypatch):
    secrets = (s3_env.server.access_key, s3_env.server.secret_key)
    caplog.set_level(logging.DEBUG)
    messages: list[str] = []
    store = make_store(MULTIPART)
    store.put("big", os.urandom(7 * MiB))
    store.get("big")
    proxy.fail_next(1, 503, "SlowDown")
    store.put("k", b"x")
    with pytest.raises(ObjectNotFound) as e:
        store.get("missing")
    messages.append(str(e.value))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-wrong-secret")
    with pytest.raises(StoreError) as e:
        make_store().put("k", b"x")
    messages.append(str(e.value))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NOSUCHACCESSKEY00001")
    with pytest.raises(StoreError, match="InvalidAccessKeyId") as e:
        make_store().put("k", b"x")
    messages.append(str(e.value))
    logged = [r.getMessage() for r in caplog.records]
    assert any("botocore" in r.name for r in caplog.records)  # DEBUG really was on
    assert any("Credential=<redacted>" in m for m in logged)
    assert any("try 1 of 5 failed (HTTP 503 SlowDown" in m for m in logged)
    for text in messages + logged:
        for secret in (*secrets, "wrong-secret-wrong-secret", "NOSUCHACCESSKEY00001"):
            assert secret not in text


# --- the CLI end to end ----------------------------------------------------------------


def test_dcr_diff_and_patch_through_s3_reach_the_target_bits(
    tmp_path, s3_env, write_checkpoint, read_bits
):
    gen = torch.Generator().manual_seed(7)
    base = {
        "model.embed.weight": torch.randn(1024, 512, generator=gen).to(torch.bfloat16),
        "model.layer.weight": torch.randn(512, 512, generator=gen),
        "model.layer.bias": torch.randn(256, generator=gen).to(torch.float16),
    }
    target = {n: t.clone() for n, t in base.items()}
    for t in target.values():
        t.view(-1)[::37] += 1
    b = write_checkpoint(tmp_path / "base", base, "sharded", shards=2)
    t = write_checkpoint(tmp_path / "target", target, "sharded", shards=2)

    def dcr(*args: object) -> dict:
        r = subprocess.run([sys.executable, "-m", "dcr", *map(str, args), "--json"],
                           capture_output=True, text=True, timeout=120, env=s3_env.env,
                           check=False)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    diff = dcr("diff", b, t, "--store", s3_env.uri, "--version", 1, "--bucket-mib", 1)
    assert diff["store"] == s3_env.uri
    stored = sorted(p.relative_to(s3_env.object_path(""))
                    for p in s3_env.object_path("").rglob("*") if p.is_file())
    assert Path("v0000000001/manifest.dcrm") in stored
    assert sum(p.suffix == ".dcrp" for p in stored) == diff["payloads"] >= 2
    ckpt = shutil.copytree(b, tmp_path / "rollout")
    patch = dcr("patch", ckpt, "--store", s3_env.uri, "--version", 1)
    assert patch["files_patched"] == 2
    got, want = read_bits(ckpt), read_bits(t)
    assert sorted(got) == sorted(want)
    for name in want:
        assert (got[name] == want[name]).all(), name


# --- a refit through S3 under faults ---------------------------------------------------

def test_refit_through_s3_survives_5xx_slow_truncated_and_corrupted_objects_bit_exactly(
    tmp_path, proxy, make_store, s3_env
):
    """The transport's fault run, end to end: receivers pull an attempt through the
    proxy while it answers 503s, holds responses and cuts a body short (all retried),
    and one payload of the first attempt is corrupted on the server's disk. That
    attempt fails naming the digest mismatch; the overwrite retry commits; every
    receiver ends with the bits of a dense load, and the owner advanced once."""
    from dcr.owner.encoder import Encoder
    from dcr.protocol.commitstore import SqliteCommitStore
    from dcr.protocol.coordinator import Coordinator
    from dcr.protocol.records import CommitRecord

    t = reference_transition()

    class CorruptFirstAttempt:
        """Flips a byte of the first payload of ``attempt`` on the server's disk."""

        def __init__(self, inner: S3Store) -> None:
            self.inner, self.uri, self.attempt = inner, inner.uri, ""

        def put(self, key: str, data: bytes) -> None:
            self.inner.put(key, data)
            if self.attempt and key.endswith(f"{self.attempt}/o0000-s000000.dcrp"):
                flip_byte(s3_env.object_path(key), len(data) - 1)

        def get(self, key: str) -> bytes:
            return self.inner.get(key)

        def exists(self, key: str) -> bool:
            return self.inner.exists(key)

        def list(self, prefix: str) -> list[str]:
            return self.inner.list(prefix)

    models, receivers = t.receivers(tmp_path, [make_store(FAST) for _ in range(2)])
    owner_store = CorruptFirstAttempt(make_store(FAST))
    owner = Encoder(store=owner_store, baseline=t.bits(t.old), version=0)
    owner.set_candidate(t.bits(t.new), 1)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", CommitRecord(
        committed_version=0, baseline_id="v0", attempt="")), [owner], receivers)
    real_run = coord._run

    def first_attempt_under_faults(attempt, *rest):  # type: ignore[no-untyped-def]
        if attempt.mode == "mixed":
            owner_store.attempt = attempt.id
            proxy.fail_next(2, 503, "SlowDown", method="GET")
            proxy.truncate_next(1)
            proxy.delay_next(40, 0.05, method="GET")  # lists see a key 50 ms late
        else:
            owner_store.attempt = ""
        return real_run(attempt, *rest)

    coord._run = first_attempt_under_faults  # type: ignore[method-assign]
    record = coord.refit(1, "v1")
    coord.close()
    outcomes = [(h.mode, h.outcome.split(":")[0]) for h in coord.history]
    assert outcomes == [("mixed", "failed"), ("overwrite", "committed")]
    assert "digest" in coord.history[0].outcome.lower()
    assert record.attempt == coord.history[1].attempt
    assert owner.version == 1
    answers = {s.answer for s in proxy.seen}
    assert {"status", "truncate", "delay"} <= answers
    assert all(t.exact(model, 2, r) for r, model in enumerate(models))
