"""The fault campaign's checker: invariants over what the parties answered, never over plans.

The event log (one JSON object a line, each with ``t``, ``party`` and ``kind``) holds only
answers: the commit store's answer to each compare-and-set (``cas``, written by the
coordinator process, bench/faultcoord.py), the record as read back (``record``), each
agent's status and whole-state fingerprints (``agent``, grouped in polling ``round``\\ s),
fingerprints of a dense load of each version's checkpoint through each pod kind's loader
(``reference``), the tensors ``dcr materialize`` built from the store and the checkpoint's
own (``materialized``, ``checkpoint``), the per-token weight versions each completion
was answered with (``completion``, from a client of each pod's server), and when the
campaign stopped its faults (``faults_stopped``, with the bound it promises). What the
harness meant to do (its fault schedule) is not read here. It lives in bench, not in the
product: it judges a harness's log, and a product path gains nothing from it.
docs/faults.md says what each kind means.

``python bench/faultcheck.py EVENTS.jsonl`` prints the violations (exit 1 if any).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Event = dict[str, Any]

KINDS = {  # each violation kind and the invariant it breaks
    "cas_step": "a successful compare-and-set moved the record by other than one version",
    "record_backwards": "a read of the commit record named an older version than an "
                        "earlier read, or the same version by another attempt",
    "record_unexplained": "a read of the commit record named a record no successful "
                          "compare-and-set wrote",
    "counted_not_holding": "a receiver counted for a commit was next seen clean at "
                           "another version, or at the version without its bits",
    "wrong_bits": "an agent reported a clean version whose whole fingerprints differ from "
                  "a dense load of that version",
    "not_buildable": "a committed version could not be built from the store, or was built "
                     "with other bits than its checkpoint",
    "completion_uncommitted": "a completion was answered with tokens of a weight version "
                              "no successful compare-and-set named (nor the initial one)",
    "completion_mixed": "two completions of the same prompt labelled with one version by "
                        "pods of one kind answered different tokens or logprobs (greedy: "
                        "the same bits answer the same)",
    "not_converged": "after the faults stopped, the fleet did not reach the newest "
                     "committed version (every agent, its bits) within the bound",
}


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str
    t: float = 0.0

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail} ({KINDS[self.kind]})"


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)  # per faults_stopped, converged

    def add(self, kind: str, detail: str, t: float = 0.0) -> None:
        self.violations.append(Violation(kind, detail, t))


def read_events(path: Path) -> list[Event]:
    """The log's events in time order; a last line cut by a kill -9 is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(out, key=lambda e: float(e["t"]))


def _of(events: Iterable[Event], kind: str) -> Iterator[Event]:
    return (e for e in events if e["kind"] == kind)


def _key(r: dict[str, Any]) -> tuple[int, str]:
    return int(r["version"]), str(r["attempt"])


def _commits(events: Sequence[Event]) -> list[Event]:
    return [e for e in _of(events, "cas") if e["outcome"] == "success"]


def check_record(events: Sequence[Event], rep: Report) -> None:
    for e in _commits(events):
        old, new = int(e["expected"]["version"]), int(e["new"]["version"])
        if new != old + 1:
            rep.add("cas_step", f"compare-and-set {old} -> {new} (attempt "
                    f"{e['new']['attempt']}) succeeded", e["t"])
    written = {_key(e["new"]) for e in _of(events, "cas") if e["outcome"] != "conflict"}
    last: tuple[int, str] | None = None
    for e in _of(events, "record"):
        k = _key(e)
        if k[0] > 0 and k not in written:
            rep.add("record_unexplained", f"read version {k[0]} by attempt {k[1]!r}", e["t"])
        if last is not None and (k[0] < last[0] or (k[0] == last[0] and k[1] != last[1])):
            rep.add("record_backwards", f"read version {k[0]} ({k[1]!r}) after version "
                    f"{last[0]} ({last[1]!r})", e["t"])
        last = k


def _references(events: Sequence[Event]) -> dict[tuple[int, str], dict[str, str]]:
    return {(int(e["version"]), str(e["pod_kind"])): e["fingerprint"]
            for e in _of(events, "reference")}


def _holds(e: Event, version: int, refs: dict[tuple[int, str], dict[str, str]]) -> bool | None:
    """Whether agent event ``e`` shows ``version``'s bits clean (None: no reference)."""
    if e.get("dirty") is not None or e.get("version") != version or e.get("unknown"):
        return False
    ref = refs.get((version, str(e["pod_kind"])))
    if ref is None or e.get("fingerprint") is None:
        return None
    return bool(e["fingerprint"] == ref)


def check_bits(events: Sequence[Event], rep: Report) -> None:
    refs = _references(events)
    agents = list(_of(events, "agent"))
    for e in agents:
        if e.get("dirty") is None and not e.get("unknown") and e.get("version") is not None \
                and _holds(e, int(e["version"]), refs) is False:
            rep.add("wrong_bits", f"{e['agent']} reported version {e['version']} clean with "
                    "other fingerprints", e["t"])
    commits = _commits(events)
    for i, c in enumerate(commits):
        v, until = int(c["new"]["version"]), (commits[i + 1]["t"] if i + 1 < len(commits)
                                              else float("inf"))
        for name in c["receivers"]:
            seen = next((e for e in agents if e["agent"] == name and c["t"] < e["t"] < until
                         and e.get("dirty") is None and e.get("fingerprint") is not None),
                        None)
            if seen is not None and not _holds(seen, v, refs):
                rep.add("counted_not_holding", f"{name}, counted for version {v} (attempt "
                        f"{c['new']['attempt']}), was next seen clean at version "
                        f"{seen.get('version')}"
                        + (" without its bits" if seen.get("version") == v else ""), seen["t"])


def check_completions(events: Sequence[Event], rep: Report) -> None:
    committed = {"0"} | {str(c["new"]["version"]) for c in _commits(events)}
    for e in _of(events, "completion"):
        named = {str(s["version"]) for s in e.get("versions") or []}
        if not named or named - committed:
            rep.add("completion_uncommitted", f"{e['pod']} answered tokens of version(s) "
                    f"{sorted(named) or 'unreported'}; committed: {sorted(committed)}", e["t"])
    first: dict[tuple[str, str], Event] = {}
    for e in _of(events, "completion"):
        spans = e.get("versions") or []
        if len(spans) != 1:
            continue  # a switch between tokens: each token's version is reported
        key = (str(e["pod_kind"]), str(spans[0]["version"]))
        seen = first.setdefault(key, e)
        if (seen["tokens"], seen["logprobs"]) != (e["tokens"], e["logprobs"]):
            rep.add("completion_mixed", f"{e['pod']} answered version {key[1]} with tokens "
                    f"{e['tokens']} {e['logprobs']}; {seen['pod']} with {seen['tokens']} "
                    f"{seen['logprobs']}", e["t"])


def check_buildable(events: Sequence[Event], rep: Report) -> None:
    built = {int(e["version"]): e for e in _of(events, "materialized")}
    wanted = {int(e["version"]): e["tensors"] for e in _of(events, "checkpoint")}
    for c in _commits(events):
        v = int(c["new"]["version"])
        got = built.get(v)
        if got is None:
            rep.add("not_buildable", f"version {v}: never materialized", c["t"])
        elif got.get("error"):
            rep.add("not_buildable", f"version {v}: {got['error']}", got["t"])
        elif got["tensors"] != wanted.get(v):
            differ = sorted(k for k in set(got["tensors"]) | set(wanted.get(v, {}))
                            if got["tensors"].get(k) != wanted.get(v, {}).get(k))
            rep.add("not_buildable", f"version {v}: {len(differ)} tensors differ from its "
                    f"checkpoint (first {differ[:3]})", got["t"])


def check_convergence(events: Sequence[Event], rep: Report) -> None:
    refs = _references(events)
    commits = _commits(events)
    rounds: dict[int, list[Event]] = {}
    for e in _of(events, "agent"):
        rounds.setdefault(int(e["round"]), []).append(e)
    for stop in _of(events, "faults_stopped"):
        t0, bound, fleet = float(stop["t"]), float(stop["bound_s"]), set(stop["agents"])
        done = [c for c in commits if c["t"] <= t0]
        newest = int(done[-1]["new"]["version"]) if done else 0
        later = [c["t"] for c in commits if c["t"] > t0]
        until = min(later, default=float("inf"))
        ok = next((max(e["t"] for e in r) for _, r in sorted(rounds.items())
                   if t0 <= min(e["t"] for e in r) and max(e["t"] for e in r) < until
                   and {e["agent"] for e in r} >= fleet
                   and all(_holds(e, newest, refs) for e in r if e["agent"] in fleet)), None)
        if ok is None or ok - t0 > bound:
            rep.add("not_converged", f"step {stop['step']}: fleet {sorted(fleet)} not all at "
                    f"version {newest} with its bits within {bound:.0f} s", t0)
        else:
            rep.recovery_s.append(ok - t0)


def check(events: Sequence[Event]) -> Report:
    rep = Report()
    for fn in (check_record, check_bits, check_completions, check_buildable,
               check_convergence):
        fn(events, rep)
    return rep


def main(argv: Sequence[str]) -> int:
    rep = check(read_events(Path(argv[0])))
    for v in rep.violations:
        print(v)
    print(f"{len(rep.violations)} violations; recovery s: "
          f"{', '.join(f'{x:.1f}' for x in rep.recovery_s) or 'none'}")
    return 1 if rep.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
