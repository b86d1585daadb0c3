"""The ``dcr`` command line: diff, patch, inspect, demo, relay, encode, agent, refit.

Exit status: 0 on success, 1 when DCR refuses or fails (the message names the value),
2 for usage errors. With ``--json`` a command prints exactly one JSON object on stdout
and no progress bars.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from dcr.checkpoint import Checkpoint
from dcr.errors import DcrError
from dcr.files.inspect import describe, render
from dcr.files.patch import load_manifest, patch_checkpoint
from dcr.format.profile import load_profile
from dcr.owner.diff import diff_checkpoints
from dcr.owner.settings import EncodeSettings
from dcr.settings import MiB, add_options, doc, from_args
from dcr.transport.store import open_store

EPILOG = """\
examples:
  dcr diff ckpt/v1 ckpt/v2 --store file:///tmp/deltas --version 2 --json
  dcr patch rollout/ckpt --store file:///tmp/deltas --version 2
  dcr inspect --store file:///tmp/deltas --version 2
  dcr demo
  dcr relay --listen 0.0.0.0:8470 --members r0:8470,r1:8470,r2:8470 --index 1 \
            --fanout 2 --token-file /etc/dcr/token
"""


@contextmanager
def _progress(total: int, desc: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr) as bar:
        yield bar.update


def _emit(args: argparse.Namespace, summary: dict[str, Any], text: str) -> None:
    print(json.dumps(summary, sort_keys=True) if args.json else text)


# ``dcr diff`` and ``dcr encode`` share their options, generated from EncodeSettings:
# (command, help, settings fields left off, fields required, manifest under the attempt).
# encode adds the attempt and the owner split and requires the mode and the attempt.
_ENCODE_COMMANDS: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...], bool], ...] = (
    ("diff", "write the delta BASE -> TARGET as version N to a store",
     ("owner", "owners", "attempt"), (), False),
    ("encode", "publish one owner's part of a refit attempt (an owner process; like diff, "
     "with the attempt and owner split given)", (), ("mode", "attempt"), True),
)


def _add_encode_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, help_, skip, required, per_attempt in _ENCODE_COMMANDS:
        d = sub.add_parser(name, help=help_)
        d.add_argument("base", metavar="BASE", help="HF checkpoint dir or .safetensors file")
        d.add_argument("target", metavar="TARGET", help="HF checkpoint dir or .safetensors file")
        d.add_argument("--store", required=True, help="file:///abs/path or a plain path")
        d.add_argument("--base-version", type=int, metavar="M",
                       help=f"{doc(EncodeSettings, 'base_version')} (default N-1)")
        add_options(d, EncodeSettings, skip=("base_version", *skip), required=required)
        d.add_argument("--json", action="store_true", help="print one JSON summary object")
        d.set_defaults(func=cmd_diff, attempt_manifest=per_attempt)


def encode_settings(args: argparse.Namespace) -> EncodeSettings:
    """What ``dcr diff`` or ``dcr encode`` was told (the profile file not read yet)."""
    return from_args(
        EncodeSettings, args, attempt_manifest=args.attempt_manifest,
        base_version=args.version - 1 if args.base_version is None else args.base_version)


def cmd_diff(args: argparse.Namespace) -> None:
    settings = encode_settings(args)
    if settings.profile_path is not None:
        settings = replace(settings, profile=load_profile(settings.profile_path))
    store = open_store(args.store)
    t0 = time.perf_counter()
    with Checkpoint(Path(args.base)) as base, Checkpoint(Path(args.target)) as target:
        total = sum(i.nbytes for i in base)
        with _progress(total, "diff", not args.json) as bar:
            m = diff_checkpoints(base, target, store, settings, bar)
    seconds = time.perf_counter() - t0
    st = m.stats
    summary = {
        **st.model_dump(),
        "seconds": round(seconds, 4),
        "payloads": len(m.payloads),
        "attempt": m.attempt,
        "base_version": m.base_version,
        "version": m.target_version,
        "mode": m.mode,
        "store": store.uri,
    }
    pct = 100 * st.changed_elements / max(1, st.total_elements)
    text = (
        f"version {m.base_version} -> {m.target_version} ({m.mode}, attempt {m.attempt}): "
        f"{st.changed_elements:,} of {st.total_elements:,} elements changed ({pct:.3f}%) in "
        f"{st.tensors} tensors; {len(m.payloads)} payloads, {st.payload_bytes:,} bytes = "
        f"{100 * st.payload_bytes / max(1, st.dense_bytes):.3f}% of {st.dense_bytes:,} dense "
        f"bytes; {seconds:.2f} s"
    )
    _emit(args, summary, text)


def cmd_patch(args: argparse.Namespace) -> None:
    store = open_store(args.store)
    root = Path(args.checkpoint)
    t0 = time.perf_counter()
    with Checkpoint(root) as c:
        total = sum(f.stat().st_size for f in c.files)
    with _progress(total, "patch", not args.json) as bar:
        r = patch_checkpoint(root, store, args.version, progress=bar)
    seconds = time.perf_counter() - t0
    summary = {
        "version": r.manifest.target_version,
        "base_version": r.manifest.base_version,
        "attempt": r.manifest.attempt,
        "files_patched": r.files_patched,
        "files_already_at_target": r.files_already_at_target,
        "records_applied": r.records_applied,
        "payload_bytes": r.manifest.stats.payload_bytes,
        "seconds": round(seconds, 4),
    }
    text = (
        f"{root}: version {r.manifest.base_version} -> {r.manifest.target_version}: "
        f"{r.records_applied:,} records applied to {r.files_patched} files "
        f"({r.files_already_at_target} already at target); verified; {seconds:.2f} s"
    )
    _emit(args, summary, text)


def cmd_inspect(args: argparse.Namespace) -> None:
    store = open_store(args.store)
    m = load_manifest(store, args.version)
    report = describe(store, m)
    _emit(args, report, render(report))


def cmd_demo(args: argparse.Namespace) -> None:
    from dcr.demo import run_demo

    run_demo(Path(args.out), steps=args.steps, seed=args.seed)


def cmd_agent(args: argparse.Namespace) -> None:
    from dcr.receiver.main import run

    run(args)


def cmd_refit(args: argparse.Namespace) -> None:
    from dcr.refit import RefitSettings, run_refit

    run_refit(RefitSettings(
        out=Path(args.out), steps=args.steps, seed=args.seed, agents=args.agents,
        owners=args.owners if args.owners is not None else (
            1 if args.transport == "relay" else 2),
        transport=args.transport,
        kill_receiver_every=args.kill_receiver_every,
    ))


def cmd_relay(args: argparse.Namespace) -> None:
    import logging

    from dcr.errors import ConfigError
    from dcr.transport.relay import RelaySettings, run_relay

    try:
        token = Path(args.token_file).read_text().strip()
    except OSError as e:
        raise ConfigError(f"Cannot read the relay token file {args.token_file!r}: {e}.") from e
    settings = RelaySettings(
        members=tuple(m.strip() for m in args.members.split(",") if m.strip()),
        index=args.index,
        fanout=args.fanout,
        token=token,
        listen=args.listen,
        budget_bytes=args.budget_mib * MiB,
        spool_dir=Path(args.spool) if args.spool else None,
        spool_budget_bytes=args.spool_budget_mib * MiB,
        admit_timeout_s=args.admit_timeout_s,
        parent_timeout_s=args.parent_timeout_s,
        health_interval_s=args.health_interval_s,
        resync_interval_s=args.resync_interval_s,
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_relay(settings)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dcr",
        description="Delta-Compressed Refit: ship only the changed bits of a checkpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_encode_commands(sub)

    from dcr.receiver.main import add_arguments

    ag = sub.add_parser("agent", help="run a rollout rank's agent (HTTP control API) with "
                        "an embedded runtime")
    add_arguments(ag)
    ag.set_defaults(func=cmd_agent)

    rf = sub.add_parser("refit", help="the main job: train, refit agent processes after "
                        "every step, recover from kills, verify bits, plot")
    rf.add_argument("--out", default="refit-out", help="working directory (default refit-out)")
    rf.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    rf.add_argument("--seed", type=int, default=0)
    rf.add_argument("--agents", type=int, default=4,
                    help="agent processes: half transformers, half vLLM-layout TP2 (default 4)")
    rf.add_argument("--owners", type=int, help="encoder processes (default 2; 1 with relay)")
    rf.add_argument("--transport", choices=["store", "relay"], default="store",
                    help="store: a file store; relay: a relay tree, one node per agent")
    rf.add_argument("--kill-receiver-every", type=int, default=0, metavar="N",
                    help="kill one agent mid-refit every N steps (default 0: never)")
    rf.set_defaults(func=cmd_refit)

    pa = sub.add_parser("patch", help="apply version N in place to a checkpoint at its base")
    pa.add_argument("checkpoint", metavar="CKPT", help="HF checkpoint dir or .safetensors file")
    pa.add_argument("--store", required=True)
    pa.add_argument("--version", type=int, required=True, metavar="N")
    pa.add_argument("--json", action="store_true")
    pa.set_defaults(func=cmd_patch)

    i = sub.add_parser("inspect", help="summarise the delta of version N")
    i.add_argument("--store", required=True)
    i.add_argument("--version", type=int, required=True, metavar="N")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    dm = sub.add_parser("demo", help="train a small model, refit it step by step, verify bits")
    dm.add_argument("--out", default="demo-out", help="working directory (default demo-out)")
    dm.add_argument("--steps", type=int, default=3, help="optimizer steps to refit (default 3)")
    dm.add_argument("--seed", type=int, default=0)
    dm.set_defaults(func=cmd_demo)

    r = sub.add_parser("relay", help="run one relay tree node until SIGTERM")
    r.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to bind")
    r.add_argument("--members", required=True, metavar="H:P,H:P,...",
                   help="every node's address in tree order; the first is the root")
    r.add_argument("--index", type=int, required=True, metavar="I",
                   help="this node's position in --members")
    r.add_argument("--fanout", type=int, default=2, metavar="K",
                   help="children per node (default 2)")
    r.add_argument("--token-file", required=True, metavar="PATH",
                   help="file holding the bearer token every node and client shares")
    r.add_argument("--spool", metavar="DIR",
                   help="directory for staged bytes beyond the memory budget (default: none)")
    r.add_argument("--budget-mib", type=int, default=1024, metavar="N",
                   help="staged MiB held in memory (default 1024)")
    r.add_argument("--spool-budget-mib", type=int, default=64 * 1024, metavar="N",
                   help="staged MiB held in --spool (default 65536)")
    r.add_argument("--admit-timeout-s", type=float, default=30.0, metavar="S",
                   help="how long an upload waits for staging space before 503 (default 30)")
    r.add_argument("--parent-timeout-s", type=float, default=1.0, metavar="S",
                   help="parent unreachable this long -> re-attach to an ancestor (default 1)")
    r.add_argument("--health-interval-s", type=float, default=0.25, metavar="S",
                   help="how often the parent is probed (default 0.25)")
    r.add_argument("--resync-interval-s", type=float, default=10.0, metavar="S",
                   help="how often a node sends its parent the ids it holds, so the parent "
                        "re-sends what it missed (default 10)")
    r.add_argument("--verbose", action="store_true", help="log every payload (DEBUG)")
    r.set_defaults(func=cmd_relay)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except DcrError as e:
        print(f"dcr: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
