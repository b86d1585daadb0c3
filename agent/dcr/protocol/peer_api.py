"""The donor routes: how one agent lends the copy of a committed version it holds on disk to
another agent catching up, declared once (both ends type their bodies from here).

A reader takes a **lease** first: the donor names the version its copy holds and the
tensor files (name and size) it lends, and until the lease is released or lapses the
donor does not rewrite that copy (its next build from the store waits). The reader then
fetches each file by name under the lease, and releases it::

    POST /v1/peer/lease    LeaseRequest -> Offer   the version held and its tensor files
    GET  /v1/peer/file     ?lease=&name= -> bytes  one file of the lease, whole
    POST /v1/peer/release  LeaseRef     -> {}      the copy may change again

Every route asks for the fleet's **peer read token**, never the agent token
(docs/security-receivers.md, "Peers"). A donor lends nothing during an attempt or a dense
load (409): the live fleet's refit keeps its disk and network. The reader trusts no byte
of an offer: names, counts and sizes are bounded here, and every tensor is checked
against the fingerprints the store's history vouches for before anything is loaded
(docs/catch-up.md, "From a peer").
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

from dcr.protocol.agent_api import _Body  # the agent's bodies' rules: frozen, strict, closed

PEER_API = 1  # the version of these bodies; a reader refuses an offer of another
LEASE_PATH = "/v1/peer/lease"
FILE_PATH = "/v1/peer/file"
RELEASE_PATH = "/v1/peer/release"
PATHS = frozenset({LEASE_PATH, FILE_PATH, RELEASE_PATH})
LEASE_ID = r"^[0-9a-f]{32}$"
# A lent file: a safetensors shard or the shards' index, one name without a directory.
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # fullmatch
MAX_FILES = 65536  # tensor files of one checkpoint (far beyond any model's shards)
MAX_OFFER_BYTES = 8 << 20  # an offer's JSON (65536 names of 255 characters fit)


class LeaseRequest(_Body):
    version: Annotated[int, Field(ge=0)]  # the newest version the reader can use


class LentFile(_Body):
    name: Annotated[str, Field(min_length=1, max_length=255)]
    size: Annotated[int, Field(ge=0)]


class Offer(_Body):
    api: int = PEER_API
    lease: Annotated[str, Field(pattern=LEASE_ID)]
    version: Annotated[int, Field(ge=0)]  # what the donor's copy holds (<= the asked one)
    files: Annotated[tuple[LentFile, ...], Field(min_length=1, max_length=MAX_FILES)]
    lease_s: Annotated[float, Field(gt=0)]  # how long the lease lasts after each fetch


class LeaseRef(_Body):
    lease: Annotated[str, Field(pattern=LEASE_ID)]


__all__ = ["FILE_NAME", "FILE_PATH", "LEASE_ID", "LEASE_PATH", "MAX_FILES",
           "MAX_OFFER_BYTES", "PATHS", "PEER_API", "RELEASE_PATH", "LeaseRef",
           "LeaseRequest", "LentFile", "Offer"]
