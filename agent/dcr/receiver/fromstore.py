"""What an agent takes from its store's history: the fingerprints a version must have, the
versions it builds for dense loads, and the committed version ``/readyz`` compares with.

A build goes to ``dcr-from-store`` under the checkpoint root (the pod's own volume, which
the engine reads too): the last build advanced by the committed deltas (its version is
recorded there), else the seed (the checkpoint the engine started from) advanced, else a
snapshot and the deltas after it (:func:`~dcr.files.materialize.materialize`). Given
donors (``--donor``), a build first takes the newest copy a peer lends when it is nearer
than what this pod holds, judged by the history's fingerprints like any start, and goes
on to the next donor, then to the store, when one is refused (:mod:`dcr.receiver.peers`).
The build is lent to peers in turn (:mod:`dcr.receiver.donor`): it is rewritten only once
no lease is held. docs/catch-up.md, "The agent" and "From a peer".
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dcr.errors import CheckpointError, DcrError, ManifestError, StateConflict, StoreError
from dcr.files.history import HistoryStore
from dcr.files.materialize import Materialized, materialize, recorded_version, take_place
from dcr.files.mirror import Generation
from dcr.files.mirror import current as mirror_current
from dcr.files.vouched import copy_vouched
from dcr.format.history import AHEAD_VERSIONS
from dcr.receiver.donor import Leases
from dcr.receiver.peers import Bound, PeerClient, PeerRefused, take

log = logging.getLogger(__name__)

FROM_STORE = "dcr-from-store"  # under the checkpoint root: the version built from the store
FROM_PEER = ".dcr-from-peer"  # under the checkpoint root: a peer's copy until it is judged
HISTORY_TTL_S = 5.0  # how long committed() trusts its last reading


class NotVouched(StateConflict):
    """The store's history does not vouch for a version, or it cannot be built from it."""


@dataclass(eq=False)
class FromStore:
    """``seed``: a version and a checkpoint of it that this pod holds (the model the engine
    started from), where a first build may start instead of a snapshot; ``mirror``: a
    rollout-side mirror whose current generation a build starts from when it is newer
    than what the last build recorded."""

    history: HistoryStore
    root: Path | None  # the checkpoint root builds go under; None: nothing is built
    seed: tuple[int, Path] | None = None
    mirror: Path | None = None  # a rollout-side mirror (dcr mirror --dir)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one build at a time
    _refresh: threading.Lock = field(default_factory=threading.Lock)  # one read at a time
    _committed: tuple[float, int | None] | None = None  # when read, what
    told: int = 0  # the newest version a coordinator named to this agent
    peers: tuple[PeerClient, ...] = ()  # donors asked first, in this order
    leases: Leases = field(default_factory=Leases)  # peers reading the build
    peer_bytes: int = 0  # fetched from donors into builds that were used
    peer_refusals: int = 0  # donors' copies refused (or not lent)

    def vouch(self, digest: str | None, version: int | None = None,
              owners: int | None = None) -> None:
        """From now on read only the history ``digest`` names (the commit record's, as
        the coordinator gives it); None keeps the one given before. ``version``: the
        newest the caller named (with ``owners``, the most an attempt has, where it said):
        no history longer than one that names it and ``AHEAD_VERSIONS`` more is parsed."""
        if digest is not None and digest != self.history.digest:
            log.info("the store's history is now the one with digest %s", digest)
            self.history.digest = digest
        if version is not None:
            self.told = max(self.told, version)
            self.history.expect(self.told + AHEAD_VERSIONS, owners)

    def vouched(self, version: int) -> dict[str, str] | None:
        """Every tensor's fingerprint at ``version``, or None while the history names no
        version at all (nothing is committed yet). Raises :class:`NotVouched`."""
        try:
            history = self.history.read()
            if not history.versions:
                return None
            return self.history.fingerprints(history, version)
        except (ManifestError, StoreError) as e:
            raise NotVouched(f"the store's history does not vouch for version {version}: "
                             f"{e}") from e

    def build(self, version: int) -> tuple[str, Materialized]:
        """Build ``version`` under the root; the directory relative to it, and what the
        build fetched. Raises :class:`NotVouched`; a failed build is removed whole."""
        if self.root is None:
            raise NotVouched("no checkpoint root to build versions under")
        out = self.root / FROM_STORE
        held, seed = self.seed if self.seed is not None else (None, None)
        with self._lock, self.leases.writing():  # no peer reads the build while it changes
            gen, have = self._mirrored(), recorded_version(out)
            if gen is not None and (have if have is not None else -1) < gen.version <= version:
                held, seed = gen.version, gen.path  # nearer than what this pod holds
                shutil.rmtree(out, ignore_errors=True)
            near = max(v for v in (have, held, -1) if v is not None)
            done = self._from_peers(out, version, near) if near < version else None
            if done is not None:
                return FROM_STORE, done
            try:
                done = materialize(self.history.store, out, version=version, held=held,
                                   seed=seed, digest=self.history.digest,
                                   limits=self.history.limits)
            except DcrError as e:  # ManifestError, StoreError, CheckpointError, ...
                shutil.rmtree(out, ignore_errors=True)  # the next build starts over
                raise NotVouched(f"version {version} could not be built from the store: "
                                 f"{e}") from e
        log.info("built version %s from the store by %s from %s (%d deltas), fetching %d "
                 "bytes", version, done.plan.route, done.plan.start, done.plan.steps,
                 done.fetched_bytes)
        return FROM_STORE, done

    def _from_peers(self, out: Path, version: int, near: int) -> Materialized | None:
        """``version`` built in ``out`` from the first donor whose copy is newer than
        ``near`` and holds what the history vouches for (then advanced by the deltas
        after it); None when no donor's is (each refusal logged with the donor's URL)."""
        assert self.root is not None
        fresh = self.root / FROM_PEER
        for peer in self.peers:
            try:
                got = take(peer, version, near, fresh, self._bound)
                done = materialize(self.history.store, fresh, version=version,
                                   held=got.version, digest=self.history.digest,
                                   limits=self.history.limits)
            except (PeerRefused, DcrError) as e:
                self.peer_refusals += 1
                log.warning("the copy of peer %s is refused; the next donor or the store "
                            "is used: %s", peer.url, e)
                shutil.rmtree(fresh, ignore_errors=True)
                continue
            self._take_place(fresh, out)
            self.peer_bytes += got.bytes
            log.info("took version %s from peer %s (%d bytes) and advanced it to %s",
                     got.version, got.donor, got.bytes, version)
            return done
        return None

    def _bound(self, version: int) -> Bound:
        """What a checkpoint of ``version`` can hold, as the history says."""
        try:
            return Bound.of(self.history.layout(self.history.read(), version))
        except (ManifestError, StoreError) as e:
            raise PeerRefused(f"the history does not vouch for version {version}: "
                              f"{e}") from e

    def _take_place(self, fresh: Path, out: Path) -> None:
        """``fresh`` (a judged peer copy) becomes ``out``, with the seed's carried files
        (configs and tokenizer come only from this pod's own side)."""
        if self.seed is not None:
            copy_vouched(self.seed[1], fresh, tensors=False)
        take_place(fresh, out)

    def _mirrored(self) -> Generation | None:
        """The mirror's current generation; a broken mirror is passed over (the store and
        this pod's own copies remain), never a reason to fail."""
        if self.mirror is None:
            return None
        try:
            return mirror_current(self.mirror)
        except (CheckpointError, OSError) as e:
            log.warning("the mirror at %s is passed over: %s", self.mirror, e)
            return None

    def committed(self) -> int | None:
        """The newest version committed, as far as this agent can tell, or None while
        nothing is known: the history the coordinator vouched for (read once per digest)
        and the store's (which may be newer; fetched again only once it changed), looked
        at most every ``HISTORY_TTL_S`` by one caller at a time."""
        with self._refresh:  # concurrent /readyz calls wait for one reading
            now = time.monotonic()
            if self._committed is None or now - self._committed[0] >= HISTORY_TTL_S:
                self._committed = (now, self._newest())
            return self._committed[1]

    def _newest(self) -> int | None:
        seen: list[int] = []
        reads = (self.history.latest, self.history.read) if self.history.digest \
            else (self.history.latest,)
        for read in reads:
            try:
                history = read()
            except (ManifestError, StoreError) as e:
                log.warning("the store's history cannot be read: %s", e)
                continue
            if history.versions:
                seen.append(history.committed)
        return max(seen, default=None)
