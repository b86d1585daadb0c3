"""Every wire DCR speaks, the version this build writes and those it reads, and the one
sentence a reader refuses another version with.

A wire is anything one DCR process writes and another reads: the payload and manifest
containers, the store's history, snapshot indexes and the commit file, and the HTTP APIs
(agent, warm encoder, replica-group member, relay). Each carries its version explicitly
(a preamble field, a ``format_version`` field, or the :attr:`Wire.header` of every request
and answer), and a reader that meets a version it does not read says so with
:meth:`Wire.refusal`, naming what it got and what it reads, instead of failing later on a
field it does not know. An HTTP peer without the header predates it and speaks version 1.
docs/upgrades.md argues the skew policy these numbers serve.

``DCR_WIRE_VERSIONS`` (``agent-api=2,manifest=3``; ``release=0.2.0`` renames the release)
makes this process write and read only the versions it names: how tests stand up a build
one version ahead, or an upgraded one, without a second build. Never set it in production.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dcr import __version__
from dcr.errors import ConfigError, Invalid

if TYPE_CHECKING:
    from pydantic import ValidationError

OVERRIDE_ENV = "DCR_WIRE_VERSIONS"
RELEASE_HEADER = "DCR-Release"  # every HTTP answer names the release that wrote it
UNVERSIONED = 1  # what an HTTP peer without the version header speaks


class VersionSkew(Invalid):
    """A request speaks a version of an HTTP API this server does not read (400)."""


@dataclass(frozen=True, kw_only=True)
class Wire:
    """One wire: ``writes`` is what this build writes, ``reads`` what it accepts."""

    key: str  # the name in DCR_WIRE_VERSIONS and docs/upgrades.md's table
    name: str  # as a sentence names it: "manifest format"
    writes: int
    reads: tuple[int, ...]  # ascending
    header: str = ""  # the HTTP header carrying the version ("" for a file format)

    def refusal(self, what: str, got: object) -> str:
        """The one sentence: ``what`` (the object or peer) speaks version ``got``, this
        build reads these; which side to upgrade."""
        shown = str(got) if type(got) is int else "(not a version number)"  # never bytes
        return (f"{what} has {self.name} version {shown}, but this DCR {RELEASE} reads "
                f"{self.name} {_versions(self.reads)}: upgrade the older side within the "
                "supported skew (docs/upgrades.md, \"Skew\").")

    def check(self, what: str, got: object, error: Callable[[str], Exception]) -> int:
        """``got``, a version this build reads; else raise ``error(sentence)``."""
        if type(got) is not int or got not in self.reads:
            raise error(self.refusal(what, got))
        return got

    def refuse_invalid(self, e: ValidationError, what: str,
                       error: Callable[[str], Exception]) -> None:
        """Raise ``error(sentence)`` when a document failed validation because its
        ``format_version`` is not one this build reads: that, not the first field a newer
        writer added, is what its reader must be told."""
        for err in e.errors():
            if err["loc"] == ("format_version",):
                raise error(self.refusal(what, err.get("input")))

    def headers(self) -> dict[str, str]:
        """What every request and answer of this HTTP API carries."""
        return {self.header: str(self.writes), RELEASE_HEADER: RELEASE}

    def check_headers(self, headers: Mapping[str, str], what: str,
                      error: Callable[[str], Exception]) -> None:
        """Refuse a request or answer whose version header is not one this build reads
        (none: :data:`UNVERSIONED`)."""
        name = self.header.lower()  # header names are case-insensitive
        text = next((v for k, v in headers.items() if k.lower() == name), None)
        got: object = UNVERSIONED if text is None else (
            int(text) if text.isascii() and text.isdigit() and len(text) < 10 else text)
        self.check(what, got, error)


def release_of(headers: Mapping[str, str]) -> str:
    """The release an answer names (:data:`RELEASE_HEADER`), or "" when it names none or
    something that is not a release: the peer's bytes reach status only as a release."""
    text = headers.get(RELEASE_HEADER) or ""
    return text if _RELEASE_RE.fullmatch(text) else ""


def _versions(reads: tuple[int, ...]) -> str:
    if len(reads) == 1:
        return f"version {reads[0]}"
    if reads == tuple(range(reads[0], reads[-1] + 1)):
        return f"versions {reads[0]}-{reads[-1]}"
    return "versions " + ", ".join(map(str, reads))


_BUILT = (
    Wire(key="payload", name="payload format", writes=1, reads=(1,)),
    Wire(key="manifest", name="manifest format", writes=2, reads=(2,)),
    Wire(key="manifest-document", name="manifest document format", writes=3, reads=(2, 3)),
    Wire(key="history", name="history format", writes=1, reads=(1,)),
    # dcr.format.history.INDEX_VERSIONS: 1 a checkpoint's files, 2 the ranks' parts.
    Wire(key="snapshot-index", name="snapshot index format", writes=2, reads=(1, 2)),
    Wire(key="commit-file", name="commit file format", writes=1, reads=(1,)),
    Wire(key="agent-api", name="agent API", writes=1, reads=(1,), header="DCR-Agent-API"),
    Wire(key="encoder-api", name="encoder API", writes=1, reads=(1,),
         header="DCR-Encoder-API"),
    Wire(key="member-api", name="member API", writes=1, reads=(1,), header="DCR-Member-API"),
    # dcr.transport.relay.wire.WIRE: the relay refuses wire 1's spellings itself (410).
    Wire(key="relay-wire", name="relay wire", writes=2, reads=(2,), header="DCR-Relay-Wire"),
)


_RELEASE_RE = re.compile(r"[0-9A-Za-z.+-]{1,64}")


def _overridden(wires: tuple[Wire, ...], text: str) -> tuple[dict[str, Wire], str]:
    """The table, with each ``key=N`` of ``text`` writing and reading only version N; and
    the release (``release=`` of ``text``, else this build's)."""
    table, release = {w.key: w for w in wires}, __version__
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if key == "release" and _RELEASE_RE.fullmatch(value):
            release = value
        elif key in table and value.isdigit():
            table[key] = replace(table[key], writes=int(value), reads=(int(value),))
        else:
            raise ConfigError(f"{OVERRIDE_ENV} item {item!r} is not WIRE=N with WIRE one of "
                              f"{sorted(table)}, nor release=VERSION.")
    return table, release


WIRES, RELEASE = _overridden(_BUILT, os.environ.get(OVERRIDE_ENV, ""))
PAYLOAD = WIRES["payload"]
MANIFEST = WIRES["manifest"]
MANIFEST_DOCUMENT = WIRES["manifest-document"]
HISTORY = WIRES["history"]
SNAPSHOT_INDEX = WIRES["snapshot-index"]
COMMIT_FILE = WIRES["commit-file"]
AGENT_API = WIRES["agent-api"]
ENCODER_API = WIRES["encoder-api"]
MEMBER_API = WIRES["member-api"]
RELAY_WIRE = WIRES["relay-wire"]
