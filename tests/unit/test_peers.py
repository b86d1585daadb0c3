"""Catch-up from a peer, in process: the donor's leases and the reader's bounds on an offer.

The whole path, with agent processes and a real S3 server, is
tests/integration/test_peer_catchup.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dcr.errors import Busy, ConfigError
from dcr.protocol.peer_api import LentFile, Offer
from dcr.receiver.donor import Leases, NotLent
from dcr.receiver.main import peer_token
from dcr.receiver.peers import Bound, PeerRefused
from dcr.receiver.settings import PEER_TOKEN_ENV, AgentSettings

pytestmark = pytest.mark.timeout(30)


def test_a_rebuild_waits_for_a_held_lease_and_lends_nothing_meanwhile() -> None:
    """Without the lease a rebuild starts at once, rewriting the copy being read."""
    leases = Leases(lease_s=600.0)
    lease = leases.take("the copy")
    entered = threading.Event()

    def rebuild() -> None:
        with leases.writing():
            entered.set()

    t = threading.Thread(target=rebuild)
    t.start()
    assert not entered.wait(0.3)  # held: the rebuild does not start
    with pytest.raises(NotLent, match="being rebuilt"):
        leases.take("the copy")
    leases.release(lease)
    t.join(10)
    assert entered.is_set()
    assert leases.take("the copy")  # lent again once whole


def test_a_lease_its_reader_forgot_lapses_and_the_rebuild_goes_on() -> None:
    leases = Leases(lease_s=0.05)
    lease = leases.take("the copy")
    with leases.writing():
        assert leases.held == 0
    assert not leases.renew(lease)


def test_a_donor_lends_to_a_bounded_number_of_readers() -> None:
    leases = Leases(max_leases=2)
    leases.take("the copy")
    leases.take("the copy")
    with pytest.raises(Busy, match="lent to 2 readers"):
        leases.take("the copy")


def offer(*files: tuple[str, int]) -> Offer:
    return Offer(lease="ab" * 16, version=3, lease_s=60.0,
                 files=tuple(LentFile(name=n, size=s) for n, s in files))


BOUND = Bound.of({"a": ("BF16", (1024,)), "b": ("F32", (256,))})  # 2048 + 1024 bytes


@pytest.mark.parametrize(("files", "says"), [
    ((("../model.safetensors", 10),), "not tensor files"),
    ((("config.json", 10),), "not tensor files"),
    ((("modeling_evil.py", 10),), "not tensor files"),
    ((("a.safetensors", 10), ("a.safetensors", 10)), "repeats"),
    ((("model.safetensors", 1 << 30),), "of at most"),
    (tuple((f"m{i}.safetensors", 1) for i in range(4)), "fit in 3 files"),
])
def test_an_offer_that_no_checkpoint_of_the_version_can_be_is_refused_before_fetching(
        files: tuple[tuple[str, int], ...], says: str) -> None:
    """Without the bounds the reader fetches what the offer names (``../``, code, GiBs)."""
    with pytest.raises(PeerRefused, match=says):
        BOUND.check(offer(*files), "http://peer")


def test_an_offer_a_checkpoint_can_be_passes() -> None:
    assert BOUND.tensor_bytes == 3072
    BOUND.check(offer(("model.safetensors", 3200)), "http://peer")


def settings(tmp_path: Path, **kw: object) -> AgentSettings:
    return AgentSettings(name="r0", state_dir=tmp_path, store="file:///s",
                         engine_url="http://127.0.0.1:1", staging_dir=tmp_path,
                         canonical=tmp_path, **kw)  # type: ignore[arg-type]


def test_donors_without_the_peer_read_token_are_refused_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEER_TOKEN_ENV, raising=False)
    assert peer_token(settings(tmp_path)) is None  # lends nothing, asks no peer
    with pytest.raises(ConfigError, match="--donor needs the peer read token"):
        peer_token(settings(tmp_path, donors=("http://10.0.0.7:8080",)))
    with pytest.raises(ConfigError, match="--donor: 'ftp://x' is not"):
        settings(tmp_path, donors=("ftp://x",))
    monkeypatch.setenv(PEER_TOKEN_ENV, "change-me-peer-token-0000")
    with pytest.raises(ConfigError, match="placeholder"):
        peer_token(settings(tmp_path, donors=("http://10.0.0.7:8080",)))
