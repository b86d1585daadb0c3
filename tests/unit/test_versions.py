"""Every reader refuses a version it does not read with one sentence naming both versions
(dcr.versions): the payload and manifest containers, the manifest document (as a receiver
and as a relay read it), the history, the commit file, and the HTTP APIs of the warm
encoder (the agent API's are in test_protocol_agent_api.py).
"""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
from aiohttp import web

from dcr import __version__
from dcr.errors import ConfigError, MalformedPayload, ManifestError
from dcr.format.commitfile import CommitFile
from dcr.format.history import INDEX_VERSIONS, History, parse_index
from dcr.format.manifest import Manifest, manifest_attempt, seal_document
from dcr.format.payload import pack_payload, read_payload
from dcr.http.edge import Statuses, guard
from dcr.protocol.encoder_api import EncoderClient, EncoderError
from dcr.receiver.member_api import MemberClient, MemberError
from dcr.transport.relay.wire import WIRE, WIRE_HEADER
from dcr.versions import (
    ENCODER_API,
    MEMBER_API,
    OVERRIDE_ENV,
    RELEASE_HEADER,
    SNAPSHOT_INDEX,
    WIRES,
    Wire,
    _overridden,
    release_of,
)

FP = "xxh3-128:" + "0" * 32
TOKEN = "t0ken-for-the-version-tests"


def refusal(name: str, got: int, reads: str) -> str:
    """The sentence's core, as a regex: what it got and what this build reads."""
    return (rf"has {name} version {got}, but this DCR {__version__} reads {name} {reads}: "
            r"upgrade the older side")


def manifest_doc(version: int) -> bytes:
    """A manifest document; past version 3 with a field that version 4 adds."""
    newer = {"a_field_of_version_4": True} if version > 3 else {}
    return json.dumps({
        "format": "dcr-manifest", "format_version": version, "base_version": 1,
        "target_version": 2, "attempt": "a-1", "mode": "mixed", "payloads": [],
        "tensors": [{"name": "w", "dtype": "BF16", "shape": [2], "base": FP, "target": FP}],
        "stats": {"tensors": 1, "changed_elements": 0, "total_elements": 2, "dense_bytes": 4,
                  "payload_bytes": 0}, **newer}, separators=(",", ":")).encode()


def with_version(data: bytes, version: int) -> bytes:
    """A container with its preamble's version field (bytes 8-9, FORMAT.md) replaced."""
    return data[:8] + struct.pack("<H", version) + data[10:]


def test_a_payload_of_the_next_format_is_refused_naming_both_versions() -> None:
    data = pack_payload(base_version=1, target_version=2, attempt="a-1", owner=0, seq=0,
                        mode="mixed", items=(), streams={})
    read_payload(data)
    with pytest.raises(MalformedPayload, match=refusal("payload format", 2, "version 1")):
        read_payload(with_version(data, 2))


def test_a_manifest_container_of_the_next_format_is_refused_naming_both_versions() -> None:
    data = seal_document(manifest_doc(2))
    assert Manifest.parse(data, "k").format_version == 2
    for read in (Manifest.parse, manifest_attempt):
        with pytest.raises(ManifestError, match="Manifest v1/manifest.dcrm " +
                           refusal("manifest format", 3, "version 2")):
            read(with_version(data, 3), "v1/manifest.dcrm")


def test_a_manifest_document_of_the_next_format_is_refused_before_its_new_fields() -> None:
    data = seal_document(manifest_doc(4))  # a field version 4 adds, which 2-3 forbid
    for read in (Manifest.parse, manifest_attempt):  # a receiver; a relay (its head only)
        with pytest.raises(ManifestError, match=refusal("manifest document format", 4,
                                                        "versions 2-3")):
            read(data, "k")


def test_a_history_of_the_next_format_is_refused_naming_both_versions() -> None:
    doc = {**json.loads(History().pack()), "format_version": 2, "retained_by": "ranks"}
    with pytest.raises(ManifestError, match="History h " + refusal("history format", 2,
                                                                   "version 1")):
        History.parse(json.dumps(doc).encode(), "h")


def test_a_snapshot_index_of_the_next_format_is_refused_naming_both_versions() -> None:
    assert tuple(sorted(INDEX_VERSIONS)) == SNAPSHOT_INDEX.reads
    doc = b'{"format":"dcr-snapshot","format_version":3,"version":4,"files":[],"tensors":{}}'
    with pytest.raises(ManifestError, match="Snapshot index s " + refusal(
            "snapshot index format", 3, "versions 1-2")):
        parse_index(doc, "s")


def test_a_commit_file_of_the_next_format_is_refused_naming_both_versions() -> None:
    doc = {**json.loads(CommitFile(committed_version=3).pack()), "format_version": 2,
           "signed_by": "x"}
    with pytest.raises(ConfigError, match=refusal("commit file format", 2, "version 1")):
        CommitFile.parse(json.dumps(doc).encode(), "/etc/dcr/commit.json")


def test_a_version_that_is_not_a_number_is_refused_without_its_bytes() -> None:
    wire = Wire(key="w", name="w API", writes=1, reads=(1,), header="DCR-W")
    for sent in ("1.5", "\uff12", "-1", "<img src=x>"):  # the peer's bytes never reach the sentence
        with pytest.raises(ValueError, match=r"has w API version \(not a version number\), "
                           "but"):
            wire.check_headers({"dcr-w": sent}, "The request", ValueError)
    wire.check_headers({}, "A peer that predates the header", ValueError)  # speaks 1


def test_the_test_override_names_a_wire_and_a_number_or_is_refused() -> None:
    bumped, release = _overridden(tuple(WIRES.values()), "agent-api=2, release=0.2.0rc1")
    assert (bumped["agent-api"].writes, bumped["agent-api"].reads, release) == (
        2, (2,), "0.2.0rc1")
    assert bumped["payload"] == WIRES["payload"]
    assert _overridden(tuple(WIRES.values()), "") == (WIRES, __version__)
    for bad in ("agent=2", "agent-api=two", "agent-api", "release=0.2 beta"):
        with pytest.raises(ConfigError, match=rf"{OVERRIDE_ENV} item '{bad}' is not WIRE=N"):
            _overridden(tuple(WIRES.values()), bad)


# --- the warm encoder's and a group member's APIs -----------------------------------

STOPPED = {"attempt": "a-1", "stopped": 0, "running": 0}
MEMBER = {"name": "m", "attempt": "a-1", "staged": [], "received": False, "error": None}


@contextmanager
def server(wire: Wire, path: str = "/v1/stop", answer: object = STOPPED) -> Iterator[str]:
    """A server speaking ``wire`` on loopback behind DCR's edge, answering ``path``."""

    async def answered(_: web.Request) -> web.StreamResponse:
        return web.json_response(answer)

    app = web.Application(middlewares=[guard(TOKEN, Statuses(), wire=wire)])
    app.add_routes([web.route("*", path, answered)])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_an_encoder_of_the_next_api_version_is_refused_by_name() -> None:
    with server(ENCODER_API) as url:
        assert EncoderClient(url, TOKEN).stop("a-1").attempt == "a-1"
    skew = r"The answer of Encoder endpoint encoder \(POST /v1/stop\) " + refusal(
        "encoder API", 2, "version 1")
    with (server(replace(ENCODER_API, writes=2, reads=(2,))) as url,
          pytest.raises(EncoderError, match=skew) as e):
        EncoderClient(url, TOKEN).stop("a-1")
    assert e.value.kind == "VersionSkew"


def test_an_encoder_refuses_a_request_of_the_next_api_version_before_its_handler() -> None:
    with server(ENCODER_API) as url:
        req = urllib.request.Request(
            url + "/v1/stop", data=b"{}", method="POST",
            headers={"Authorization": f"Bearer {TOKEN}", ENCODER_API.header: "2"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        with e.value:
            body = json.loads(e.value.read())
            assert e.value.headers[ENCODER_API.header] == "1"
    assert (e.value.code, body["kind"]) == (400, "VersionSkew")
    assert body["error"].startswith("The request " + f"has encoder API version 2, but this "
                                    f"DCR {__version__} reads encoder API version 1")


def test_a_release_header_reaches_status_only_when_it_is_a_release() -> None:
    assert release_of({RELEASE_HEADER: "0.2.0+cu128"}) == "0.2.0+cu128"
    for hostile in ("0.2.0\nX-Injected: 1", "x" * 65, "<script>", ""):
        assert release_of({RELEASE_HEADER: hostile}) == ""
    assert release_of({}) == ""


def test_the_relays_own_version_is_the_tables() -> None:
    relay = WIRES["relay-wire"]
    assert (relay.writes, relay.reads, relay.header) == (WIRE, (WIRE,), WIRE_HEADER)


def test_a_group_member_of_the_next_api_version_is_refused_by_name() -> None:
    ahead = replace(MEMBER_API, writes=2, reads=(2,))
    with server(MEMBER_API, "/v1/member/status", MEMBER) as url:
        assert MemberClient(url, TOKEN).status("a-1").attempt == "a-1"
    skew = (r"member http://\S+: status: The answer of member agent at \S+: status \(GET "
            r"/v1/member/status\?attempt=a-1\) " + refusal("member API", 2, "version 1"))
    with (server(ahead, "/v1/member/status", MEMBER) as url,
          pytest.raises(MemberError, match=skew)):
        MemberClient(url, TOKEN).status("a-1")
