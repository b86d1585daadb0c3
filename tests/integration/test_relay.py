"""The relay tree as real processes on loopback: ``python -m dcr relay`` per member.

Payloads are real (built with ``dcr.codec.encode``), a few MiB of incompressible XOR
masks each. Every check reads the nodes' own answers (``GET`` of the bytes, listings,
``/healthz`` and ``/v1/status``), never their internals. Clients push with the publish
token (:data:`TOKEN`); receivers read with the read token (:data:`READ_TOKEN`), the only
one an agent holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import yarl

from dcr import __version__
from dcr.codec.decode import Target, apply_items, decode
from dcr.codec.encode import PayloadBuilder, diff_range, encode_item
from dcr.format.dtypes import dtype
from dcr.format.manifest import Manifest, PayloadEntry, Stats
from dcr.http.edge import UNAUTHORIZED
from dcr.transport.receive import receive
from dcr.transport.relay import (
    RelayClient,
    RelayError,
    RelayNotFound,
    RelaySource,
    ancestors_of,
    children_of,
    depth_of,
    parent_of,
    tree_depth,
)

TOKEN = "relay-test-token-7f2c"  # the publish token: owners, and members among themselves
READ_TOKEN = "relay-read-token-91d4"  # the read token: agents
ELEMENTS = 1_500_000  # BF16 elements per payload, all changed: about 3 MiB of masks


# --- payloads -----------------------------------------------------------------------


def make_payload(attempt: str, owner: int, seq: int, *, elements: int = ELEMENTS,
                 salt: int = 0) -> bytes:
    """A sealed payload whose every element changed (random masks: no compression)."""
    rng = np.random.default_rng([owner, seq, salt, len(attempt)])
    base = rng.integers(0, 1 << 16, elements, dtype=np.uint16)
    target = base ^ rng.integers(1, 1 << 16, elements, dtype=np.uint16)
    d = diff_range(name=f"model.layers.{owner}.w{seq}", dtype=dtype("BF16"), shape=(elements,),
                   start=0, base=base, target=target, entry="xor")
    assert d is not None
    pb = PayloadBuilder(base_version=1, target_version=2, attempt=attempt, owner=owner,
                        seq=seq, mode="mixed")
    pb.add(encode_item(d), dense_bytes=base.nbytes)
    return pb.seal()


def make_manifest(attempt: str, payloads: dict[tuple[int, int], bytes]) -> bytes:
    entries = tuple(
        PayloadEntry(key=f"v0000000002/{attempt}/o{o:04d}-s{s:06d}.dcrp", owner=o, seq=s,
                     size=len(data), digest=_digest(data), items=1, records=ELEMENTS)
        for (o, s), data in sorted(payloads.items())
    )
    total = sum(len(d) for d in payloads.values())
    stats = Stats(tensors=len(entries), changed_elements=ELEMENTS * len(entries),
                  total_elements=ELEMENTS * len(entries),
                  dense_bytes=2 * ELEMENTS * len(entries), payload_bytes=total)
    return Manifest(base_version=1, target_version=2, attempt=attempt, mode="mixed",
                    payloads=entries, tensors=(), stats=stats).pack()


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


async def slow_body(data: bytes, *, piece: int = 64 << 10,
                    pause_at: int | None = None,
                    pause: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[bytes]:
    """``data`` in pieces; at byte ``pause_at`` it waits for ``pause()`` before going on."""
    for off in range(0, len(data), piece):
        if pause is not None and pause_at is not None and off >= pause_at:
            await pause()
            pause = None
        yield data[off : off + piece]
        await asyncio.sleep(0)


# --- processes ----------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Tree:
    """Relay processes on loopback; ``urls[i]`` is member ``i``."""

    root_dir: Path
    ports: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    argvs: list[list[str]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def log(self, i: int, tail: int = 3000) -> str:
        return (self.root_dir / f"member-{i}.log").read_text(errors="replace")[-tail:]

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(5)

    def start(self, i: int) -> None:
        """(Re)start member ``i`` on its port, as at first."""
        with open(self.root_dir / f"member-{i}.log", "ab") as log:
            proc = subprocess.Popen(self.argvs[i], stdout=log, stderr=subprocess.STDOUT)
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start_tree(root_dir: Path, n: int, fanout: int, *extra: str) -> Tree:
    root_dir.mkdir(parents=True, exist_ok=True)
    token_file, publish_file = root_dir / "read-token", root_dir / "publish-token"
    token_file.write_text(READ_TOKEN + "\n")
    publish_file.write_text(TOKEN + "\n")
    tree = Tree(root_dir, free_ports(n))
    members = ",".join(f"127.0.0.1:{p}" for p in tree.ports)
    for i, port in enumerate(tree.ports):
        tree.argvs.append(
            [sys.executable, "-m", "dcr", "relay", "--listen", f"127.0.0.1:{port}",
             "--members", members, "--index", str(i), "--fanout", str(fanout),
             "--token-file", str(token_file), "--publish-token-file", str(publish_file),
             *extra])
        tree.start(i)
    try:
        asyncio.run(_wait_ready(tree))
    except BaseException:
        tree.stop()
        raise
    return tree


async def _wait_ready(tree: Tree) -> None:
    async def ready(c: RelayClient) -> bool:
        try:
            return bool((await c.health(timeout_s=1))["joined"])
        except RelayError:
            return False

    async with Clients(tree) as cs:
        for i, c in enumerate(cs):
            await until(lambda c=c: ready(c), 20, f"member {i} up", tree)


class Clients(list[RelayClient]):
    """One client per member, closed together."""

    def __init__(self, tree: Tree, token: str = TOKEN) -> None:
        super().__init__(RelayClient(u, token) for u in tree.urls)

    async def __aenter__(self) -> Clients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self:
            await c.close()


async def until(pred: Callable[[], Awaitable[bool]], timeout: float, what: str,
                tree: Tree | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            logs = "" if tree is None else "\n".join(
                f"--- member {i}\n{tree.log(i)}" for i in range(len(tree.ports)))
            pytest.fail(f"timed out after {timeout} s waiting for {what}\n{logs}")
        await asyncio.sleep(0.05)


async def holds(c: RelayClient, attempt: str, count: int, manifest: bool = False) -> bool:
    """Whether member ``c`` lists ``count`` payloads of ``attempt`` (and its manifest)."""
    if len(await c.list_payloads(attempt)) < count:
        return False
    if manifest:
        try:
            await c.get_manifest(attempt)
        except RelayNotFound:
            return False
    return True


class Counts(dict[str, int]):
    def __missing__(self, key: str) -> int:
        return 0


async def counters(c: RelayClient) -> Counts:
    return Counts((await c.status())["counters"])


@pytest.fixture(scope="module")
def tree7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    """Seven members, fan-out 2: root 0; 1 and 2; leaves 3, 4, 5, 6."""
    tree = start_tree(tmp_path_factory.mktemp("relay7"), 7, 2)
    yield tree
    tree.stop()


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[Callable[..., Tree]]:
    """``trees(n, fanout, *extra_args)`` starts a tree stopped at teardown."""
    started: list[Tree] = []

    def start(n: int, fanout: int, *extra: str) -> Tree:
        started.append(start_tree(tmp_path / f"tree{len(started)}", n, fanout, *extra))
        return started[-1]

    yield start
    for t in started:
        t.stop()


# --- tree math ----------------------------------------------------------------------


@pytest.mark.parametrize("fanout", [2, 3])
@pytest.mark.parametrize("size", [1, 2, 7, 13, 14, 40])
def test_tree_math_reaches_every_member_once_with_log_depth(fanout: int, size: int) -> None:
    seen = [0]
    frontier = [0]
    while frontier:
        nxt = [c for p in frontier for c in children_of(p, fanout, size)]
        for c in nxt:
            assert parent_of(c, fanout) in frontier
        seen += nxt
        frontier = nxt
    assert sorted(seen) == list(range(size))  # reachable, and each exactly once
    for i in range(size):
        assert len(children_of(i, fanout, size)) <= fanout
        assert depth_of(i, fanout) == len(ancestors_of(i, fanout))
        assert (ancestors_of(i, fanout) or [0])[-1] == 0
    want = math.ceil(math.log(size * (fanout - 1) + 1, fanout)) - 1
    assert tree_depth(size, fanout) == want


def test_tree_math_examples() -> None:
    assert parent_of(0, 2) is None
    assert list(children_of(0, 2, 7)) == [1, 2]
    assert list(children_of(2, 2, 7)) == [5, 6]
    assert list(children_of(3, 2, 7)) == []
    assert ancestors_of(6, 2) == [2, 0]
    assert tree_depth(7, 2) == 2
    assert tree_depth(8, 2) == 3
    assert list(children_of(1, 3, 13)) == [4, 5, 6]
    assert list(children_of(3, 3, 11)) == [10]
    assert parent_of(12, 3) == 3
    assert tree_depth(13, 3) == 2
    assert tree_depth(14, 3) == 3


# --- the tree -----------------------------------------------------------------------


def test_fan_out_over_three_levels_delivers_every_payload_and_manifest_intact(
    tree7: Tree,
) -> None:
    attempt = "a-fanout"
    payloads = {(o, s): make_payload(attempt, o, s) for o in range(2) for s in range(3)}
    manifest = make_manifest(attempt, payloads)

    async def scenario() -> None:
        async with Clients(tree7) as cs:
            got = await asyncio.gather(*(cs[0].put_payload(attempt, o, s, data)
                                         for (o, s), data in payloads.items()))
            assert got == ["queued"] * len(payloads)
            assert await cs[0].put_manifest(attempt, manifest) == "queued"
            for i, c in enumerate(cs):
                await until(lambda c=c: holds(c, attempt, len(payloads), manifest=True),
                            20, f"member {i} to hold the attempt", tree7)
            for i, c in enumerate(cs):
                listing = await c.list_payloads(attempt)
                assert {(p.owner, p.seq): (p.size, p.digest) for p in listing} == {
                    k: (len(d), _digest(d)) for k, d in payloads.items()
                }, f"member {i}"
                for (o, s), data in payloads.items():
                    assert await c.get_payload(attempt, o, s) == data, f"member {i} {o}/{s}"
                assert await c.get_manifest(attempt) == manifest, f"member {i}"
                h = await c.health()
                assert h["status"] == "ok"
                # Its parent, or an ancestor it re-attached to when a probe of a parent
                # slowed by a loaded machine timed out: both deliver everything (above).
                if i == 0:
                    assert h["parent"] is None
                else:
                    assert h["parent"] in ancestors_of(i, 2), f"member {i}"

    asyncio.run(scenario())


def test_payload_reaches_a_leaf_before_the_owner_finishes_sending_it(tree7: Tree) -> None:
    attempt, leaf = "a-stream", 6  # root -> 2 -> 6
    data = make_payload(attempt, 0, 0)
    seen_at_leaf: list[int] = []

    async def scenario() -> None:
        async with Clients(tree7) as cs:
            async def leaf_has_bytes() -> bool:
                arriving = (await cs[leaf].status())["arriving"]
                got = [a["received"] for a in arriving if a["attempt"] == attempt]
                seen_at_leaf.extend(g for g in got if g > 0)
                return bool(seen_at_leaf)

            async def pause() -> None:  # the owner holds back the second half until then
                await until(leaf_has_bytes, 10, "the leaf to receive the first bytes", tree7)

            body = slow_body(data, pause_at=len(data) // 2, pause=pause)
            assert await cs[0].put_payload(attempt, 0, 0, body, size=len(data)) == "queued"
            await until(lambda: holds(cs[leaf], attempt, 1), 10, "the leaf to stage it")
            assert await cs[leaf].get_payload(attempt, 0, 0) == data

    asyncio.run(scenario())
    # The leaf, two hops down, held bytes while the owner had sent only half: cut-through.
    assert 0 < seen_at_leaf[0] <= len(data) // 2 + (64 << 10)


def test_a_waiting_listing_answers_when_a_payload_arrives_at_a_leaf(tree7: Tree) -> None:
    """A receiver's long poll (``wait_s``) at a leaf answers with the payload the root got
    after the poll began, and a tag that differs; without a change it answers with the
    same tag."""
    attempt = "a-longpoll"

    async def scenario() -> None:
        async with Clients(tree7) as cs, Clients(tree7, READ_TOKEN) as readers:
            leaf = readers[6]
            first = await leaf.listing(attempt)
            assert first["payloads"] == []
            quiet = await leaf.listing(attempt, wait_s=0.2, known=first["tag"])
            assert quiet["tag"] == first["tag"]
            before = (await counters(cs[6]))["list_waits"]
            poll = asyncio.create_task(leaf.listing(attempt, wait_s=5, known=first["tag"]))

            async def waiting() -> bool:
                return (await counters(cs[6]))["list_waits"] > before
            await until(waiting, 10, "the leaf to hold the listing open", tree7)
            assert not poll.done()
            await cs[0].put_payload(attempt, 0, 0, make_payload(attempt, 0, 0))
            answer = await poll
            assert [(p["owner"], p["seq"]) for p in answer["payloads"]] == [(0, 0)]
            assert answer["tag"] != first["tag"]

    asyncio.run(scenario())


@pytest.mark.parametrize(("query", "named"), [
    ("wait_s=soon", "'soon'"), ("wait_s=99", "'99'"), ("wait_s=-1", "'-1'"),
    ("wait_s=1&known=not-hex", "'not-hex'"),
])
def test_a_malformed_long_poll_is_a_400_naming_the_value(tree7: Tree, query: str,
                                                          named: str) -> None:
    async def scenario() -> None:
        async with Clients(tree7, READ_TOKEN) as readers:
            with pytest.raises(RelayError, match=named) as e:
                await readers[0]._json("GET", f"/v1/attempts/a-bad/payloads?{query}")
            assert e.value.status == 400

    asyncio.run(scenario())


def test_corrupted_payload_is_refused_at_the_root_and_kept_nowhere(tree7: Tree) -> None:
    attempt = "a-corrupt"
    data = bytearray(make_payload(attempt, 0, 0))
    data[len(data) // 2] ^= 0x01

    async def scenario() -> None:
        async with Clients(tree7) as cs:
            with pytest.raises(RelayError, match="digest mismatch") as e:
                await cs[0].put_payload(attempt, 0, 0, bytes(data))
            assert e.value.status == 400
            for i, c in enumerate(cs):
                async def settled(c: RelayClient = c) -> bool:
                    return not (await c.status())["arriving"]
                await until(settled, 5, f"member {i} to drop the partial copy", tree7)
                assert await c.list_payloads(attempt) == [], f"member {i}"

    asyncio.run(scenario())


def test_payload_whose_header_names_another_id_is_refused(tree7: Tree) -> None:
    attempt = "a-mismatch"
    data = make_payload(attempt, 0, 5, elements=10_000)

    async def scenario() -> None:
        async with Clients(tree7) as cs:
            with pytest.raises(RelayError, match="header says") as e:
                await cs[0].put_payload(attempt, 0, 6, data)
            assert e.value.status == 400
            with pytest.raises(RelayError) as e:
                await cs[0].put_payload("a-other", 0, 5, data)
            assert e.value.status == 400
            await asyncio.sleep(0.3)
            for c in cs:
                assert await c.list_payloads(attempt) == []
                assert (await c.status())["arriving"] == []

    asyncio.run(scenario())


def test_duplicate_is_acknowledged_but_not_forwarded_again(tree7: Tree) -> None:
    attempt = "a-dup"
    data = make_payload(attempt, 1, 1)

    async def scenario() -> None:
        async with Clients(tree7) as cs:
            assert await cs[0].put_payload(attempt, 1, 1, data) == "queued"
            for i, c in enumerate(cs):
                await until(lambda c=c: holds(c, attempt, 1), 10, f"member {i}", tree7)
            before = [await counters(c) for c in cs]
            assert await cs[0].put_payload(attempt, 1, 1, data) == "duplicate"
            await asyncio.sleep(0.5)
            after = [await counters(c) for c in cs]
            assert after[0]["duplicates"] == before[0]["duplicates"] + 1
            assert after[0]["forwards"] == before[0]["forwards"]
            assert after[0]["staged"] == before[0]["staged"]
            for i in range(1, 7):  # nothing reached the rest of the tree
                assert after[i] == before[i], f"member {i}"

    asyncio.run(scenario())


def test_same_id_with_other_bytes_is_a_conflict(tree7: Tree) -> None:
    """The first upload stays, and the refusal is logged (the log line fails on 5b0b0ae:
    the 409 was counted but left no trace of the attempt to replace a payload)."""
    attempt = "a-conflict"
    first = make_payload(attempt, 2, 0, elements=50_000)
    other = make_payload(attempt, 2, 0, elements=50_000, salt=1)
    assert first != other

    async def scenario() -> None:
        async with Clients(tree7) as cs:
            assert await cs[0].put_payload(attempt, 2, 0, first) == "queued"
            with pytest.raises(RelayError, match="other bytes") as e:
                await cs[0].put_payload(attempt, 2, 0, other)
            assert e.value.status == 409
            for i, c in enumerate(cs):
                await until(lambda c=c: holds(c, attempt, 1), 10, f"member {i}", tree7)
                assert await c.get_payload(attempt, 2, 0) == first

    asyncio.run(scenario())
    log = tree7.log(0, tail=1 << 30)
    assert f"refused payload {attempt}/o2/s0: already held with other bytes" in log, log[-2000:]


def test_every_endpoint_but_healthz_needs_the_token(tree7: Tree) -> None:
    data = make_payload("a-auth", 0, 0, elements=1000)
    url = tree7.urls[1]
    calls = [
        ("GET", "/v1/attempts/a-auth/payloads", None),
        ("GET", "/v1/payloads/a-auth/0/0", None),
        ("PUT", "/v1/payloads/a-auth/0/0", data),
        ("PUT", "/v1/manifests/a-auth/0", b"{}"),
        ("GET", "/v1/manifests/a-auth/0", None),
        ("DELETE", "/v1/attempts/a-auth", None),
        ("POST", "/v1/subscribe", b'{"index": 3}'),
        ("GET", "/v1/status", None),
    ]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                for method, path, body in calls:
                    async with http.request(method, url + path, data=body, headers=auth) as r:
                        assert r.status == 401, (method, path, auth)
                        assert r.headers["WWW-Authenticate"] == "Bearer"
                        assert TOKEN not in await r.text()
            async with http.get(url + "/healthz") as r:
                assert r.status == 200
        async with RelayClient(url, "not-the-token") as c:
            with pytest.raises(RelayError) as e:
                await c.put_payload("a-auth", 0, 0, data)
            assert e.value.status == 401
        async with RelayClient(url, TOKEN) as c:
            assert await c.list_payloads("a-auth") == []
        assert TOKEN not in tree7.log(1, tail=1 << 30)
        assert READ_TOKEN not in tree7.log(1, tail=1 << 30)

    asyncio.run(scenario())


# --- credentials and hostile requests -------------------------------------------------


def test_the_read_token_reads_but_cannot_push_replace_drop_or_subscribe(tree7: Tree) -> None:
    """Fails on 5b0b0ae: one token did everything, so the token every agent holds could
    claim payload ids, drop attempts and reshape the tree (``dcr relay`` had no
    ``--publish-token-file``)."""
    attempt = "a-readonly"
    data = make_payload(attempt, 0, 0, elements=1000)
    claim = make_payload(attempt, 0, 0, elements=1000, salt=1)

    async def scenario() -> None:
        async with Clients(tree7) as owners, Clients(tree7, READ_TOKEN) as readers:
            for i in (0, 3):  # a reader cannot claim the id first, at the root or below
                with pytest.raises(RelayError, match="publish token") as e:
                    await readers[i].put_payload(attempt, 0, 0, claim)
                assert e.value.status == 403
            assert await owners[0].put_payload(attempt, 0, 0, data) == "queued"
            for i, c in enumerate(readers):
                await until(lambda c=c: holds(c, attempt, 1), 10, f"member {i}", tree7)
            manifest = make_manifest(attempt, {(0, 0): data})
            for call in (readers[1].put_manifest(attempt, manifest),
                         readers[1].delete_attempt(attempt),
                         readers[0].subscribe(5, {}, {})):
                with pytest.raises(RelayError) as e:
                    await call
                assert e.value.status == 403
            for i, c in enumerate(readers):  # nothing a reader asked for happened
                assert await c.get_payload(attempt, 0, 0) == data, f"member {i}"
                with pytest.raises(RelayNotFound):
                    await c.get_manifest(attempt)
                assert (await c.status())["index"] == i
            assert 5 not in (await readers[0].health())["children"]
            assert (await counters(readers[1]))["forbidden"] >= 2

    asyncio.run(scenario())
    assert READ_TOKEN not in tree7.log(0, tail=1 << 30)


def test_ids_with_control_characters_are_refused_before_anything_logs_them(
        tree7: Tree) -> None:
    """Fails on 5b0b0ae: listings and DELETE took the attempt id from the URL unchecked, so
    a ``%0A`` in it wrote a forged line into the node's log."""
    forged = "a%0AFORGED-LINE%20member%200%20compromised"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    calls = [("DELETE", f"/v1/attempts/{forged}", None),
             ("GET", f"/v1/attempts/{forged}/payloads", None),
             ("GET", f"/v1/manifests/{forged}/0", None),
             ("PUT", f"/v1/manifests/{forged}/0", b"{}"),
             ("POST", "/v1/subscribe",
              b'{"wire": 2, "index": 3, "held": {"a\\nFORGED-LINE": [[0, 0]]}}'),
             ("POST", "/v1/subscribe",
              b'{"wire": 2, "index": 3, "manifests": {"a\\nFORGED-LINE": [0]}}')]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            for method, path, body in calls:
                url = yarl.URL(tree7.urls[0] + path, encoded=True)
                async with session.request(method, url, data=body, headers=auth) as r:
                    assert r.status == 400, (method, path, r.status, await r.text())

    asyncio.run(scenario())
    assert "FORGED-LINE" not in tree7.log(0, tail=1 << 30)


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", "Bearer t\u00f6k\u00e9n".encode(),
                                   b"\xc3\x28", "Bearer \u2603".encode()],
                         ids=["latin1", "utf8", "bad-utf8", "snowman"])
def test_a_non_ascii_authorization_header_is_a_401_not_a_500(tree7: Tree, value: bytes) -> None:
    """Fails on 5b0b0ae: the node encoded the header to compare it; bytes that are not
    UTF-8 (which aiohttp keeps as surrogates) raised, and it answered 500 with a traceback."""
    conn = http.client.HTTPConnection("127.0.0.1", tree7.ports[2], timeout=10)
    try:
        conn.putrequest("GET", "/v1/status")
        conn.putheader("Authorization", value)
        conn.endheaders()
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    assert r.status == 401, (r.status, body)
    assert json.loads(body) == UNAUTHORIZED  # every DCR server's one 401
    assert r.getheader("WWW-Authenticate") == "Bearer"
    assert "Traceback" not in tree7.log(2, tail=1 << 30)


def test_a_sender_trickling_bytes_is_cut_at_its_deadline_and_frees_its_budget(
        trees: Callable[..., Tree]) -> None:
    """Fails on 5b0b0ae: the stall timeout restarted with every byte, so a sender giving
    a few bytes at a time held its reserved budget as long as it liked (and ``dcr relay``
    had no ``--min-upload-bytes-per-s``)."""
    tree = trees(1, 2, "--stall-timeout-s", "2", "--min-upload-bytes-per-s", "2048")
    data = make_payload("a-slow", 0, 0, elements=2000)
    sent = [0]

    async def trickle() -> AsyncIterator[bytes]:  # 320 bytes/s, never a 2 s stall
        for off in range(0, len(data), 32):
            yield data[off : off + 32]
            sent[0] = off + 32
            await asyncio.sleep(0.1)

    async def scenario() -> None:
        async with Clients(tree) as (c,):
            with pytest.raises(RelayError) as e:
                await c.put_payload("a-slow", 0, 0, trickle(), size=len(data))
            assert e.value.status in (408, None), e.value  # 408, or reset while sending
            assert sent[0] < len(data)  # cut while the sender still had bytes to give
            await until(lambda: _settled(c), 5, "the node to drop the upload", tree)
            assert await c.list_payloads("a-slow") == []
            assert (await counters(c))["too_slow"] == 1

    asyncio.run(scenario())
    assert "slower than the minimum of 2048 bytes/s" in tree.log(0), tree.log(0)


async def _settled(c: RelayClient) -> bool:
    h = await c.health()
    return h["incoming"] == 0 and h["staged_bytes"] == 0


# --- failures -----------------------------------------------------------------------


def test_children_of_a_killed_interior_node_reattach_and_get_every_payload_once(
    trees: Callable[..., Tree],
) -> None:
    tree = trees(7, 2, "--parent-timeout-s", "1", "--health-interval-s", "0.2")
    attempt, victim, orphans = "a-fail", 1, (3, 4)
    payloads = {(0, s): make_payload(attempt, 0, s, elements=700_000) for s in range(5)}
    manifest = make_manifest(attempt, payloads)
    alive = [i for i in range(7) if i != victim]

    async def scenario() -> None:
        async with Clients(tree) as cs:
            for s in (0, 1):  # before the failure
                assert await cs[0].put_payload(attempt, 0, s, payloads[0, s]) == "queued"
            for i, c in enumerate(cs):
                await until(lambda c=c: holds(c, attempt, 2), 10, f"member {i}", tree)

            async def orphan_receiving() -> bool:
                arriving = (await cs[3].status())["arriving"]
                return any(a["seq"] == 2 and a["received"] > 0 for a in arriving)

            async def kill_mid_payload() -> None:
                await until(orphan_receiving, 10, "member 3 to receive payload 2", tree)
                tree.kill(victim)

            body = slow_body(payloads[0, 2], pause_at=len(payloads[0, 2]) // 2,
                             pause=kill_mid_payload)
            assert await cs[0].put_payload(attempt, 0, 2, body,
                                           size=len(payloads[0, 2])) == "queued"
            for s in (3, 4):  # after the failure
                assert await cs[0].put_payload(attempt, 0, s, payloads[0, s]) == "queued"
            assert await cs[0].put_manifest(attempt, manifest) == "queued"

            for i in orphans:
                async def adopted(c: RelayClient = cs[i]) -> bool:
                    return (await c.health())["parent"] == 0
                await until(adopted, 10, f"member {i} to re-attach to the root", tree)
            for i in alive:
                await until(lambda c=cs[i]: holds(c, attempt, 5, manifest=True), 15,
                            f"member {i} to hold every payload", tree)
            for i in alive:
                listing = await cs[i].list_payloads(attempt)
                assert sorted((p.owner, p.seq) for p in listing) == sorted(payloads)
                for (o, s), data in payloads.items():
                    assert await cs[i].get_payload(attempt, o, s) == data
                assert await cs[i].get_manifest(attempt) == manifest
            for i in orphans:  # each payload and the manifest staged exactly once
                c = await counters(cs[i])
                assert c["staged"] == len(payloads) + 1, (i, c)
                assert (await cs[i].health())["status"] == "ok"
            assert set(orphans) <= set((await cs[0].health())["children"])

            tree.kill(0)  # now no ancestor of 2, 3 or 4 is left
            for i in (2, 3, 4):
                async def detached(c: RelayClient = cs[i]) -> bool:
                    return (await c.health())["status"] == "detached"
                await until(detached, 10, f"member {i} to report detached", tree)

    asyncio.run(scenario())


def test_an_agents_read_is_tried_again_until_its_node_answers(
    trees: Callable[..., Tree],
) -> None:
    """An agent reading from a node that died (behind a Service, a retry reaches another
    node; here the same one comes back) tries the read again for a few seconds instead
    of failing the attempt at once; an answer with an error status (a wrong token) comes
    through as that error. Fails without RelaySource's retry: the first listing raised
    "connection refused"."""
    tree = trees(2, 2)
    tree.kill(1)
    source = RelaySource(tree.urls[1], READ_TOKEN, "a-back")
    try:
        threading.Timer(1.0, tree.start, (1,)).start()
        assert source.available() == []  # refused until the node is back, then answered
        wrong = RelaySource(tree.urls[1], "not-the-read-token-0000", "a-back")
        with pytest.raises(RelayError) as refused:
            wrong.available()
        assert refused.value.status == 401
        wrong.close()
    finally:
        source.close()


def test_a_member_that_lost_a_payload_gets_it_back_on_its_next_resync(
    trees: Callable[..., Tree],
) -> None:
    tree = trees(2, 2, "--resync-interval-s", "0.5")
    data = make_payload("a-resync", 3, 1, elements=200_000)

    async def scenario() -> None:
        async with Clients(tree) as cs:
            assert await cs[0].put_payload("a-resync", 3, 1, data) == "queued"
            await until(lambda: holds(cs[1], "a-resync", 1), 10, "member 1", tree)
            assert await cs[1].delete_attempt("a-resync") == 1  # a leaf: only its own copy
            assert await cs[1].list_payloads("a-resync") == []
            await until(lambda: holds(cs[1], "a-resync", 1), 5, "the resync", tree)
            assert await cs[1].get_payload("a-resync", 3, 1) == data

    asyncio.run(scenario())


# --- staging budget -----------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_tiny_budget_without_spool_bounds_staging_and_makes_uploads_wait(
    trees: Callable[..., Tree],
) -> None:
    budget = 4 << 20
    tree = trees(1, 2, "--budget-mib", "4", "--admit-timeout-s", "1.5")
    old = {s: make_payload("bp-old", 0, s, elements=700_000) for s in range(2)}
    late = make_payload("bp-new", 0, 0, elements=700_000)
    big = make_payload("bp-flood", 0, 0, elements=2_000_000)  # ~4 MiB: fits no budget left
    flood = 12  # uploads of ``big`` under ids (0, 0..11): a node must refuse them unread,
    # so it never sees that the header names seq 0 (if it read them: 400, not 503)
    huge = make_payload("bp-huge", 0, 0, elements=2_500_000)
    old_bytes = sum(len(d) for d in old.values())
    assert old_bytes <= budget < old_bytes + len(late)
    samples: list[dict[str, Any]] = []
    pid = tree.procs[0].pid

    async def scenario() -> None:
        async with Clients(tree) as (c,):
            for s, data in old.items():
                assert await c.put_payload("bp-old", 0, s, data) == "queued"
            with pytest.raises(RelayError) as e:
                await c.put_payload("bp-huge", 0, 0, huge)
            assert e.value.status == 413

            rss_before = _rss_bytes(pid)
            t0 = time.monotonic()
            uploads = asyncio.gather(*(c.put_payload("bp-flood", 0, s, big)
                                       for s in range(flood)), return_exceptions=True)
            while not uploads.done():
                samples.append({**await c.health(), "rss": _rss_bytes(pid) - rss_before})
                await asyncio.sleep(0.05)
            results = await uploads
            assert all(isinstance(r, RelayError) and r.status == 503 for r in results), results
            assert time.monotonic() - t0 >= 1.4

            # A waiting upload goes ahead as soon as an obsolete attempt frees space.
            waiting = asyncio.ensure_future(c.put_payload("bp-new", 0, 0, late))
            await until(lambda: _waiting(c), 1, "the upload to wait")
            assert await c.delete_attempt("bp-old") == 2
            assert await waiting == "queued"
            assert await c.get_payload("bp-new", 0, 0) == late
            assert await c.list_payloads("bp-old") == []

    asyncio.run(scenario())
    assert max(s["waiting"] for s in samples) == flood
    assert all(s["staged_bytes"] == old_bytes for s in samples)
    assert all(s["memory_bytes"] <= budget and s["spool_bytes"] == 0 for s in samples)
    # While they wait, the node holds socket buffers (about 0.5 MiB each), not the bodies.
    growth = max(s["rss"] for s in samples if s["waiting"] == flood)
    assert growth < flood * len(big) // 4, growth


async def _waiting(c: RelayClient) -> bool:
    return bool((await c.health())["waiting"])


def test_beyond_the_memory_budget_payloads_spill_to_the_spool_and_read_back(
    trees: Callable[..., Tree], tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    tree = trees(2, 2, "--budget-mib", "3", "--spool", str(spool))
    payloads = {s: make_payload("sp", 0, s, elements=700_000) for s in range(4)}

    async def scenario() -> None:
        async with Clients(tree) as cs:
            for s, data in payloads.items():
                assert await cs[0].put_payload("sp", 0, s, data) == "queued"
            h = await cs[0].health()
            assert h["memory_bytes"] <= 3 << 20
            assert h["spool_bytes"] > 0
            assert h["memory_bytes"] + h["spool_bytes"] == sum(map(len, payloads.values()))
            root_spool = [f for f in spool.glob("relay-0-*/*") if f.is_file()]  # member 0's own
            assert sum(f.stat().st_size for f in root_spool) == h["spool_bytes"]
            await until(lambda: holds(cs[1], "sp", 4), 10, "member 1 to hold them", tree)
            for c in cs:
                for s, data in payloads.items():
                    assert await c.get_payload("sp", 0, s) == data
            # A subscriber that lacks them is replayed from memory and spool alike.
            assert await cs[1].delete_attempt("sp") == 4
            assert await cs[1].list_payloads("sp") == []
            assert (await cs[0].subscribe(1, {}, {}))["replaying"] == 4
            await until(lambda: holds(cs[1], "sp", 4), 10, "the replay", tree)
            for s, data in payloads.items():
                assert await cs[1].get_payload("sp", 0, s) == data
            assert await cs[0].delete_attempt("sp") == 4
            assert not [f for f in spool.glob("relay-0-*/*") if f.is_file()]
            assert (await cs[0].health())["staged_bytes"] == 0

    asyncio.run(scenario())
    assert os.path.isdir(spool)


def test_receivers_at_every_live_member_reach_the_target_bits_when_a_node_dies(
    trees: Callable[..., Tree],
) -> None:
    """Fault run end to end: receivers apply while payloads stream and a node dies."""
    tree = trees(7, 2, "--parent-timeout-s", "1", "--health-interval-s", "0.2")
    attempt, victim, elements = "a-recv", 1, 300_000
    payloads = {(0, s): make_payload(attempt, 0, s, elements=elements) for s in range(5)}
    manifest = make_manifest(attempt, payloads)

    def arrays(seq: int) -> tuple[np.ndarray, np.ndarray]:  # as make_payload draws them
        rng = np.random.default_rng([0, seq, 0, len(attempt)])
        base = rng.integers(0, 1 << 16, elements, dtype=np.uint16)
        return base, base ^ rng.integers(1, 1 << 16, elements, dtype=np.uint16)

    alive = [i for i in range(7) if i != victim]
    held = {i: {f"model.layers.0.w{s}": arrays(s)[0].copy() for s in range(5)} for i in alive}
    outcome: dict[int, object] = {}

    # Sources are made (and first used) here: imports stay on the main thread.
    sources = {i: RelaySource(tree.urls[i], READ_TOKEN, attempt) for i in alive}
    assert all(s.available() == [] for s in sources.values())

    def receiver(i: int) -> None:
        source = sources[i]
        targets = {n: Target(dtype="BF16", shape=(elements,), bits=b)
                   for n, b in held[i].items()}
        try:
            outcome[i] = receive(source, attempt,
                                 lambda p: apply_items(decode(p), targets), timeout_s=40)
        except Exception as e:
            outcome[i] = e
        finally:
            source.close()

    threads = [threading.Thread(target=receiver, args=(i,)) for i in alive]
    for t in threads:
        t.start()

    async def send() -> None:
        async with Clients(tree) as cs:
            for s in range(5):
                if s == 2:
                    tree.kill(victim)  # its children must re-attach to the root
                assert await cs[0].put_payload(attempt, 0, s, payloads[0, s]) == "queued"
            assert await cs[0].put_manifest(attempt, manifest) == "queued"

    asyncio.run(send())
    for t in threads:
        t.join(60)
    for i in alive:
        assert isinstance(outcome[i], Manifest), (i, outcome[i], tree.log(i))
        for s in range(5):
            assert np.array_equal(held[i][f"model.layers.0.w{s}"], arrays(s)[1]), (i, s)


# --- several owners through the tree (relay wire 2) -------------------------------------


def _relay_receivers(tree: Tree, sd: dict[str, Any], tmp: Path) -> tuple[list[Any], list[Any]]:
    """shardrig's vLLM-layout agents (TP 2 and TP 1), each reading from its own member."""
    from shardrig import DENSE, receivers

    from dcr.transport.store import MemoryStore

    rx, models = receivers(DENSE, sd, MemoryStore(), (2, 1), tmp)
    for i, r in enumerate(rx):
        url = tree.urls[i % len(tree.urls)]
        r.source_for = lambda spec, url=url: RelaySource(url, READ_TOKEN, spec.attempt,
                                                         owners=spec.owners)
    return rx, models


def _publisher(tree: Tree) -> Any:
    from dcr.transport.relay.publish import RelayPublisher

    return RelayPublisher(f"relay+{tree.urls[0]}", token=TOKEN)


def test_two_encoder_owners_refit_every_member_bit_exactly_through_the_tree(
        trees: Callable[..., Tree], tmp_path: Path) -> None:
    """Fails on wire 1: the publisher refused owner 1's manifest part ("one manifest per
    attempt") and agents refused an attempt with two owners."""
    import torch
    from shardrig import DENSE, V0, exact, perturbed, profile_of

    from dcr.checkpoint import ArrayCheckpoint
    from dcr.owner.encoder import Encoder
    from dcr.protocol.commitstore import SqliteCommitStore
    from dcr.protocol.coordinator import Coordinator
    from dcr.runtimes.vllm_reference import random_checkpoint

    def source(sd: dict[str, torch.Tensor]) -> ArrayCheckpoint:
        return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                    .view(np.uint16)) for n, t in sd.items()})

    tree = trees(3, 2)
    v0 = random_checkpoint(DENSE, 0)
    v1, v2 = perturbed(v0, 0.02, 1), perturbed(perturbed(v0, 0.02, 1), 0.02, 2)
    rx, models = _relay_receivers(tree, v0, tmp_path)
    pubs = [_publisher(tree) for _ in range(2)]
    owners = [Encoder(store=pubs[i], baseline=source(v0), version=0, owner=i, owners=2,
                      profile=profile_of(rx)) for i in range(2)]
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx)
    try:
        for version, sd in ((1, v1), (2, v2)):
            for o in owners:
                o.set_candidate(source(sd), version)
            coord.refit(version, f"v{version}")
            assert exact(DENSE, models, sd), version
            assert all(o.manifests[-1].payloads for o in owners)  # both owners sent some
    finally:
        coord.close()
        for p in pubs:
            p.close()

    async def parts() -> list[int]:
        async with RelayClient(tree.urls[2], READ_TOKEN) as c:
            return [m["owner"] for m in (await c.listing(coord.history[-1].attempt))["manifests"]]

    assert asyncio.run(parts()) == [0, 1]  # a leaf holds each owner's part


def test_rank_owners_refit_every_member_bit_exactly_through_the_tree(
        trees: Callable[..., Tree], tmp_path: Path) -> None:
    """Trainer ranks each write part of a tensor's sums; their parts travel apart and the
    agents add them. Fails on wire 1 as the two-owner test does."""
    from shardrig import DENSE, V0, exact, perturbed, profile_of, tp_shards

    from dcr.owner.rank import RankOwner
    from dcr.protocol.commitstore import SqliteCommitStore
    from dcr.protocol.coordinator import Coordinator
    from dcr.runtimes.vllm_reference import random_checkpoint

    tree = trees(3, 2)
    v0 = random_checkpoint(DENSE, 0)
    v1 = perturbed(v0, 0.02, 1)
    rx, models = _relay_receivers(tree, v0, tmp_path)
    pubs, owners, live = [_publisher(tree) for _ in range(2)], [], []
    for r in range(2):
        maps, local = tp_shards(v0, r, 2, qkv=DENSE)
        tensors = {k: t.clone() for k, t in local.items()}
        owners.append(RankOwner(store=pubs[r], maps=maps, tensors=tensors, version=0, rank=r,
                                ranks=2))
        owners[-1].profile = profile_of(rx)
        live.append(tensors)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), owners, rx)
    try:
        for r, tensors in enumerate(live):
            for k, t in tp_shards(v1, r, 2, qkv=DENSE)[1].items():
                tensors[k].copy_(t)
            owners[r].offer(tensors, 1)
        coord.refit(1, "v1")
        assert exact(DENSE, models, v1)
        assert [o.version for o in owners] == [1, 1]
    finally:
        coord.close()
        for p in pubs:
            p.close()


def test_a_wire_1_manifest_or_subscription_is_refused_naming_both_wires(tree7: Tree) -> None:
    """An older client asking for the one manifest of an attempt, or an older member
    subscribing, is told the wire this node speaks instead of taking one owner's part for
    the whole manifest."""
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            async with http.get(tree7.urls[1] + "/v1/manifests/a-old", headers=auth) as r:
                assert r.status == 410
                assert "wire 2" in await r.text()
                assert r.headers["DCR-Relay-Wire"] == "2"
            async with http.post(tree7.urls[0] + "/v1/subscribe", headers=auth,
                                 data=b'{"index": 3, "manifests": ["a-old"]}') as r:
                assert r.status == 400
                assert ("The subscriber has relay wire version 1, but this DCR "
                        f"{__version__} reads relay wire version 2") in await r.text()

    asyncio.run(scenario())


# --- a relay fleet's history: catch-up without the training side ----------------------


@dataclass
class RelayFleet:
    """Rollout pods of a relay fleet: each agent reads attempts from its member and the
    history from the fleet's store (in the training cluster's region), and holds only the
    run's starting model on its own volume: nothing of the training side is mounted."""

    tree: Tree
    store: Any  # FileStore: the fleet's store, which owners write through to
    home: Path
    states: dict[int, Any]

    def pod(self, name: str, member: int, *, history: bool = True,
            trust_labels: bool = False) -> Any:
        from safetensors.torch import save_file
        from shardrig import DENSE

        from dcr.apply.plan import CanonicalTensor
        from dcr.files.history import HistoryStore
        from dcr.receiver.fromstore import FromStore
        from dcr.receiver.service import AgentService
        from dcr.runtimes.vllm_reference import ReferenceModel
        from dcr.serve.local import LocalDriver

        root, staging = self.home / name / "weights", self.home / name / "staging"
        (root / "v0").mkdir(parents=True)
        save_file(self.states[0], str(root / "v0" / "model.safetensors"))
        model = ReferenceModel(DENSE, tp_size=1, tp_rank=0)
        engine = LocalDriver([model], staging_dir=staging, checkpoint_root=root)
        engine.load_dense("v0")
        canonical = [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
                     for n, t in self.states[0].items()]
        url = self.tree.urls[member]
        agent = AgentService(
            name, engine, lambda spec: RelaySource(url, READ_TOKEN, spec.attempt,
                                                   owners=spec.owners),
            canonical=canonical, staging_dir=staging, version=0, checkpoint_root=root,
            store=FromStore(HistoryStore(self.store), root, seed=(0, root / "v0"))
            if history else None, trust_labels=trust_labels)
        agent.attach()
        agent.model = model  # type: ignore[attr-defined]  # for the bit-exact check
        return agent


def _relay_fleet(tree: Tree, tmp: Path, versions: int) -> RelayFleet:
    import torch
    from shardrig import DENSE, perturbed

    from dcr.runtimes.vllm_reference import random_checkpoint
    from dcr.transport.store import FileStore

    states: dict[int, torch.Tensor] = {0: random_checkpoint(DENSE, 0)}
    for v in range(1, versions + 1):
        states[v] = perturbed(states[v - 1], 0.02, v)
    return RelayFleet(tree=tree, store=FileStore(tmp / "store"), home=tmp / "pods",
                      states=states)


def _bit_exact(agent: Any, state: dict[str, Any]) -> bool:
    import torch
    from shardrig import DENSE

    from dcr.runtimes.vllm_reference import ReferenceModel, dense_state

    dense = ReferenceModel(DENSE, tp_size=1, tp_rank=0)
    dense.load_weights(state.items())
    a, b = dense_state(agent.model), dense_state(dense)
    return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def test_a_fresh_pod_of_a_relay_fleet_catches_up_from_its_history_after_the_tree_lost_its_spool(
        trees: Callable[..., Tree], tmp_path: Path) -> None:
    """Two owners write each attempt through to the fleet's store and to the root; the
    coordinator writes the history there. After v2 every member restarts with an empty
    spool, and a pod added then (its volume: the starting model only) is rejoined at v2
    from the history, then refit to v3 through the tree, bit-exact like the others.
    Fails without a relay fleet's history: the coordinator had only the training side's
    checkpoint path to offer, which this pod cannot reach."""
    import torch
    from shardrig import V0, profile_of

    from dcr.checkpoint import ArrayCheckpoint
    from dcr.files.history import HistoryStore
    from dcr.owner.encoder import Encoder
    from dcr.protocol.commitstore import SqliteCommitStore
    from dcr.protocol.coordinator import Coordinator
    from dcr.transport.relay.publish import RelayPublisher

    def source(sd: dict[str, torch.Tensor]) -> ArrayCheckpoint:
        return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                    .view(np.uint16)) for n, t in sd.items()})

    spool = tmp_path / "spool"
    tree = trees(3, 2, "--budget-mib", "1", "--spool", str(spool))
    fleet = _relay_fleet(tree, tmp_path, 3)
    pods = [fleet.pod(f"pod-{i}", i) for i in range(3)]
    pub = RelayPublisher(f"relay+{tree.urls[0]}", token=TOKEN, through=fleet.store)
    owners = [Encoder(store=pub, baseline=source(fleet.states[0]), version=0, owner=i,
                      owners=2, profile=profile_of(pods)) for i in range(2)]
    commits = SqliteCommitStore(tmp_path / "c.db", V0)
    history = HistoryStore(fleet.store)
    coord = Coordinator(commits, owners, pods, history=history)
    try:
        for v in (1, 2):
            for o in owners:
                o.set_candidate(source(fleet.states[v]), v)
            coord.refit(v, f"v{v}")
    finally:
        coord.close()
    assert [c.version for c in history.read().versions] == [1, 2]

    for i in range(3):  # every member loses what it staged, its spool included
        tree.kill(i)
    shutil.rmtree(spool)
    for i in range(3):
        tree.start(i)
    asyncio.run(_wait_ready(tree))

    added = fleet.pod("added", 1)
    coord = Coordinator(commits, owners, [*pods, added], history=history)
    try:
        for o in owners:
            o.set_candidate(source(fleet.states[3]), 3)
        record = coord.refit(3, "v3")
    finally:
        coord.close()
        pub.close()
    assert record.committed_version == 3
    assert coord.history[-1].rejoined == ("added",)
    assert added.counters.store_bytes_fetched > 0  # v2 built from the history
    for p in [*pods, added]:
        assert _bit_exact(p, fleet.states[3]), p.name


def test_a_fresh_agent_of_a_relay_fleet_without_history_refuses_an_unverifiable_label(
        trees: Callable[..., Tree], tmp_path: Path) -> None:
    """Nothing vouches for version 2's bits: no history, and the agent committed no attempt
    of it. A checkpoint offered as "version 2" is refused by name, the weights and gate as
    they were; the same agent given the fleet's history loads v2 once it is vouched for.
    Fails before: the label alone decided, and v1's bits would serve as version 2."""
    from safetensors.torch import save_file

    from dcr.receiver.service import AgentConflict

    tree = trees(1, 2)
    fleet = _relay_fleet(tree, tmp_path, 2)
    bare = fleet.pod("bare", 0, history=False)
    (bare.checkpoint_root / "v2").mkdir()
    save_file(fleet.states[1], str(bare.checkpoint_root / "v2" / "model.safetensors"))
    before = bare.engine.fingerprint()
    with pytest.raises(AgentConflict, match=r"bare: dense load of version 2 refused: no "
                       r"history vouches .* checkpoint labelled 2 cannot be checked"):
        bare.rejoin(2, "v2")
    assert bare.engine.fingerprint() == before
    assert (bare.status().version, bare.status().gate_open) == (0, True)
    # What every agent did before (and an in-process caller that made the checkpoint
    # still may): the label alone decides, and v1's bits serve as version 2.
    trusting = fleet.pod("trusting", 0, history=False, trust_labels=True)
    (trusting.checkpoint_root / "v2").mkdir()
    save_file(fleet.states[1], str(trusting.checkpoint_root / "v2" / "model.safetensors"))
    assert trusting.rejoin(2, "v2").version == 2
    assert _bit_exact(trusting, fleet.states[1])

    # ``dcr agent`` builds its agent so: a relay agent without --store trusts no label.
    from dcr.receiver.main import build_service
    from dcr.receiver.settings import AgentSettings

    (tmp_path / "read-token").write_text(READ_TOKEN + "\n")
    settings = AgentSettings(name="cli", state_dir=tmp_path / "cli-state",
                             staging_dir=tmp_path / "cli-staging",
                             canonical=bare.checkpoint_root / "v0", relay=tree.urls[0],
                             relay_token_file=tmp_path / "read-token",
                             engine_url="http://127.0.0.1:9")
    assert build_service(settings, engine=bare.engine).trust_labels is False


# --- what the tree keeps: the latest committed attempt -----------------------------------


@dataclass
class _Owner:
    """An encoder owner whose publish of ``version`` does something around it once:
    ``fail`` after publishing (the attempt then fails and is retried), ``before`` and
    ``after`` run beside the publish while the receivers wait in the attempt."""

    inner: Any
    version: int = 0
    fail: bool = False
    before: Callable[[], None] = lambda: None
    after: Callable[[], None] = lambda: None
    done: bool = False

    def publish(self, attempt: Any) -> None:
        once = attempt.transition.target_version == self.version and not self.done
        if once:
            self.before()
        self.inner.publish(attempt)
        if once:
            self.done = True
            self.after()
            if self.fail:
                from dcr.errors import DcrError

                raise DcrError(f"owner lost after publishing {attempt.id}")

    def advance_baseline(self, record: Any) -> None:
        self.inner.advance_baseline(record)


def _tree_holds(tree: Tree) -> list[dict[str, int]]:
    """Each member's staged bytes per attempt (``/v1/status``), after asserting that they
    add up to its ``staged_bytes``."""

    async def read() -> list[dict[str, int]]:
        async with Clients(tree, READ_TOKEN) as cs:
            out = []
            for i, c in enumerate(cs):
                st = await c.status()
                assert st["staged_bytes"] == sum(st["attempts"].values()), (i, st)
                out.append(st["attempts"])
            return out

    return asyncio.run(read())


def _keeping_fleet(trees: Callable[..., Tree], tmp: Path, versions: int
                   ) -> tuple[RelayFleet, list[Any], Any]:
    """A 3-member tree (a spool, so no upload ever waits for budget), a pod at each
    member and one encoder owner writing through to the fleet's store."""
    from shardrig import profile_of

    from dcr.owner.encoder import Encoder
    from dcr.transport.relay.publish import RelayPublisher

    tree = trees(3, 2, "--budget-mib", "1", "--spool", str(tmp / "spool"))
    fleet = _relay_fleet(tree, tmp, versions)
    pods = [fleet.pod(f"pod-{i}", i) for i in range(3)]
    pub = RelayPublisher(f"relay+{tree.urls[0]}", token=TOKEN, through=fleet.store)
    owner = Encoder(store=pub, baseline=_array(fleet.states[0]), version=0, owner=0,
                    owners=1, profile=profile_of(pods))
    return fleet, pods, owner


def _array(sd: dict[str, Any]) -> Any:
    import torch

    from dcr.checkpoint import ArrayCheckpoint

    return ArrayCheckpoint({n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy()
                                .view(np.uint16)) for n, t in sd.items()})


def test_after_n_refits_every_member_holds_only_the_latest_committed_attempt(
        trees: Callable[..., Tree], tmp_path: Path) -> None:
    """Four refits through the tree, the second failing once after its payloads were
    staged everywhere: each commit drops, at the root and so at every member, the attempt
    it replaced and the refit's failed one. Fails without the coordinator's drop: every
    member still held all five attempts (the staged bytes grew with every version until
    uploads waited for budget and got 503)."""
    from shardrig import V0

    from dcr.files.history import HistoryStore
    from dcr.protocol.commitstore import SqliteCommitStore
    from dcr.protocol.coordinator import Coordinator, CoordinatorSettings

    fleet, pods, encoder = _keeping_fleet(trees, tmp_path, 4)
    owner = _Owner(inner=encoder, version=2, fail=True)
    pub = encoder.store
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", V0), [owner], pods,
                        history=HistoryStore(fleet.store), cache=pub,
                        settings=CoordinatorSettings(retry_wait_s=0.0))
    try:
        for v in range(1, 5):
            encoder.set_candidate(_array(fleet.states[v]), v)
            record = coord.refit(v, f"v{v}")
            held = _tree_holds(fleet.tree)
            assert all(list(h) == [record.attempt] for h in held), (v, held)
    finally:
        coord.close()
        pub.close()
    outcomes = [h.outcome.split(":")[0] for h in coord.history]
    assert outcomes == ["committed", "failed", "committed", "committed", "committed"]
    assert all(h[record.attempt] > 0 for h in held)
    for p in pods:
        assert _bit_exact(p, fleet.states[4]), p.name
    # the fleet's store keeps every attempt for catch-up: the drop is the tree's alone
    keys = fleet.store.list("")
    assert all(any(f"/{h.attempt}/" in k for k in keys) for h in coord.history)


def test_a_refit_in_flight_survives_the_drop_of_the_attempt_it_replaces(
        trees: Callable[..., Tree], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The replaced attempt is dropped (as a late cleanup from a coordinator that failed
    over would) while every pod waits in the next attempt, before and again after its
    payloads reach the tree: the pods still reach v2 bit-exactly, and then a pod added at
    v2 rejoins from the history, not from the tree. The coordinator's own drop after v2
    goes to a root that is down: the commit stands, with a warning. Fails without
    ``RelayPublisher.drop_attempts`` (no party could drop an attempt: AttributeError)."""
    from shardrig import V0

    from dcr.files.history import HistoryStore
    from dcr.protocol.commitstore import SqliteCommitStore
    from dcr.protocol.coordinator import Coordinator
    from dcr.transport.relay.publish import RelayPublisher

    fleet, pods, encoder = _keeping_fleet(trees, tmp_path, 3)
    pub = encoder.store
    commits = SqliteCommitStore(tmp_path / "c.db", V0)
    history = HistoryStore(fleet.store)
    first: list[str] = []
    owner = _Owner(inner=encoder, version=2, before=lambda: pub.drop_attempts(first),
                   after=lambda: pub.drop_attempts(first))
    down = RelayPublisher(f"relay+http://127.0.0.1:{free_ports(1)[0]}", token=TOKEN)
    coord = Coordinator(commits, [owner], pods, history=history, cache=down)
    try:
        encoder.set_candidate(_array(fleet.states[1]), 1)
        first.append(coord.refit(1, "v1").attempt)
        assert all(list(h) == first for h in _tree_holds(fleet.tree))
        encoder.set_candidate(_array(fleet.states[2]), 2)
        with caplog.at_level("WARNING", logger="dcr.protocol.coordinator"):
            second = coord.refit(2, "v2").attempt
    finally:
        coord.close()
        down.close()
    assert f"could not drop replaced attempts {first[0]}" in caplog.text
    assert all(list(h) == [second] for h in _tree_holds(fleet.tree))
    for p in pods:
        assert _bit_exact(p, fleet.states[2]), p.name

    added = fleet.pod("added", 2)
    coord = Coordinator(commits, [owner], [*pods, added], history=history, cache=pub)
    try:
        encoder.set_candidate(_array(fleet.states[3]), 3)
        third = coord.refit(3, "v3").attempt
    finally:
        coord.close()
        pub.close()
    assert coord.history[-1].rejoined == ("added",)
    assert all(list(h) == [third] for h in _tree_holds(fleet.tree))
    for p in [*pods, added]:
        assert _bit_exact(p, fleet.states[3]), p.name


def test_past_keep_attempts_a_member_evicts_the_oldest_attempt_nothing_is_using(
        trees: Callable[..., Tree]) -> None:
    """No DELETE comes (as when the committer died): with ``--keep-attempts 2`` each member
    evicts the oldest attempt as a newer one arrives, but never one still arriving (a slow
    upload held open across three newer attempts), and refuses an evicted one's bytes
    again (410), so a replay cannot bring it back. Fails without the bound: every member
    held all four attempts (and ``dcr relay`` had no ``--keep-attempts``)."""
    tree = trees(3, 2, "--keep-attempts", "2")
    names = ("a-keep1", "a-keep2", "a-keep3")
    small = {a: make_payload(a, 0, 0, elements=1000) for a in names}
    slow = make_payload("a-slow", 0, 0, elements=200_000)

    async def scenario() -> None:
        async with Clients(tree) as cs:
            release = asyncio.Event()
            upload = asyncio.create_task(cs[0].put_payload(
                "a-slow", 0, 0, slow_body(slow, pause_at=len(slow) // 2, pause=release.wait),
                size=len(slow)))

            async def arriving(c: RelayClient) -> bool:
                return any(b["attempt"] == "a-slow" for b in (await c.status())["arriving"])

            for i, c in enumerate(cs):
                await until(lambda c=c: arriving(c), 20, f"a-slow arriving at {i}", tree)
            for a in names:
                assert await cs[0].put_payload(a, 0, 0, small[a]) == "queued"
                for i, c in enumerate(cs):
                    await until(lambda c=c, a=a: holds(c, a, 1), 20, f"{a} at {i}", tree)
            release.set()
            assert await upload == "queued"
            for i, c in enumerate(cs):
                await until(lambda c=c: holds(c, "a-slow", 1), 20, f"a-slow at {i}", tree)
            with pytest.raises(RelayError) as e:
                await cs[0].put_payload("a-keep1", 0, 0, small["a-keep1"])
            assert e.value.status == 410
            assert "evicted" in str(e.value)

    asyncio.run(scenario())
    for i, held in enumerate(_tree_holds(tree)):
        assert {"a-slow", "a-keep3"} <= set(held), (i, held)
        assert "a-keep1" not in held, (i, held)
        assert len(held) <= 3, (i, held)


def test_a_member_that_evicted_an_attempt_its_parent_holds_is_not_offered_it_again(
        trees: Callable[..., Tree]) -> None:
    """Members evict by their own arrival order, which may differ: the leaf takes a-a2
    first (a publisher put it there), the root a-z1, so a fourth attempt makes each evict
    another. The leaf's subscriptions claim what it evicted as held, so the root's resyncs
    do not offer it again. Fails without the claim: every resync re-sent a-a2 and the leaf
    refused it (410)."""
    tree = trees(2, 1, "--keep-attempts", "3", "--resync-interval-s", "0.3")
    names = ("a-z1", "a-a2", "a-m3", "a-n4")
    data = {a: make_payload(a, 0, 0, elements=1000) for a in names}

    async def scenario() -> None:
        async with Clients(tree) as cs:
            assert await cs[1].put_payload("a-a2", 0, 0, data["a-a2"]) == "queued"
            for a in names:
                assert await cs[0].put_payload(a, 0, 0, data[a]) == "queued"
                await until(lambda a=a: holds(cs[1], a, 1), 30, f"{a} at the leaf", tree)
            seen = (await counters(cs[0]))["subscriptions"]

            async def resynced() -> bool:
                return (await counters(cs[0]))["subscriptions"] >= seen + 3

            await until(resynced, 30, "three resyncs of the leaf", tree)
            assert (await counters(cs[1]))["refused_evicted"] == 0

    asyncio.run(scenario())
    root, leaf = _tree_holds(tree)
    assert set(root) == {"a-a2", "a-m3", "a-n4"}, root  # a-z1 arrived first at the root
    assert set(leaf) == {"a-z1", "a-m3", "a-n4"}, leaf  # a-a2 arrived first at the leaf
