"""The reader side of a catch-up from a peer: fetch a donor agent's copy of a committed
version under a lease, then let the store's history judge it.

The agent is told its donors by ``--donor URL`` (docs/catch-up.md, "From a peer"). For each
in turn it takes a lease for a version no newer than the one it builds and newer than what
it holds itself, checks the offer against what the history says a checkpoint of that
version can hold (names, file count, bytes), fetches each file whole into a fresh
directory, and releases the lease. Whether the bits are right is not this module's call:
:func:`~dcr.files.materialize.materialize` compares every tensor with the fingerprints the
history vouches for before anything is replayed or loaded, exactly as for a seed or a
mirror, and a refused copy is removed (:mod:`dcr.receiver.fromstore` goes on to the next
donor, then to the store).
"""

from __future__ import annotations

import http.client
import logging
import math
import shutil
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import urllib3
from pydantic import ValidationError

from dcr.errors import ExternalError
from dcr.files.vouched import is_tensor_file
from dcr.format.dtypes import DTYPES
from dcr.http.deadline import POOL_CLASSES
from dcr.http.direct import check_url, excerpt, read_bounded, unreachable_reason
from dcr.http.tls import check_peer_url, pooled_request
from dcr.protocol.peer_api import (
    FILE_NAME,
    FILE_PATH,
    LEASE_PATH,
    MAX_OFFER_BYTES,
    PEER_API,
    RELEASE_PATH,
    LeaseRef,
    LeaseRequest,
    Offer,
)

log = logging.getLogger(__name__)
CHUNK = 8 << 20  # bytes read from a donor per write to disk
_PER_TENSOR = 4096  # header and index bytes a tensor may take beyond its data
_PER_FILE = 8 + (64 << 10)  # a file's length prefix and its header's metadata
_POOL = urllib3.PoolManager(num_pools=64, maxsize=2, block=False, retries=False)
_POOL.pool_classes_by_scheme = dict(POOL_CLASSES)


class PeerRefused(ExternalError):
    """A donor's copy is not taken: it lends none now, its offer or its bytes are not what
    a checkpoint of the version can be, or it could not be reached."""


@dataclass(frozen=True, kw_only=True)
class Fetched:
    donor: str  # the donor's URL
    version: int  # what its copy holds, as it says (the history's fingerprints judge it)
    path: Path
    bytes: int  # fetched from the donor


@dataclass(frozen=True, kw_only=True)
class Bound:
    """What a checkpoint of a version can hold: its tensors' bytes and count."""

    tensor_bytes: int
    tensors: int

    @classmethod
    def of(cls, layout: Mapping[str, tuple[str, tuple[int, ...]]]) -> Bound:
        """From every tensor's dtype and shape (a dtype this reader does not know counts
        as the widest)."""
        widest = max(d.itemsize for d in DTYPES.values())
        return cls(tensors=len(layout), tensor_bytes=sum(
            math.prod(shape) * (DTYPES[dtype].itemsize if dtype in DTYPES else widest)
            for dtype, shape in layout.values()))

    def check(self, offer: Offer, donor: str) -> None:
        files = offer.files
        bad = [f.name for f in files if FILE_NAME.fullmatch(f.name) is None
               or not is_tensor_file(f.name)]
        if bad or len({f.name for f in files}) != len(files):
            raise PeerRefused(f"Peer {donor} offers files that are not tensor files of one "
                              f"directory: {[excerpt(n, 80) for n in bad[:3]] or 'repeats'}.")
        total = sum(f.size for f in files)
        most = self.tensor_bytes + self.tensors * _PER_TENSOR + len(files) * _PER_FILE
        if len(files) > self.tensors + 1 or total > most:
            raise PeerRefused(f"Peer {donor} offers {len(files)} files of {total} bytes for "
                              f"version {offer.version}; {self.tensors} tensors of "
                              f"{self.tensor_bytes} bytes fit in {self.tensors + 1} files of "
                              f"at most {most}.")


class PeerClient:
    """One donor's routes, with the fleet's peer read token; no redirect is followed, and
    HTTPS peers are verified as every DCR client verifies them (:mod:`dcr.http.tls`)."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 60.0) -> None:
        self.url = check_peer_url(check_url(url, "A donor"), "A donor")
        self._token, self.timeout_s = token, timeout_s

    def __repr__(self) -> str:  # never the token
        return f"PeerClient({self.url!r})"

    def _request(self, method: str, path: str, body: bytes | None = None
                 ) -> urllib3.BaseHTTPResponse:
        try:
            resp = pooled_request(
                _POOL, method, self.url + path, body=body, preload_content=False, redirect=False,
                retries=False, timeout=urllib3.Timeout(connect=self.timeout_s,
                                                       read=self.timeout_s),
                headers={"Authorization": f"Bearer {self._token}",
                         "Content-Type": "application/json"})
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as e:
            raise PeerRefused(f"Peer {self.url} is unreachable: {unreachable_reason(e)}.") from e
        if resp.status != 200:
            said = read_bounded(resp, 4096) or b""
            resp.release_conn()
            raise PeerRefused(f"Peer {self.url} ({method} {path}) answered HTTP "
                              f"{resp.status}: {excerpt(said)}")
        return resp

    def lease(self, version: int) -> Offer:
        resp = self._request("POST", LEASE_PATH,
                             LeaseRequest(version=version).model_dump_json().encode())
        try:
            raw = read_bounded(resp, MAX_OFFER_BYTES)
        finally:
            resp.release_conn()
        if raw is None:
            raise PeerRefused(f"Peer {self.url}'s offer is over {MAX_OFFER_BYTES} bytes.")
        try:
            offer = Offer.model_validate_json(raw)
        except ValidationError as e:
            raise PeerRefused(f"Peer {self.url}'s offer is malformed "
                              f"({e.error_count()} errors).") from e
        if offer.api != PEER_API:
            raise PeerRefused(f"Peer {self.url} speaks donor API {offer.api}; this agent "
                              f"reads {PEER_API}.")
        return offer

    def fetch(self, lease: str, name: str, size: int, into: Path) -> None:
        """Write the file ``name`` of ``lease`` to ``into``, refused unless exactly
        ``size`` bytes come."""
        query = urllib.parse.urlencode({"lease": lease, "name": name})
        resp = self._request("GET", f"{FILE_PATH}?{query}")
        got = 0
        try:
            with open(into, "wb") as f:
                while chunk := resp.read(CHUNK):
                    got += len(chunk)
                    if got > size:
                        break
                    f.write(chunk)
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as e:
            raise PeerRefused(f"Peer {self.url}: {name} broke off after {got} bytes: "
                              f"{unreachable_reason(e)}.") from e
        finally:
            resp.close()
            resp.release_conn()
        if got != size:
            raise PeerRefused(f"Peer {self.url}: {name} came with "
                              f"{'more than ' if got > size else ''}{got} bytes; the lease "
                              f"named {size}.")

    def release(self, lease: str) -> None:
        try:
            self._request("POST", RELEASE_PATH,
                          LeaseRef(lease=lease).model_dump_json().encode()).release_conn()
        except PeerRefused as e:  # it lapses on its own
            log.info("%s", e)


def take(client: PeerClient, version: int, near: int, into: Path,
         bound: Callable[[int], Bound]) -> Fetched:
    """Fetch ``client``'s copy into the new directory ``into``: a version at most
    ``version`` and newer than ``near`` (what this pod holds), its offer within
    ``bound(its version)``. Raises :class:`PeerRefused`; ``into`` is removed then."""
    offer = client.lease(version)
    try:
        if not near < offer.version <= version:
            raise PeerRefused(f"Peer {client.url} holds version {offer.version}; this agent "
                              f"holds {near} and builds {version}.")
        bound(offer.version).check(offer, client.url)
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir(parents=True)
        for f in offer.files:
            client.fetch(offer.lease, f.name, f.size, into / f.name)
    except BaseException:
        shutil.rmtree(into, ignore_errors=True)
        raise
    finally:
        client.release(offer.lease)
    return Fetched(donor=client.url, version=offer.version, path=into,
                   bytes=sum(f.size for f in offer.files))
