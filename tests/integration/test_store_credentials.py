"""Receivers hold a read-only store key: against a real S3 gateway that enforces one.

The server is versitygw (:func:`s3server.scoped_s3_server`): the owners' key owns the
bucket, and the bucket's policy lets the receivers' key only get and list, as a read-only
IAM policy would on AWS (docs/operations.md, "A read-only key for receivers"). A refit's
receivers stage, apply and check with that key alone, and nothing they could try with it
writes. The deploy tier's rollout pods hold only that key, rejoins from the store included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from s3server import S3Server, scoped_s3_server
from transitions import reference_transition

from dcr.errors import StoreError
from dcr.transport.s3 import S3Settings, S3Store

pytestmark = [pytest.mark.e2e, pytest.mark.builds("versitygw")]

FAST = S3Settings(max_attempts=2, base_backoff=0.0, max_backoff=0.0, multipart_threshold=5 << 20,
                  part_size=5 << 20)


@pytest.fixture(scope="module")
def scoped(tmp_path_factory: pytest.TempPathFactory,
           progress: Callable[[str], None]) -> Iterator[S3Server]:
    with scoped_s3_server(tmp_path_factory.mktemp("scoped-s3"), progress=progress) as server:
        yield server


def _store(server: S3Server, prefix: str, *, read_only: bool) -> S3Store:
    key, secret = ((server.read_access_key, server.read_secret_key) if read_only
                   else (server.access_key, server.secret_key))
    assert key is not None
    assert secret is not None
    return S3Store(f"s3://{server.bucket}/{prefix}", FAST, endpoint=server.endpoint,
                   region=server.region,
                   credentials={"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret})


def _objects(server: S3Server, prefix: str) -> dict[str, bytes]:
    root = server.data_dir / server.bucket / prefix
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_receivers_key_reads_the_store_and_writes_nothing(scoped: S3Server) -> None:
    """A guard of the test server itself: with one key for everyone (``rclone serve s3``,
    the transport tests' server) the put below succeeds, and nothing shows a receiver's
    key to be read-only. Here every write the receivers' key tries is refused by the
    server, naming the operation and AccessDenied, and the bucket is unchanged."""
    owner, reader = (_store(scoped, "ro", read_only=ro) for ro in (False, True))
    big = bytes(range(256)) * (24 << 12)  # 6 MiB: a multipart upload for the writer
    owner.put("v0000000001/manifest.dcrm", b"the manifest")
    owner.put("v0000000001/a-1/o0000-s000000.dcrp", big)
    before = _objects(scoped, "ro")
    assert reader.get("v0000000001/manifest.dcrm") == b"the manifest"
    assert reader.get("v0000000001/a-1/o0000-s000000.dcrp") == big
    assert reader.exists("v0000000001/manifest.dcrm")
    assert sorted(reader.list("v0000000001/")) == ["v0000000001/a-1/o0000-s000000.dcrp",
                                                    "v0000000001/manifest.dcrm"]
    writes: list[tuple[str, Callable[[], object]]] = [
        ("PUT", lambda: reader.put("v0000000001/manifest.dcrm", b"chosen weights")),
        ("PUT", lambda: reader.put_if_absent("v0000000002/manifest.dcrm", b"chosen")),
        ("CreateMultipartUpload",
         lambda: reader.put("v0000000002/a-2/o0000-s000000.dcrp", big)),
        ("DELETE", lambda: reader.delete("v0000000001/manifest.dcrm")),
    ]
    for op, write in writes:
        with pytest.raises(StoreError, match="AccessDenied") as e:
            write()
        assert op in str(e.value)
        assert scoped.read_secret_key not in str(e.value)
    assert _objects(scoped, "ro") == before
    owner.close()
    reader.close()


def test_agents_holding_only_the_read_key_refit_bit_exact(scoped: S3Server,
                                                          tmp_path: Path) -> None:
    """A refit whose owner publishes with the owners' key and whose two receivers (TP 2
    ranks of the vLLM-layout reference model) stage, apply and check with the read key
    only: it commits, and every rank holds the bits of a dense load."""
    from dcr.owner.encoder import Encoder
    from dcr.protocol.commitstore import SqliteCommitStore
    from dcr.protocol.coordinator import Coordinator
    from dcr.protocol.records import CommitRecord

    t = reference_transition()
    stores = [_store(scoped, "refit", read_only=True) for _ in range(2)]
    models, receivers = t.receivers(tmp_path, stores)
    owner_store = _store(scoped, "refit", read_only=False)
    owner = Encoder(store=owner_store, baseline=t.bits(t.old), version=0)
    owner.set_candidate(t.bits(t.new), 1)
    coord = Coordinator(SqliteCommitStore(tmp_path / "c.db", CommitRecord(
        committed_version=0, baseline_id="v0", attempt="")), [owner], receivers)
    record = coord.refit(1, "v1")
    coord.close()
    assert [(h.mode, h.outcome) for h in coord.history] == [("mixed", "committed")]
    assert record.committed_version == 1
    assert all(t.exact(model, 2, r) for r, model in enumerate(models))
    for store in (*stores, owner_store):
        store.close()
