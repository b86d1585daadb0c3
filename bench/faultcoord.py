"""The fault campaign's coordinator: one refit as its own process, so it can be killed -9.

``python bench/faultcoord.py SPEC.json VERSION`` runs the product's coordinator
(``dcr.protocol.coordinator``) over the campaign's ``dcr encoder`` owners and ``dcr agent``
receivers, with the SQLite commit record and the store's history, as ``dcr.coordinate``
does in a trainer (whose owners name no checkpoint; these encoders read the trainer's
exports). Started again after a kill it reads the record and carries on: a committed
version is finished, anything else retried, as the operator's coordinator does across
restarts. The store is reached as the environment says (the campaign's proxied link); it
holds the history. Through a relay tree the spec's ``publish`` names the root the owners
publish to, which their answers must name.

Every compare-and-set is appended to the event log *as the commit store answered it*, with
the receivers the attempt counted: the checker (bench/faultcheck.py) reads these answers,
never the campaign's plans. Exit status: 0 once VERSION is committed and finished.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from dcr.files.history import HistoryStore
from dcr.format.profile import ReceiverProfile
from dcr.protocol.agent_api import AgentClient
from dcr.protocol.commitstore import CommitOutcome, SqliteCommitStore
from dcr.protocol.coordinator import Coordinator, CoordinatorSettings
from dcr.protocol.owner_endpoints import OwnerEndpoints
from dcr.protocol.records import CommitRecord
from dcr.transport.store import open_store


def emit(path: Path, party: str, kind: str, **fields: Any) -> None:
    """Append one observed event (a line of JSON, written at once: a kill -9 may follow)."""
    line = json.dumps({"t": time.time(), "party": party, "kind": kind, **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def record_fields(r: CommitRecord) -> dict[str, Any]:
    return {"version": r.committed_version, "attempt": r.attempt, "baseline": r.baseline_id}


class ObservedCommits:
    """The SQLite commit store, every compare-and-set's answer written to the event log."""

    def __init__(self, inner: SqliteCommitStore, events: Path) -> None:
        self.inner, self.events = inner, events
        self.coordinator: Coordinator | None = None  # its current attempt's receivers

    def read(self) -> CommitRecord:
        return self.inner.read()

    def compare_and_set(self, expected: CommitRecord, new: CommitRecord) -> CommitOutcome:
        counted = list(self.coordinator.history[-1].receivers) if self.coordinator and \
            self.coordinator.history else []
        outcome = self.inner.compare_and_set(expected, new)
        emit(self.events, "coordinator", "cas", expected=record_fields(expected),
             new=record_fields(new), outcome=outcome.value, receivers=counted)
        return outcome


def main(spec_path: str, version: str) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    events, target = Path(spec["events"]), int(version)
    agent_token = Path(spec["agent_token_file"]).read_text().strip()
    owner_token = Path(spec["owner_token_file"]).read_text().strip()
    commits = ObservedCommits(SqliteCommitStore(Path(spec["record"]), CommitRecord(
        committed_version=0, baseline_id=spec["checkpoint"].format(v=0), attempt="")), events)
    store = open_store(spec["store"])
    start = commits.read()
    emit(events, "coordinator", "start", target=target, pid=os.getpid(),
         record=record_fields(start))
    endpoints = OwnerEndpoints(
        name="campaign owners", urls=spec["owners"], token=owner_token,
        target=spec["checkpoint"].format(v=target), base_checkpoint=start.baseline_id,
        base_attempt=start.attempt, store=spec.get("publish", store.uri),
        profile=ReceiverProfile.model_validate_json(Path(spec["profile"]).read_text()))
    agents = [AgentClient(name, url, agent_token, timeout_s=spec["agent_timeout_s"])
              for name, url in spec["agents"]]
    coordinator = Coordinator(commits, endpoints.owners(), agents,
                              settings=CoordinatorSettings(**spec["coordinator"]),
                              history=HistoryStore(store))
    commits.coordinator = coordinator
    try:
        record = coordinator.refit(target, spec["checkpoint"].format(v=target))
    except Exception as e:
        emit(events, "coordinator", "failed", target=target, pid=os.getpid(),
             error=f"{type(e).__name__}: {e}", attempts=[h.outcome for h in coordinator.history])
        logging.getLogger("faultcoord").error("refit to %d failed: %s", target, e)
        return 1
    finally:
        coordinator.close()
    emit(events, "coordinator", "done", target=target, pid=os.getpid(),
         record=record_fields(record), attempts=[h.outcome for h in coordinator.history])
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
