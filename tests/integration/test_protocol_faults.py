"""The refit protocol's fault-injection matrix over in-process parties (docs/failures.md).

Every scenario runs a real fleet: three receivers (two vLLM-layout TP ranks of the
reference runtime and a transformers ``LlamaForCausalLM``), each an ``AgentService``
with its own journal (a ``ReceiverHandle`` itself) driving an in-process engine
(``LocalDriver``: ``dcr serve``'s workers, DCR's plugin in the rank, a staging
directory of its own) that holds its model, behind handles that can die and restart;
two in-process ``Encoder`` owners splitting the tensors (multi-owner manifests); a
SQLite commit record. Faults are injected only at our own seams: a ``Store`` wrapper
around ``MemoryStore`` (payload and store faults), ``Source`` wrappers (delivery
faults), receiver handles that die and restart, and commit-store or owner wrappers
that raise a ``BaseException`` where a coordinator process would die.

Every scenario ends with the same three checks (``Fleet.assert_committed``):

1. every live receiver's parameters and buffers equal, on integer views, a fresh
   runtime of the same kind loaded densely with the target through the same loader;
2. the commit record names the target version, its baseline id and the attempt that
   committed, and every receiver that attempt required holds that version;
3. every owner's baseline is the target's, and every baseline advance happened with
   the stored commit record in hand (``AuditedOwner``); every compare-and-set found
   each required receiver flushed on the attempt it names (``AuditedCommits``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dcr.apply.applier import BITS, Loader
from dcr.apply.plan import CanonicalTensor
from dcr.checkpoint import ArrayCheckpoint, Checkpoint
from dcr.drivers import ApplyOutcome, EngineError
from dcr.drivers.base import staged_name
from dcr.errors import BaselineError, StoreError
from dcr.format.layout import parse_payload_key, payload_key
from dcr.format.manifest import Manifest
from dcr.format.profile import ReceiverProfile, merge
from dcr.owner.encoder import Encoder
from dcr.owner.process import ProcessOwner
from dcr.protocol.agent_api import AgentError, AgentStatus, AttemptSpec, FlushAck
from dcr.protocol.commitstore import CommitStore, SqliteCommitStore
from dcr.protocol.coordinator import (
    CommitUnknown,
    Coordinator,
    CoordinatorSettings,
    OwnerHandle,
    RefitFailed,
)
from dcr.protocol.records import Attempt, CommitOutcome, CommitRecord, Transition
from dcr.receiver.journal import Journal
from dcr.receiver.service import AgentService
from dcr.runtimes.hf import HFRuntime
from dcr.runtimes.loader import VllmRuntime
from dcr.runtimes.vllm_reference import ReferenceConfig, ReferenceModel, random_checkpoint
from dcr.runtimes.weights import checkpoint_tensors
from dcr.serve.local import LocalDriver
from dcr.transport.receive import PayloadId, Source, StoreSource
from dcr.transport.store import MemoryStore

pytestmark = pytest.mark.timeout(120)

# About 2 MiB in BF16: with 1 MiB buckets (``small_buckets``) owner 0 of 2 streams two
# payloads, which reordering and mid-stream kills need.
CFG = ReferenceConfig(vocab_size=2048, hidden_size=128, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
KINDS = ("vllm-0", "vllm-1", "hf")  # receiver names are their kinds
OWNERS = 2
V0 = CommitRecord(committed_version=0, baseline_id="ckpt-0", attempt="")
SETTINGS = CoordinatorSettings(attempt_timeout_s=30.0)
Gate = Literal["sync", "async"]


class CoordinatorKilled(BaseException):
    """Stands for the coordinator's process dying here: no ``except Exception`` stops it."""


class EncoderKilled(Exception):
    """An owner died mid-stream; the coordinator sees its publish fail."""


# --- versions, runtimes, oracles ---------------------------------------------------


def _int_views(runtime: Loader) -> dict[str, torch.Tensor]:
    """Integer views (copies) of every parameter and buffer the runtime names."""
    out = {}
    for name, t in runtime.named_tensors():
        flat = t.detach().contiguous().reshape(-1)
        out[name] = flat.view(BITS[flat.element_size()]).clone()
    return out


def build_runtime(kind: str) -> HFRuntime | VllmRuntime:
    if kind == "hf":
        torch.manual_seed(1234)  # the receiver's init never matters: a dense load follows
        config = LlamaConfig(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size,
                             intermediate_size=CFG.intermediate_size,
                             num_hidden_layers=CFG.num_layers, num_attention_heads=CFG.num_heads,
                             num_key_value_heads=CFG.num_kv_heads, tie_word_embeddings=False)
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        return HFRuntime(model)
    return VllmRuntime(ReferenceModel(CFG, tp_size=2, tp_rank=int(kind[-1])))


@dataclass(eq=False)
class Versions:
    """Versions 0..2 of one model: canonical tensors, checkpoints on disk, dense oracles."""

    root: Path
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    _sources: dict[int, ArrayCheckpoint] = field(default_factory=dict)
    _dense: dict[tuple[str, int], dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        state = random_checkpoint(CFG, 0)
        for v in range(3):
            if v:
                gen = torch.Generator().manual_seed(v)
                state = {n: (t.float() + 1e-2 * torch.randn(t.shape, generator=gen))
                         .to(torch.bfloat16) for n, t in state.items()}
            self.states[v] = state
            self.dir(v).mkdir(parents=True)
            save_file(state, str(self.dir(v) / "model.safetensors"))

    def dir(self, v: int) -> Path:
        return self.root / f"v{v}"

    def checkpoint(self, v: int) -> str:
        """The coordinator's ``dense_checkpoint`` callback."""
        return str(self.dir(v))

    def source(self, v: int) -> ArrayCheckpoint:
        """The trainer's export of version ``v`` (the same object every time)."""
        if v not in self._sources:
            self._sources[v] = ArrayCheckpoint({
                n: ("BF16", tuple(t.shape), t.view(torch.int16).numpy().view(np.uint16))
                for n, t in self.states[v].items()})
        return self._sources[v]

    def dense(self, kind: str, v: int) -> dict[str, torch.Tensor]:
        """A fresh runtime of ``kind`` after a dense load of ``v`` (the oracle)."""
        if (kind, v) not in self._dense:
            runtime = build_runtime(kind)
            with Checkpoint(self.dir(v)) as ckpt:
                runtime.load_weights(checkpoint_tensors(ckpt).items())
            self._dense[kind, v] = _int_views(runtime)
        return self._dense[kind, v]


def canonical() -> list[CanonicalTensor]:
    return [CanonicalTensor(name=n, dtype="BF16", shape=tuple(t.shape))
            for n, t in random_checkpoint(CFG, 0).items()]


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Versions:
    return Versions(tmp_path_factory.mktemp("versions"))


# --- the object store with scripted faults -----------------------------------------

Fault = Callable[[str, bytes], bytes]  # (key, bytes) -> bytes to store or return; may raise
def is_payload(key: str, owner: int | None = None, seq: int | None = None) -> bool:
    k = parse_payload_key(key)
    return k is not None and owner in (None, k.owner) and seq in (None, k.seq)


def attempt_of(key: str) -> str:
    k = parse_payload_key(key)
    assert k is not None, key
    return k.attempt


class FaultyStore:
    """A ``MemoryStore`` whose puts and gets pass through scripted faults, logged in order."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.uri = "memory://faulty"
        self.on_put: list[Fault] = []
        self.on_get: list[Fault] = []
        self.puts: list[str] = []
        self.gets: list[str] = []
        self.cond = threading.Condition()

    def put(self, key: str, data: bytes) -> None:
        for fault in self.on_put:
            data = fault(key, data)
        with self.cond:  # logged before it is visible: a reader never finds it unlogged
            self.puts.append(key)
            self.inner.put(key, data)
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        with self.cond:
            self.gets.append(key)
            self.cond.notify_all()
        for fault in self.on_get:
            data = fault(key, data)
        return data

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def wait_gets(self, key: str, times: int, timeout_s: float = 10.0) -> int:
        """Wait until ``key`` was fetched ``times`` times; return how often it was."""
        with self.cond:
            self.cond.wait_for(lambda: self.gets.count(key) >= times, timeout_s)
            return self.gets.count(key)


def once(match: Callable[[str], bool], act: Fault) -> Fault:
    """A fault that acts on the first key ``match`` accepts, then never again."""
    fired = threading.Lock()

    def fault(key: str, data: bytes) -> bytes:
        if match(key) and fired.acquire(blocking=False):
            return act(key, data)
        return data
    return fault


def corrupt(_: str, data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x5A  # one byte of the body: the digest must catch it
    return bytes(damaged)


def truncate(_: str, data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def fail(key: str, _: bytes) -> bytes:
    raise StoreError(f"Injected store error on {key!r}.")


# --- receivers that can die and restart ----------------------------------------------


class Rank:
    """One receiver: an ``AgentService`` over its engine, as a ``ReceiverHandle``.

    The engine (a ``LocalDriver`` holding the rank's model, loaded densely with v0) lives
    as long as the rank; the agent can die and restart beside it, as a sidecar does.
    ``kill_after_applies(n)`` kills the agent right after its ``n``-th payload apply:
    from then on every call fails as an unreachable agent's would, and its journal stays
    as it was at that instant. ``restart()`` is what a restarted ``dcr agent`` does: a
    fresh service over the same engine and journal. With ``restart_on_status`` a dead
    rank restarts when the coordinator next asks for its status.
    """

    def __init__(self, kind: str, versions: Versions, store: FaultyStore, tmp: Path) -> None:
        self.kind = self.name = kind
        self.versions = versions
        self.store = store
        self.journal = Journal(tmp / kind / "journal.json")
        self.staging = tmp / kind / "staging"
        self.engine = LocalDriver([build_runtime(kind).model], staging_dir=self.staging,
                                  checkpoint_root=versions.root)
        self.engine.load_dense("v0")
        self.wrap: Callable[[Source], Source] = lambda s: s  # a delivery-fault seam
        self.restart_on_status = False
        self.dead = False
        self._journal_at_death: bytes | None = None
        self.start()

    def start(self) -> None:
        self.service = AgentService(self.name, self.engine, self._source,
                                    canonical=canonical(), staging_dir=self.staging,
                                    version=0, journal=self.journal,
                                    checkpoint_root=self.versions.root)
        self.dead = False

    def _source(self, spec: AttemptSpec) -> Source:
        return self.wrap(StoreSource(store=self.store, version=spec.target_version,
                                     attempt=spec.attempt, owners=spec.owners))

    def kill_after_applies(self, n: int) -> None:
        real = self.engine.apply
        count = 0

        def dying(payloads: Sequence[str]) -> ApplyOutcome:
            nonlocal count
            outcome = real(payloads)
            count += 1
            if count == n:
                self._journal_at_death = self.journal.path.read_bytes()
                self.dead = True
                self.engine.apply = real  # type: ignore[method-assign]
                raise RuntimeError(f"{self.name} killed after {n} payload applies")
            return outcome

        self.engine.apply = dying  # type: ignore[method-assign]

    def restart(self) -> None:
        """Bury the dead service (end its threads), restore its journal, start afresh."""
        old = self.service
        attempt = old.snapshot().attempt
        if attempt is not None:
            old.stop_and_wait(attempt)
        assert self._journal_at_death is not None, f"{self.name} was never killed"
        self.journal.path.write_bytes(self._journal_at_death)
        self.start()

    def _live(self) -> AgentService:
        if self.dead:
            raise AgentError(f"Agent {self.name} is unreachable (killed).")
        return self.service

    def bits(self) -> dict[str, torch.Tensor]:
        assert not self.dead, f"{self.name} is dead"
        return _int_views(self.engine.runtimes[0])

    # ReceiverHandle
    def status(self) -> AgentStatus:
        if self.dead and self.restart_on_status:
            self.restart()
        return self._live().status()

    def prepare(self, attempt: Attempt) -> AgentStatus:
        return self._live().prepare(attempt)

    def close_gate(self) -> AgentStatus:
        return self._live().close_gate()

    def open_apply(self, attempt: Attempt) -> AgentStatus:
        return self._live().open_apply(attempt)

    def wait_staged(self, attempt: Attempt) -> AgentStatus:
        return self._live().wait_staged(attempt)

    def flush(self, attempt: Attempt) -> FlushAck:
        return self._live().flush(attempt)

    def committed(self, attempt: str, history_digest: str | None = None) -> AgentStatus:
        return self._live().committed(attempt, history_digest)

    def stop_and_wait(self, attempt: str) -> AgentStatus:
        return self._live().stop_and_wait(attempt)

    def open_gate(self) -> AgentStatus:
        return self._live().open_gate()

    def rejoin(self, version: int, checkpoint: str | None = None,
               history_digest: str | None = None) -> AgentStatus:
        return self._live().rejoin(version, checkpoint, history_digest)


# --- audits of the two protocol invariants -------------------------------------------


class AuditedCommits:
    """The commit record; at each compare-and-set, checks that every receiver the named
    attempt requires has flushed it (a record never names bits a required receiver lacks)."""

    def __init__(self, inner: CommitStore, ranks: Callable[[], Sequence[Rank]]) -> None:
        self.inner = inner
        self.ranks = ranks
        self.coordinators: list[Coordinator] = []
        self.violations: list[str] = []
        self.written: list[CommitRecord] = []

    def required(self, attempt: str) -> tuple[str, ...]:
        for c in self.coordinators:
            for h in c.history:
                if h.attempt == attempt:
                    return h.receivers
        raise AssertionError(f"no coordinator ran attempt {attempt}")

    def read(self) -> CommitRecord:
        return self.inner.read()

    def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome:
        required = self.required(new.attempt)
        by_name = {r.name: r for r in self.ranks()}
        for name in required:
            try:
                st = by_name[name].status()
            except AgentError as e:
                self.violations.append(f"{name} unreachable at the commit of {new}: {e}")
                continue
            if (st.attempt, st.state) != (new.attempt, "flushed"):
                self.violations.append(f"{name} is {st.attempt} {st.state} at the commit of {new}")
        outcome = self.inner.compare_and_set(expected, new)
        if outcome is CommitOutcome.SUCCESS:
            self.written.append(new)
        return outcome


class AuditedOwner:
    """An owner that records any baseline advance the stored commit record does not name."""

    def __init__(self, inner: OwnerHandle, commits: CommitStore) -> None:
        self.inner = inner
        self.commits = commits
        self.violations: list[str] = []
        self.advanced: list[CommitRecord] = []

    def publish(self, attempt: Attempt) -> None:
        self.inner.publish(attempt)

    def advance_baseline(self, record: CommitRecord) -> None:
        stored = self.commits.read()
        if stored != record:
            self.violations.append(f"advance to {record} while the record is {stored}")
        self.inner.advance_baseline(record)
        self.advanced.append(record)


# --- the fleet -------------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class Fleet:
    versions: Versions
    store: FaultyStore
    ranks: list[Rank]
    encoders: list[Encoder]
    owners: list[AuditedOwner]
    commits: AuditedCommits

    def coordinator(self, *, commits: CommitStore | None = None,
                    owners: Sequence[OwnerHandle] | None = None,
                    settings: CoordinatorSettings = SETTINGS,
                    wait: Callable[[float], bool] | None = None) -> Coordinator:
        c = Coordinator(commits or self.commits, owners or self.owners, self.ranks,
                        settings=settings, dense_checkpoint=self.versions.checkpoint,
                        wait=wait)
        self.commits.coordinators.append(c)
        return c

    def candidate(self, v: int) -> None:
        for e in self.encoders:
            e.set_candidate(self.versions.source(v), v)

    def rank(self, name: str) -> Rank:
        return next(r for r in self.ranks if r.name == name)

    def assert_committed(self, record: CommitRecord, version: int,
                         coordinator: Coordinator | None = None) -> None:
        stored = self.commits.read()
        assert record == stored
        assert (stored.committed_version, stored.baseline_id) == (version, f"ckpt-{version}")
        if coordinator is not None and coordinator.history:
            last = coordinator.history[-1]
            assert (last.attempt, last.outcome) == (stored.attempt, "committed")
        required = self.commits.required(stored.attempt)
        live = [r for r in self.ranks if not r.dead]
        assert set(required) <= {r.name for r in live}
        for r in live:
            want, got = self.versions.dense(r.kind, version), r.bits()
            assert got.keys() == want.keys()
            differ = [n for n in want if not torch.equal(got[n], want[n])]
            assert differ == [], f"{r.name} differs from a dense load of v{version}: {differ[:4]}"
            st = r.status()
            assert (st.version, st.dirty, st.unknown, st.gate_open) == (version, None, None, True)
        for e in self.encoders:
            assert e.version == version
            assert e.baseline is self.versions.source(version)
            assert e.candidate is None
        assert self.commits.violations == []
        for o in self.owners:
            assert o.violations == []
            assert o.advanced[-1:] == [stored]


def make_fleet(tmp_path: Path, versions: Versions) -> Fleet:
    store = FaultyStore()
    ranks = [Rank(kind, versions, store, tmp_path) for kind in KINDS]
    profile = merge(ReceiverProfile.model_validate(r.service.profile()) for r in ranks)
    encoders = [Encoder(store=store, baseline=versions.source(0), version=0, owner=k,
                        owners=OWNERS, profile=profile, bucket_bytes=1 << 20)  # several each
                for k in range(OWNERS)]
    commits = AuditedCommits(SqliteCommitStore(tmp_path / "commit.db", V0), lambda: ranks)
    fleet = Fleet(versions=versions, store=store, ranks=ranks, encoders=encoders,
                  owners=[AuditedOwner(e, commits) for e in encoders], commits=commits)
    fleet.candidate(1)
    for r in ranks:  # the oracle is not vacuous: v0 held exactly, v1 differs almost everywhere
        got = r.bits()
        assert all(torch.equal(got[n], t) for n, t in versions.dense(r.kind, 0).items())
        differ = [n for n, t in versions.dense(r.kind, 1).items() if not torch.equal(got[n], t)]
        assert len(differ) >= len(got) - 1, f"{r.name}: v0 and v1 differ only in {differ}"
    return fleet


@pytest.fixture
def fleet(tmp_path: Path, versions: Versions) -> Iterator[Fleet]:
    f = make_fleet(tmp_path, versions)
    yield f
    for c in f.commits.coordinators:
        c.close()
    for r in f.ranks:  # end receive threads of attempts a fault left running
        if not r.dead and (st := r.service.status()).attempt is not None:
            r.service.stop_and_wait(st.attempt)


def outcomes(c: Coordinator) -> list[tuple[str, str]]:
    return [(h.mode, h.outcome.split(":")[0]) for h in c.history]


# --- receivers killed and restarted --------------------------------------------------


def test_a_receiver_killed_mid_apply_is_left_out_and_rejoins_the_next_refit_by_dense_load(
        fleet: Fleet) -> None:
    victim = fleet.rank("hf")
    victim.kill_after_applies(1)
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert c.history[1].receivers == ("vllm-0", "vllm-1")  # the dead one is not required
    fleet.assert_committed(record, 1, c)

    victim.restart()  # the journal says it was applying: its version is unknown
    st = victim.status()
    assert st.version is None
    assert st.unknown is not None
    assert f"attempt {c.history[0].attempt} was applying" in st.unknown
    victim.start()  # restarted again before any rejoin: still unknown, not --model-version
    st = victim.status()
    assert (st.version, st.unknown) == (None, "restarted while the version was unknown")

    fleet.candidate(2)
    c2 = fleet.coordinator()
    record = c2.refit(2, "ckpt-2")
    assert outcomes(c2) == [("mixed", "committed")]
    assert c2.history[0].rejoined == ("hf",)
    assert victim.service.counters.dense_loads == 1
    fleet.assert_committed(record, 2, c2)


def test_an_agent_restarted_between_attempts_reports_unknown_and_rejoins_the_same_refit(
        fleet: Fleet) -> None:
    victim = fleet.rank("vllm-1")
    victim.kill_after_applies(1)
    victim.restart_on_status = True  # back before the retry's admission
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert c.history[1].rejoined == ("vllm-1",)  # a dense load of v0 first, then overwrite
    assert c.history[1].receivers == KINDS
    assert victim.service.counters.dense_loads == 1
    fleet.assert_committed(record, 1, c)


# --- owners killed; payload and store faults -------------------------------------------


@pytest.mark.parametrize("gate", ["sync", "async"])
def test_an_encoder_killed_mid_stream_fails_the_attempt_and_the_overwrite_retry_commits(
        fleet: Fleet, gate: Gate) -> None:
    s0_keys: list[str] = []

    def killed(key: str, _: bytes) -> bytes:
        # Owner 0 dies writing its second payload, once every receiver has its first.
        s0 = payload_key(1, attempt_of(key), 0, 0)
        s0_keys.append(s0)
        fleet.store.wait_gets(s0, len(KINDS))
        raise EncoderKilled(f"owner 0 killed before {key}")

    fleet.store.on_put.append(once(lambda k: is_payload(k, owner=0, seq=1), killed))
    c = fleet.coordinator(settings=CoordinatorSettings(gate=gate, attempt_timeout_s=30.0))
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert "owner 0 killed" in c.history[0].outcome
    assert fleet.store.gets.count(s0_keys[0]) == len(KINDS)  # mid-stream: s0 had arrived
    fleet.assert_committed(record, 1, c)


@pytest.mark.parametrize(("where", "fault", "reason"), [
    ("put", corrupt, "digest mismatch"),
    ("put", truncate, "preamble declares"),
    ("put", fail, "Injected store error"),
    ("get", fail, "Injected store error"),
], ids=["corrupted-payload", "truncated-payload", "store-put-fails", "store-get-fails"])
@pytest.mark.parametrize("gate", ["sync", "async"])
def test_a_one_time_fault_fails_the_first_attempt_and_the_overwrite_retry_commits(
        fleet: Fleet, where: str, fault: Fault, reason: str, gate: Gate) -> None:
    faults = fleet.store.on_put if where == "put" else fleet.store.on_get
    faults.append(once(is_payload, fault))
    c = fleet.coordinator(settings=CoordinatorSettings(gate=gate, attempt_timeout_s=30.0))
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert reason in c.history[0].outcome
    fleet.assert_committed(record, 1, c)


def test_a_store_down_for_seconds_is_outlasted_by_the_waits_between_attempts(
        fleet: Fleet) -> None:
    """Fails on a coordinator that retries at once: every attempt meets the outage
    (RefitFailed after four). The waits are counted on a clock only they move."""
    clock = [0.0]

    def down(key: str, data: bytes) -> bytes:
        if is_payload(key) and clock[0] < 4.0:
            raise StoreError(f"Injected outage at t={clock[0]:.1f} s on {key!r}.")
        return data

    def wait(seconds: float) -> bool:
        clock[0] += seconds
        return False

    fleet.store.on_put.append(down)
    c = fleet.coordinator(wait=wait)
    record = c.refit(1, "ckpt-1")
    assert [o for _, o in outcomes(c)][-1] == "committed"
    assert len(c.history) == 3  # waits of 1.5-2 s and 3-4 s pass the 4 s outage
    fleet.assert_committed(record, 1, c)


@dataclass(frozen=True, kw_only=True)
class Duplicating:
    """Announces every payload twice, and keeps announcing those already delivered."""

    inner: Source

    def available(self) -> list[PayloadId]:
        ids = self.inner.available()
        return ids + ids[::-1]

    def fetch(self, pid: PayloadId) -> bytes:
        return self.inner.fetch(pid)

    def manifest(self) -> Manifest | None:
        return self.inner.manifest()


def test_duplicated_payloads_are_applied_once_and_the_first_attempt_commits(
        fleet: Fleet) -> None:
    def twice(key: str, data: bytes) -> bytes:
        if is_payload(key):
            fleet.store.inner.put(key, data)  # an owner retrying a put that had landed
        return data

    fleet.store.on_put.append(twice)
    for r in fleet.ranks:
        r.wrap = lambda s: Duplicating(inner=s)
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "committed")]  # XOR masks, each applied exactly once
    payloads = [e.key for enc in fleet.encoders for e in enc.manifests[-1].payloads]
    assert len(payloads) >= 3
    for r in fleet.ranks:
        assert r.service.counters.payloads_applied == len(payloads)
    fleet.assert_committed(record, 1, c)

    again = fleet.store.inner.get(payloads[0])  # a duplicate past the transport
    key = parse_payload_key(payloads[0])
    assert key is not None
    rank = fleet.rank("vllm-0")
    name = staged_name(key.attempt, key.owner, key.seq)
    (rank.staging / name).write_bytes(again)
    with pytest.raises(EngineError, match=r"DuplicatePayload: .*already applied"):
        rank.engine.apply([name])
    fleet.assert_committed(record, 1, c)


def test_a_payload_replayed_from_an_old_attempt_is_rejected_and_a_later_attempt_commits(
        fleet: Fleet) -> None:
    store = fleet.store
    store.on_put.append(once(lambda k: k.endswith("manifest-o0000.dcrm"), fail))

    def first_s0() -> str:  # owner 0's payload 0 of the first attempt
        return next(k for k in store.puts if is_payload(k, owner=0, seq=0))

    def replay(key: str, data: bytes) -> bytes:
        return store.inner.get(first_s0())  # attempt 1's XOR payload, served for a later one

    store.on_get.append(once(lambda k: is_payload(k, owner=0, seq=0)
                             and attempt_of(k) != attempt_of(first_s0()), replay))
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "failed"),
                           ("overwrite", "committed")]
    assert attempt_of(first_s0()) == c.history[0].attempt
    assert f"says attempt {c.history[0].attempt}" in c.history[1].outcome
    fleet.assert_committed(record, 1, c)


class Reordering(FaultyStore):
    """Keeps owner 0's payload 0 out of sight until every receiver has fetched payload 1."""

    def __init__(self, receivers: int) -> None:
        super().__init__()
        self.receivers = receivers
        self.held: dict[str, bytes] = {}
        self.fetched_first: list[int] = []  # how often payload 1 was fetched at release
        self.releaser: threading.Thread | None = None
        self.s1: str | None = None
        self.lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        # An owner puts several payloads at once, so payload 1 may land before payload 0.
        if is_payload(key, owner=0, seq=0) and not self.fetched_first:
            self.held[key] = data
        else:
            super().put(key, data)
            if is_payload(key, owner=0, seq=1):
                self.s1 = key
        with self.lock:
            if self.held and self.s1 is not None and self.releaser is None:
                self.releaser = threading.Thread(target=self._release, args=(self.s1,))
                self.releaser.start()

    def _release(self, s1: str) -> None:
        self.fetched_first.append(self.wait_gets(s1, self.receivers))
        for key, data in self.held.items():
            super().put(key, data)
        self.held.clear()


def test_reordered_payloads_are_applied_in_sequence_and_the_first_attempt_commits(
        fleet: Fleet) -> None:
    store = Reordering(len(KINDS))
    for r in fleet.ranks:
        r.store = store
    for e in fleet.encoders:
        e.store = store
    fleet.store = store
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    assert store.releaser is not None
    store.releaser.join()
    assert outcomes(c) == [("mixed", "committed")]
    assert store.fetched_first == [len(KINDS)]  # seq 1 reached every receiver before seq 0
    s0 = next(k for k in store.gets if is_payload(k, owner=0, seq=0))
    s1 = next(k for k in store.gets if is_payload(k, owner=0, seq=1))
    assert store.gets.index(s1) < store.gets.index(s0)
    fleet.assert_committed(record, 1, c)


def test_a_receiver_that_can_never_read_fails_the_refit_without_moving_record_or_baselines(
        fleet: Fleet) -> None:
    @dataclass(frozen=True, kw_only=True)
    class Unreadable:
        inner: Source

        def available(self) -> list[PayloadId]:
            return self.inner.available()

        def fetch(self, pid: PayloadId) -> bytes:
            raise StoreError(f"Injected: payload {pid} cannot be read here.")

        def manifest(self) -> Manifest | None:
            return self.inner.manifest()

    victim = fleet.rank("hf")
    victim.wrap = lambda s: Unreadable(inner=s)
    c = fleet.coordinator(settings=CoordinatorSettings(max_attempts=2,
                                                       attempt_timeout_s=30.0))
    with pytest.raises(RefitFailed, match="failed 2 attempts"):
        c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "failed")]
    assert fleet.commits.read() == V0
    assert fleet.commits.written == []
    for e, o in zip(fleet.encoders, fleet.owners, strict=True):
        assert (e.version, e.baseline, o.advanced) == (0, fleet.versions.source(0), [])
    for r in fleet.ranks:  # nothing serves a mix of versions meanwhile
        st = r.status()
        assert (st.version, st.dirty, st.gate_open) == (None, (0, 1), False)

    victim.wrap = lambda s: s  # healed: the next refit repairs by overwrite and commits
    c2 = fleet.coordinator()
    record = c2.refit(1, "ckpt-1")
    assert outcomes(c2) == [("overwrite", "committed")]
    fleet.assert_committed(record, 1, c2)


# --- the coordinator killed, and commit outcomes -------------------------------------


class KillAtCommit:
    """A commit store whose coordinator dies just before, or just after, the write."""

    def __init__(self, inner: CommitStore, *, after_write: bool) -> None:
        self.inner = inner
        self.after_write = after_write

    def read(self) -> CommitRecord:
        return self.inner.read()

    def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome:
        if not self.after_write:
            raise CoordinatorKilled("between flush and commit")
        self.inner.compare_and_set(expected, new)
        raise CoordinatorKilled("between commit and baseline update")


class DiesOnAdvance:
    """An owner whose coordinator dies while telling it to advance."""

    def __init__(self, inner: OwnerHandle) -> None:
        self.inner = inner

    def publish(self, attempt: Attempt) -> None:
        self.inner.publish(attempt)

    def advance_baseline(self, record: CommitRecord) -> None:
        raise CoordinatorKilled("between the owners' baseline updates")


def test_a_coordinator_killed_between_flush_and_commit_is_resumed_in_overwrite_mode(
        fleet: Fleet) -> None:
    old = fleet.coordinator(commits=KillAtCommit(fleet.commits, after_write=False))
    with pytest.raises(CoordinatorKilled):
        old.refit(1, "ckpt-1")
    old.close()
    flushed = old.history[0].attempt
    assert fleet.commits.read() == V0
    for r in fleet.ranks:
        st = r.status()
        assert (st.attempt, st.state, st.gate_open) == (flushed, "flushed", False)
    assert [e.version for e in fleet.encoders] == [0, 0]

    new = fleet.coordinator()
    record = new.refit(1, "ckpt-1")
    assert outcomes(new) == [("overwrite", "committed")]
    assert record.attempt != flushed
    for r in fleet.ranks:  # the flushed attempt was stopped, never committed
        assert r.service.counters.attempts == {"obsolete": 1, "committed": 1}
    fleet.assert_committed(record, 1, new)


@pytest.mark.parametrize("kill", ["after-the-record-moved", "between-two-owners"])
def test_a_coordinator_killed_after_the_commit_is_finished_by_the_next_one(
        fleet: Fleet, kill: str) -> None:
    # Receivers learn the commit (and serve) before owners advance, so a coordinator that
    # dies between two owners has settled every receiver already.
    if kill == "after-the-record-moved":
        old = fleet.coordinator(commits=KillAtCommit(fleet.commits, after_write=True))
        advanced, settled = [0, 0], ("flushed", False)
    else:
        old = fleet.coordinator(owners=[fleet.owners[0], DiesOnAdvance(fleet.owners[1])])
        advanced, settled = [1, 0], ("committed", True)
    with pytest.raises(CoordinatorKilled):
        old.refit(1, "ckpt-1")
    old.close()
    attempt = old.history[0].attempt
    assert fleet.commits.read() == CommitRecord(committed_version=1, baseline_id="ckpt-1",
                                                attempt=attempt)
    assert [e.version for e in fleet.encoders] == advanced
    for r in fleet.ranks:
        st = r.status()
        assert (st.attempt, st.state, st.gate_open) == (attempt, *settled)

    new = fleet.coordinator()
    record = new.refit(1, "ckpt-1")
    assert new.history == []  # nothing to retry: it finishes what the record names
    assert record.attempt == attempt
    fleet.assert_committed(record, 1, new)


class Answers:
    """A commit store that answers UNKNOWN or FAILED once, having written or not; after
    that answer, ``unreadable`` reads fail (the store is down for a while)."""

    def __init__(self, inner: CommitStore, answer: CommitOutcome, *, write: bool,
                 unreadable: int = 0) -> None:
        self.inner, self.answer, self.write = inner, answer, write
        self.unreadable = unreadable
        self.answered = False

    def read(self) -> CommitRecord:
        if self.answered and self.unreadable > 0:
            self.unreadable -= 1
            raise StoreError("the commit record store does not answer")
        return self.inner.read()

    def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome:
        if self.answered:
            return self.inner.compare_and_set(expected, new)
        self.answered = True
        if self.write:
            assert self.inner.compare_and_set(expected, new) is CommitOutcome.SUCCESS
        return self.answer


@pytest.mark.parametrize(("answer", "write", "expect"), [
    (CommitOutcome.UNKNOWN, True, [("mixed", "committed")]),
    (CommitOutcome.UNKNOWN, False, [("mixed", "failed"), ("overwrite", "committed")]),
    (CommitOutcome.FAILED, False, [("mixed", "failed"), ("overwrite", "committed")]),
], ids=["lost-acknowledgement", "no-answer", "refused"])
def test_an_unknown_or_refused_commit_is_settled_by_reading_the_record(
        fleet: Fleet, answer: CommitOutcome, write: bool, expect: list[tuple[str, str]]
) -> None:
    c = fleet.coordinator(commits=Answers(fleet.commits, answer, write=write))
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == expect
    for o in fleet.owners:  # advanced once, with the record that stands
        assert o.advanced == [record]
    fleet.assert_committed(record, 1, c)



def test_a_lost_commit_answer_is_settled_by_reading_again_not_by_abandoning(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "sleep", lambda _: None)  # the read retries' backoff
    c = fleet.coordinator(commits=Answers(fleet.commits, CommitOutcome.UNKNOWN, write=True,
                                          unreadable=2))
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "committed")]  # nothing abandoned, nothing retried
    fleet.assert_committed(record, 1, c)


def test_a_commit_whose_outcome_stays_unknown_abandons_nothing_and_the_next_call_finishes(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "sleep", lambda _: None)
    c = fleet.coordinator(commits=Answers(fleet.commits, CommitOutcome.UNKNOWN, write=True,
                                          unreadable=100))
    with pytest.raises(CommitUnknown, match="nothing is abandoned"):
        c.refit(1, "ckpt-1")
    attempt = c.history[0].attempt
    for r in fleet.ranks:  # flushed and waiting: the record decides
        st = r.status()
        assert (st.attempt, st.state, st.gate_open) == (attempt, "flushed", False)
    c2 = fleet.coordinator()  # the store answers again
    record = c2.refit(1, "ckpt-1")
    assert c2.history == []
    assert record.attempt == attempt
    fleet.assert_committed(record, 1, c2)


def test_a_retry_that_finds_its_own_earlier_attempt_committed_finishes_instead_of_conflicting(
        fleet: Fleet) -> None:
    # The first compare-and-set lands but answers FAILED (a confused store): the retry's
    # compare-and-set finds the coordinator's own first attempt in the record.
    c = fleet.coordinator(commits=Answers(fleet.commits, CommitOutcome.FAILED, write=True))
    record = c.refit(1, "ckpt-1")
    first, second = c.history
    assert record.attempt == first.attempt
    assert second.outcome.startswith("superseded")
    for r in fleet.ranks:  # flushed on the retry, told about the commit, serving
        st = r.status()
        assert (st.version, st.dirty, st.gate_open) == (1, None, True)
        assert r.bits().keys() == fleet.versions.dense(r.kind, 1).keys()
        assert all(torch.equal(r.bits()[n], fleet.versions.dense(r.kind, 1)[n])
                   for n in r.bits())


def test_an_attempt_with_nothing_to_send_flushes_and_commits(fleet: Fleet) -> None:
    for e in fleet.encoders:  # the candidate holds the baseline's bits: no payloads
        e.set_candidate(fleet.versions.source(0), 1)
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    assert outcomes(c) == [("mixed", "committed")]
    assert all(e.manifests[-1].payloads == () for e in fleet.encoders)
    for r in fleet.ranks:
        st = r.status()
        assert (st.version, st.dirty, st.gate_open) == (1, None, True)
    assert record == fleet.commits.read()


@pytest.mark.parametrize(("gate", "expect"), [
    ("sync", [("mixed", "committed")]),  # back-pressure: apply frees what staging holds
    ("async", [("mixed", "failed"), ("overwrite", "failed")]),  # refused at once: all staged first
])
def test_a_staging_budget_smaller_than_the_attempt(
        fleet: Fleet, gate: Gate, expect: list[tuple[str, str]]) -> None:
    for r in fleet.ranks:
        r.service.staging_bytes = 1  # smaller than any payload
    fleet.candidate(1)
    c = fleet.coordinator(settings=CoordinatorSettings(
        attempt_timeout_s=30.0, gate=gate, max_attempts=2))
    if gate == "sync":
        fleet.assert_committed(c.refit(1, "ckpt-1"), 1, c)
    else:
        t0 = time.monotonic()
        with pytest.raises(RefitFailed, match="needs more than the budget of 1 bytes"):
            c.refit(1, "ckpt-1")
        assert time.monotonic() - t0 < 20  # named at once, not at the deadline
    assert outcomes(c) == expect


class FailsToAdvanceOnce:
    """An owner that cannot be told to advance the first time (e.g. unreachable)."""

    def __init__(self, inner: OwnerHandle) -> None:
        self.inner = inner
        self.failed = False

    def publish(self, attempt: Attempt) -> None:
        self.inner.publish(attempt)

    def advance_baseline(self, record: CommitRecord) -> None:
        if not self.failed:
            self.failed = True
            raise ConnectionError(f"owner unreachable while advancing to {record}")
        self.inner.advance_baseline(record)


def test_an_owner_failing_to_advance_after_the_commit_does_not_undo_the_commit(
        fleet: Fleet) -> None:
    flaky = FailsToAdvanceOnce(fleet.owners[1])
    c = fleet.coordinator(owners=[fleet.owners[0], flaky])
    with pytest.raises(ConnectionError, match="owner unreachable"):
        c.refit(1, "ckpt-1")
    committed = c.history[0].attempt
    assert outcomes(c) == [("mixed", "committed")]  # not abandoned, not retried
    assert fleet.commits.read().attempt == committed
    assert [e.version for e in fleet.encoders] == [1, 0]
    for r in fleet.ranks:  # receivers learned the commit before the owners advanced
        st = r.status()
        assert (st.attempt, st.state, st.dirty, st.gate_open) == (committed, "committed",
                                                                 None, True)

    c2 = fleet.coordinator(owners=[fleet.owners[0], flaky])
    record = c2.refit(1, "ckpt-1")  # the same call again finishes the commit
    assert c2.history == []
    assert record.attempt == committed
    fleet.assert_committed(record, 1, c2)


# --- the owners' guard -----------------------------------------------------------------


def test_an_owner_advances_only_for_a_record_naming_its_candidate_and_an_attempt_it_published(
        versions: Versions) -> None:
    def attempt(base: int = 0) -> Attempt:
        return Attempt(transition=Transition(base_version=base, target_version=base + 1),
                       mode="mixed", receivers=("r",), deadline=time.time() + 60)

    owner = Encoder(store=MemoryStore(), baseline=versions.source(0), version=0)
    with pytest.raises(BaselineError, match="candidate None"):
        owner.publish(attempt())  # no candidate yet
    owner.set_candidate(versions.source(1), 1)
    published = attempt()
    owner.publish(published)
    refused = [
        V0,  # the record has not moved
        CommitRecord(committed_version=1, baseline_id="ckpt-1", attempt="a-someone-else"),
        CommitRecord(committed_version=2, baseline_id="ckpt-2", attempt=published.id),
    ]
    for record in refused:
        with pytest.raises(BaselineError, match="The baseline stays"):
            owner.advance_baseline(record)
        assert (owner.version, owner.baseline) == (0, versions.source(0))
    good = CommitRecord(committed_version=1, baseline_id="ckpt-1", attempt=published.id)
    owner.advance_baseline(good)
    assert (owner.version, owner.baseline, owner.candidate) == (1, versions.source(1), None)
    owner.advance_baseline(good)  # again, as a coordinator finishing after failover does
    assert owner.version == 1

    process = ProcessOwner(store_uri="memory://", checkpoints=versions.dir, version=0)
    for record in refused[1:]:
        with pytest.raises(BaselineError, match="The baseline stays"):
            process.advance_baseline(record)
        assert process.version == 0
    with pytest.raises(BaselineError, match="the committed baseline is 0"):
        process.command(attempt(base=1))


def test_the_gate_stays_shut_while_an_attempt_applies_and_apply_refuses_an_open_gate(
        fleet: Fleet) -> None:
    from dcr.receiver.service import AgentConflict

    fleet.candidate(1)
    svc = fleet.rank("vllm-0").service
    attempt = Attempt(transition=Transition(base_version=0, target_version=1), mode="mixed",
                      receivers=("vllm-0",), deadline=time.time() + 30)
    svc.prepare(attempt)
    with pytest.raises(AgentConflict, match="close the request gate before applying"):
        svc.open_apply(attempt)
    svc.close_gate()
    svc.open_apply(attempt)  # dirty from here on, before any payload exists
    assert svc.status().dirty == (0, 1)
    with pytest.raises(AgentConflict, match="will not serve weights that hold no version"):
        svc.open_gate()
    svc.stop_and_wait(attempt.id)
    with pytest.raises(AgentConflict, match="is obsolete"):
        svc.open_apply(attempt)
    assert svc.status().gate_open is False


# --- hostile writes under an attempt's prefix (store write access, a relay token) -------

FOREIGN_TENSOR = "model.layers.0.mlp.down_proj.weight"


def foreign_payload(seal: Callable[..., bytes], versions: Versions, attempt: str, owner: int,
                    seq: int) -> bytes:
    """A well-formed payload of ``attempt`` with ids ``(owner, seq)``, which no owner
    wrote: XOR masks on elements of one tensor that v0 and v1 share, where an overwrite
    retry (the changed set only) would never write again."""
    v0, v1 = (versions.states[v][FOREIGN_TENSOR] for v in (0, 1))
    base = v0.view(torch.int16).reshape(-1).numpy().view(np.uint16)
    same = np.flatnonzero(base == v1.view(torch.int16).reshape(-1).numpy().view(np.uint16))
    assert same.size >= 8
    target = base.copy()
    target[same] ^= 0x0101
    return seal(attempt, owner, seq, FOREIGN_TENSOR, base, target, tuple(v0.shape))


def hold_part(fleet: Fleet, fetched: list[str]) -> Fault:
    """Owner 0's manifest part waits (a few seconds at most) until every receiver has
    fetched ``fetched[0]`` and applied everything it staged: a receiver that applies what
    it has not verified has then applied the foreign payload before the attempt fails."""
    def hold(key: str, data: bytes) -> bytes:
        fleet.store.wait_gets(fetched[0], len(KINDS), timeout_s=3.0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                (st := r.service.status()).state == "applying"
                and st.payloads_applied < st.payloads_staged for r in fleet.ranks):
            time.sleep(0.01)
        return data
    return hold


@pytest.mark.parametrize("where", ["owner-outside-the-attempt", "after-the-owners-last"])
def test_a_foreign_payload_the_manifest_does_not_list_is_never_applied(
        fleet: Fleet, where: str, sealed_xor: Callable[..., bytes]) -> None:
    """Someone with store write access puts a well-formed payload under the attempt's
    prefix (owner 2 of a two-owner attempt, or owner 0's next seq) while owner 0 streams.
    Receivers never apply it, and the first attempt commits bit-exact. Fails on 5b0b0ae:
    the receivers applied it, the attempt failed, and the overwrite retry committed with
    its bits still in the tensor (assert_committed finds it differs from a dense load)."""
    forged: list[str] = []

    def plant(key: str, data: bytes) -> bytes:
        owner, seq = (2, 0) if where == "owner-outside-the-attempt" else (0, 2)
        attempt = attempt_of(key)
        forged.append(payload_key(1, attempt, owner, seq))
        fleet.store.inner.put(forged[0], foreign_payload(sealed_xor, fleet.versions, attempt,
                                                         owner, seq))
        return data

    fleet.store.on_put.append(once(lambda k: is_payload(k, owner=0, seq=0), plant))
    fleet.store.on_put.append(once(lambda k: k.endswith("manifest-o0000.dcrm"),
                                   hold_part(fleet, forged)))
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    fleet.assert_committed(record, 1, c)  # the bits first: what 5b0b0ae got wrong
    assert outcomes(c) == [("mixed", "committed")]
    assert len(fleet.encoders[0].manifests[0].payloads) == 2  # so s2 is no owner's
    if where == "owner-outside-the-attempt":
        assert fleet.store.gets.count(forged[0]) == 0  # never even fetched


@pytest.mark.parametrize("gate", ["sync", "async"])
def test_a_listed_payload_replaced_by_other_bytes_fails_the_attempt_and_a_dense_load_repairs(
        fleet: Fleet, gate: Gate, sealed_xor: Callable[..., bytes]) -> None:
    """The store holds other (well-formed) bytes under a payload key the manifest lists
    with its real digest. Receivers refuse it before applying it; those that had begun
    writing the attempt (sync gate) report their weights unknown, are restored by a dense
    load at the next admission, and the overwrite retry commits bit-exact. With the sync
    gate this fails on 5b0b0ae: the payload was applied before the comparison, and the
    overwrite retry committed v1 with its bits still in the tensor. With the async gate
    nothing is applied before everything is staged, then as now; it shows that weights
    nothing was written to are not distrusted (no dense load)."""
    replaced: list[str] = []

    def replace(key: str, _: bytes) -> bytes:
        replaced.append(key)
        return foreign_payload(sealed_xor, fleet.versions, attempt_of(key), 0, 0)

    fleet.store.on_put.append(once(lambda k: is_payload(k, owner=0, seq=0), replace))
    fleet.store.on_put.append(once(lambda k: k.endswith("manifest-o0000.dcrm"),
                                   hold_part(fleet, replaced)))
    c = fleet.coordinator(settings=CoordinatorSettings(gate=gate, attempt_timeout_s=30.0))
    record = c.refit(1, "ckpt-1")
    fleet.assert_committed(record, 1, c)  # the bits first: what 5b0b0ae got wrong
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert "o0/s0 arrived as" in c.history[0].outcome
    # Sync: apply was open, so the weights were dirty: unknown, dense load, then overwrite.
    # Async: nothing had been written; the weights held v0 and take part as they are.
    assert c.history[1].rejoined == (KINDS if gate == "sync" else ())


def test_bits_that_differ_from_the_manifests_target_fail_the_flush_and_a_dense_load_repairs(
        fleet: Fleet) -> None:
    """A receiver whose weights already hold a foreign bit (applied earlier, by an agent
    that did not check): the attempt's XOR masks carry it into v1. Flush reads the
    tensors back, finds the fingerprint differs from the manifest's target, fails the
    attempt and reports the weights unknown; a dense load and the overwrite retry make it
    exact. Fails on 5b0b0ae, which committed v1 with the bit still flipped."""
    victim = fleet.rank("hf")
    held = dict(victim.engine.runtimes[0].named_tensors())[FOREIGN_TENSOR]
    with torch.no_grad():
        held.view(-1).view(torch.int16)[0] ^= 1
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    fleet.assert_committed(record, 1, c)  # the bits first: what 5b0b0ae got wrong
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert f"'{FOREIGN_TENSOR}' holds xxh3-128:" in c.history[0].outcome
    assert c.history[1].rejoined == ("hf",)
    assert victim.service.counters.dense_loads == 1


def test_a_foreign_bit_in_one_tp_ranks_shard_fails_the_flush_and_a_dense_load_repairs(
        fleet: Fleet) -> None:
    """The same foreign bit in a tensor the receiver holds in part: rank 1 of a TP 2
    engine holds half of every row of the row-parallel down projection, so the tensor's
    fingerprint is out of its reach. Its profile names the region it holds, the owners
    write that region's sum with the manifest, and flush finds the bit there. Without
    the region sums the attempt commits v1 with the bit still flipped."""
    victim = fleet.rank("vllm-1")
    held = dict(victim.engine.runtimes[0].named_tensors())[FOREIGN_TENSOR]
    with torch.no_grad():
        held.view(-1).view(torch.int16)[3] ^= 1 << 2
    c = fleet.coordinator()
    record = c.refit(1, "ckpt-1")
    fleet.assert_committed(record, 1, c)
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert f"'{FOREIGN_TENSOR}@" in c.history[0].outcome
    assert "holds sum64:" in c.history[0].outcome
    assert c.history[1].rejoined == ("vllm-1",)
    assert victim.service.counters.dense_loads == 1


# --- a TP 2 engine in one receiver, as the main job's vLLM-layout pods hold the model ---

FP8_CFG = ReferenceConfig(**{**CFG.__dict__, "fp8_modules": ("self_attn.o_proj",)})
NORM = "model.layers.1.input_layernorm.weight"  # every TP rank holds it whole
UNCHECKED_AT_FLUSH = "no fingerprint can check their bits at flush"


@pytest.fixture(scope="module")
def norms_kept(tmp_path_factory: pytest.TempPathFactory, versions: Versions) -> Path:
    """v0, and a v1 that moves every matrix and leaves every norm weight as v0 holds it,
    as an AdamW step does in BF16 (1.0 less a step of 1e-3 rounds back to 1.0)."""
    root = tmp_path_factory.mktemp("norms-kept")
    v0, v1 = versions.states[0], versions.states[1]
    for v, state in enumerate((v0, {n: v0[n] if n.endswith("norm.weight") else t
                                    for n, t in v1.items()})):
        (root / f"v{v}").mkdir()
        save_file(state, str(root / f"v{v}" / "model.safetensors"))
    return root


def tp2_engine(root: Path, staging: Path, version: int) -> LocalDriver:
    """Both ranks of a vLLM-layout TP 2 engine with FP8 ``o_proj``, loaded densely."""
    models = [ReferenceModel(FP8_CFG, tp_size=2, tp_rank=r) for r in range(2)]
    engine = LocalDriver(models, staging_dir=staging, checkpoint_root=root)
    engine.load_dense(f"v{version}")
    return engine


def test_a_bit_flipped_in_one_tp_ranks_norm_the_step_leaves_fails_the_flush_and_a_dense_load_repairs(  # noqa: E501
        tmp_path: Path, norms_kept: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two TP 2 receivers of the vLLM layout with FP8 ``o_proj``; rank 1 of one holds a
    flipped bit in a norm weight every rank holds whole and the step leaves as it is, so
    no payload writes it. Each rank compares every fingerprint the manifest carries at
    flush, written or not: that receiver fails the attempt, is left out and rejoined
    densely, and the overwrite retry commits v1 with every rank of both equal to a dense
    load. No rank logs a tensor it holds unchecked but the FP8 casts, which it names once
    at prewarm. Before the whole-state check, v1 committed with the bit still flipped."""
    caplog.set_level("WARNING", logger="dcr.runtimes.rank")
    store = MemoryStore()
    engines = {n: tp2_engine(norms_kept, tmp_path / n, 0) for n in ("clean", "flipped")}
    services = [AgentService(n, e, lambda s: StoreSource(
        store=store, version=s.target_version, attempt=s.attempt, owners=s.owners),
        canonical=canonical(), staging_dir=tmp_path / n, version=0,
        journal=Journal(tmp_path / n / "journal.json"), checkpoint_root=norms_kept)
        for n, e in engines.items()]
    profile = merge(ReceiverProfile.model_validate(s.profile()) for s in services)
    prewarmed = [r.getMessage() for r in caplog.records]
    assert [m for m in prewarmed if UNCHECKED_AT_FLUSH in m] == [
        f"Rank {r}: 2 tensors are quantized as a whole on their way to storage (dense "
        "path), e.g. ['model.layers.0.self_attn.o_proj.weight', "
        f"'model.layers.1.self_attn.o_proj.weight']: {UNCHECKED_AT_FLUSH}"
        for _ in engines for r in range(2)]
    held = dict(engines["flipped"].runtimes[1].named_tensors())[NORM]
    with torch.no_grad():
        held.view(-1).view(torch.int16)[9] ^= 1
    with Checkpoint(norms_kept / "v0") as v0, Checkpoint(norms_kept / "v1") as v1:
        owners = [Encoder(store=store, baseline=v0, version=0, owner=k, owners=OWNERS,
                          profile=profile) for k in range(OWNERS)]
        for o in owners:
            o.set_candidate(v1, 1)
        c = Coordinator(SqliteCommitStore(tmp_path / "commit.db", V0), owners, services,
                        settings=SETTINGS, dense_checkpoint=lambda v: str(norms_kept / f"v{v}"))
        try:
            assert c.refit(1, "ckpt-1").committed_version == 1
        finally:
            c.close()
    assert outcomes(c) == [("mixed", "failed"), ("overwrite", "committed")]
    assert "flipped: attempt" in c.history[0].outcome
    assert f"'{NORM}' holds xxh3-128:" in c.history[0].outcome
    assert c.history[1].rejoined == ("flipped",)
    want = [_int_views(r) for r in tp2_engine(norms_kept, tmp_path / "oracle", 1).runtimes]
    for name, engine in engines.items():
        for r, runtime in enumerate(engine.runtimes):
            got = _int_views(runtime)
            assert got.keys() == want[r].keys()
            assert [n for n in want[r] if not torch.equal(got[n], want[r][n])] == [], name
    for s in services:
        st = s.status()
        assert (st.version, st.dirty, st.unknown, st.gate_open) == (1, None, None, True)
    later = [r.getMessage() for r in caplog.records][len(prewarmed):]
    assert [m for m in later if "no fingerprint it can recompute" in m] == []
    assert [m for m in later if UNCHECKED_AT_FLUSH in m] == []  # once per prewarm, not flush
