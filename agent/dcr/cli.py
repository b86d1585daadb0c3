"""The ``dcr`` command line: diff, patch, inspect, relay, encode, encoder, agent, serve, refit.

A command's options are built only when it runs, so ``dcr encode``, started once per
attempt, imports neither the relay node nor the main job (docs/cli.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcr.checkpoint import Checkpoint
from dcr.errors import AttemptError, ConfigError, DcrError, ObjectNotFound, StoreError
from dcr.files.inspect import (
    NO_HISTORY,
    committed_manifest,
    describe,
    history_report,
    render,
    render_history,
)
from dcr.files.patch import load_manifest, patch_checkpoint
from dcr.format.profile import load_profile
from dcr.owner.diff import diff_checkpoints, encode_summary
from dcr.owner.settings import EncodeSettings
from dcr.protocol import termination
from dcr.settings import add_options, doc, from_args
from dcr.transport.store import Store, open_store

if TYPE_CHECKING:  # the relay node loads only when ``dcr relay`` runs
    from dcr.transport.relay import RelaySettings

EPILOG = r"""examples:
  dcr diff ckpt/v1 ckpt/v2 --store file:///tmp/deltas --version 2 --json
  dcr patch rollout/ckpt --store file:///tmp/deltas --version 2
  dcr inspect --store file:///tmp/deltas --version 2
  dcr refit --kill-receiver-every 2
  dcr relay --listen 0.0.0.0:8470 --members r0:8470,r1:8470,r2:8470 --index 1 \
            --token-file /etc/dcr/read-token --publish-token-file /etc/dcr/publish-token
  dcr encoder --listen 0.0.0.0:8472 --token-file /etc/dcr/encoder-token \
              --store s3://rl-weights/policy-a --checkpoint-root /checkpoints
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


STORE_WRITE_HELP = ("where to write: file:///abs/path (or a plain path), s3://bucket/prefix "
                    "(credentials and endpoint from the AWS_* environment), or "
                    "relay+http(s)://host:port, a relay tree's root (?through=URI also "
                    "writes every object to that store: a relay fleet's history)")
HISTORY_DIGEST_HELP = ("BLAKE2b-128 the history object must have (else the store's is "
                       "trusted)")
COMMIT_FILE_HELP = ("the fleet's commit file (its <fleet>-commit ConfigMap, mounted): the "
                    "version to build and the history digest that vouches for it; while "
                    "it is missing, the store's newest history is trusted")
STORE_READ_HELP = ("the store version N is in: file:///abs/path (or a plain path) or "
                   "s3://bucket/prefix (credentials and endpoint from the AWS_* environment)")


def version(text: str) -> int:
    """A version number on the command line: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a version (versions start at 0)")
    return value


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
        d.add_argument("--store", required=True, metavar="URI", help=STORE_WRITE_HELP)
        d.add_argument("--base-version", type=version, metavar="M",
                       help=f"{doc(EncodeSettings, 'base_version')} (default N-1)")
        add_options(d, EncodeSettings, skip=("base_version", *skip), required=required)
        if not per_attempt:
            d.add_argument("--replace", action="store_true",
                           help="write over a manifest the store already holds for version "
                           "N (without it, that is refused: patches may be reading it)")
        d.add_argument("--json", action="store_true", help="print one JSON summary object")
        d.set_defaults(func=cmd_diff, attempt_manifest=per_attempt)


def encode_settings(args: argparse.Namespace) -> EncodeSettings:
    """What ``dcr diff`` or ``dcr encode`` was told (the profile file not read yet)."""
    return from_args(
        EncodeSettings, args, attempt_manifest=args.attempt_manifest,
        base_version=args.target_version - 1 if args.base_version is None else args.base_version)


def cmd_diff(args: argparse.Namespace) -> None:
    settings = encode_settings(args)
    if settings.profile_path is not None:
        settings = replace(settings, profile=load_profile(settings.profile_path))
    store = open_store(args.store)
    replaced = None if settings.per_attempt_manifest else _held_manifest(store, settings, args)
    t0 = time.perf_counter()
    with Checkpoint(Path(args.base)) as base, Checkpoint(Path(args.target)) as target:
        total = sum(i.nbytes for i in base)
        with _progress(total, "diff", not args.json) as bar:
            m = diff_checkpoints(base, target, store, settings, bar)
    seconds = time.perf_counter() - t0
    st = m.stats
    summary = encode_summary(m, seconds=seconds, store=store.uri)
    if replaced is not None:  # its payloads stay: a patch may still be reading them
        summary["replaced_attempt"] = replaced
    pct = 100 * st.changed_elements / max(1, st.total_elements)
    text = (
        f"version {m.base_version} -> {m.target_version} ({m.mode}, attempt {m.attempt}): "
        f"{st.changed_elements:,} of {st.total_elements:,} elements changed ({pct:.3f}%) in "
        f"{st.tensors} tensors; {len(m.payloads)} payloads, {st.payload_bytes:,} bytes = "
        f"{100 * st.payload_bytes / max(1, st.dense_bytes):.3f}% of {st.dense_bytes:,} dense "
        f"bytes; {seconds:.2f} s"
    )
    _emit(args, summary, text)


def _held_manifest(store: Store, settings: EncodeSettings, args: argparse.Namespace
                   ) -> str | None:
    """The attempt of the manifest ``store`` holds for the version, if any; refused unless
    ``--replace`` (a second diff of a version would replace what patches read)."""
    try:
        attempt = load_manifest(store, settings.target_version).attempt
    except ObjectNotFound:
        return None
    except AttemptError:  # a damaged manifest is replaced the same way
        attempt = "unreadable"
    except StoreError as e:  # no credentials, no endpoint: not a version held
        raise StoreError(f"Cannot tell whether {store.uri} holds version "
                         f"{settings.target_version}: {e}") from e
    if not args.replace:
        raise ConfigError(f"{store.uri} already holds version {settings.target_version} (attempt "
                          f"{attempt}); dcr diff --replace writes over its manifest.")
    return attempt


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
    try:
        m = load_manifest(store, args.version)  # what `dcr diff` wrote
    except ObjectNotFound:  # a coordinator's commit: its owners' parts, by the history
        m = committed_manifest(store, args.version, args.history_digest)
    report = describe(store, m)
    _emit(args, report, render(report))


def cmd_history(args: argparse.Namespace) -> None:
    report = history_report(open_store(args.store), args.history_digest)
    _emit(args, report, render_history(report))


def cmd_agent(args: argparse.Namespace) -> None:
    import logging

    from dcr.receiver.main import run
    from dcr.receiver.settings import AgentSettings

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,  # as dcr serve's, not warnings
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(from_args(AgentSettings, args))


def cmd_serve(args: argparse.Namespace) -> None:
    import logging

    from dcr.serve.main import run
    from dcr.serve.settings import ServeSettings

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(from_args(ServeSettings, args))


def cmd_refit(args: argparse.Namespace) -> None:
    from dcr.refit.job import RefitSettings, run_refit
    from dcr.refit.trainer import TrainerSettings

    run_refit(from_args(RefitSettings, args, trainer=from_args(TrainerSettings, args)))


def relay_settings(args: argparse.Namespace) -> RelaySettings:
    """``dcr relay``'s settings: the generated options, the member list and the tokens."""
    from dcr.http.tokens import read_token
    from dcr.transport.relay import RelaySettings

    members = tuple(m.strip() for m in args.members.split(",") if m.strip())
    return from_args(RelaySettings, args, members=members,
                     token=read_token("relay read token", args.token_file),
                     publish_token=read_token("relay publish token", args.publish_token_file))


def cmd_relay(args: argparse.Namespace) -> None:
    import logging

    from dcr.transport.relay import run_relay

    settings = relay_settings(args)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_relay(settings)


def cmd_encoder(args: argparse.Namespace) -> None:
    from dcr.owner.server import EncoderServerSettings, run

    run(from_args(EncoderServerSettings, args))


def _encoder_options(p: argparse.ArgumentParser) -> None:
    from dcr.owner.server import EncoderServerSettings

    add_options(p, EncoderServerSettings)
    p.set_defaults(func=cmd_encoder)


def _agent_options(p: argparse.ArgumentParser) -> None:
    from dcr.receiver.main import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_agent)


def _serve_options(p: argparse.ArgumentParser) -> None:
    from dcr.serve.main import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_serve)


def _refit_options(p: argparse.ArgumentParser) -> None:
    from dcr.refit.job import RefitSettings
    from dcr.refit.trainer import TrainerSettings

    add_options(p, RefitSettings)
    add_options(p.add_argument_group("trainer"), TrainerSettings)
    p.set_defaults(func=cmd_refit)


def _relay_options(p: argparse.ArgumentParser) -> None:
    from dcr.transport.relay import RelaySettings
    from dcr.transport.relay.settings import EDGE_PARSED

    p.add_argument("--members", required=True, metavar="H:P,H:P,...",
                   help="comma-separated: " + doc(RelaySettings, "members"))
    p.add_argument("--token-file", required=True, type=Path, metavar="PATH",
                   help="file holding the read token: agents' reads (GET)")
    p.add_argument("--publish-token-file", required=True, type=Path, metavar="PATH",
                   help="file holding the publish token: owners' pushes, and members' "
                   "forwards, deletes and subscriptions (PUT, DELETE, POST)")
    add_options(p, RelaySettings, skip=EDGE_PARSED, required=("listen",))
    p.add_argument("--verbose", action="store_true", help="log every payload (DEBUG)")
    p.set_defaults(func=cmd_relay)


# Commands whose options come from settings in heavier modules: (name, help, options).
_BUILT_WHEN_RUN: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "agent": ("run a rollout pod's agent sidecar (HTTP control API) driving a serving engine",
              _agent_options),
    "serve": ("run the reference serving engine (vLLM's HTTP dialect, DCR's plugin in "
              "every rank) for tests and the demo", _serve_options),
    "refit": ("the main job and the demo: train, refit agent processes after every step, "
              "recover from kills, verify bits, plot", _refit_options),
    "relay": ("run one relay tree node until SIGTERM", _relay_options),
    "encoder": ("run a warm encoder: an owner endpoint that publishes attempts over HTTP "
                "(what an encoder Job does per attempt, without a process per attempt)",
                _encoder_options),
}


def committed(args: argparse.Namespace) -> tuple[int | None, str | None]:
    """The version to build and the history digest that vouches for it: from
    ``--commit-file`` (read again on every call: a kubelet updates a mounted ConfigMap
    within its sync period), else ``--version`` and ``--history-digest``, else the store's
    newest history, trusted (docs/two-clusters.md, "What a pod is told")."""
    import logging

    from dcr.format.commitfile import read_commit_file

    if args.commit_file is None:
        return getattr(args, "version", None), args.history_digest
    if getattr(args, "version", None) is not None or args.history_digest is not None:
        raise ConfigError(f"--commit-file {args.commit_file} gives the version and the "
                          "history digest; --version and --history-digest contradict it.")
    pinned = read_commit_file(Path(args.commit_file))
    if pinned is None:
        logging.getLogger("dcr.cli").warning(
            "%s: no commit file (its optional volume is empty until the fleet's first "
            "commit): building the newest version the store's own history names, trusting "
            "whoever may write %s", args.commit_file, args.store)
        return None, None
    return pinned.committed_version, pinned.history_digest


def cmd_materialize(args: argparse.Namespace) -> None:
    from dcr.files.inspect import NoHistory
    from dcr.files.materialize import materialize
    from dcr.format.history import HISTORY_KEY
    from dcr.format.layout import manifest_key

    out = Path(args.out)
    store = open_store(args.store)
    args.version, args.history_digest = committed(args)  # the rest builds what it says
    # No history and nothing to start from, or a version `dcr diff` wrote: nothing to build.
    diffed = args.seed is None or store.exists(manifest_key(args.version or 1))
    if args.history_digest is None and diffed and not store.exists(HISTORY_KEY):
        raise NoHistory(NO_HISTORY.format(uri=store.uri))
    t0 = time.perf_counter()
    done = materialize(store, out, version=args.version, held=args.held,
                       seed=Path(args.seed) if args.seed else None,
                       digest=args.history_digest)
    seconds = time.perf_counter() - t0
    p = done.plan
    summary = {"version": p.target, "route": p.route, "from": p.start, "deltas": p.steps,
               "fetched_bytes": done.fetched_bytes, "out": str(out),
               "seconds": round(seconds, 4), "refused": list(done.refused)}
    via = {"held": "already held", "replay": f"{p.steps} deltas replayed from version "
           f"{p.start}", "snapshot": f"the snapshot of version {p.start} and {p.steps} "
           "deltas"}[p.route]
    tried = f"; refused first: {'; '.join(done.refused)}" if done.refused else ""
    _emit(args, summary, f"{out}: version {p.target} from {via} (route {p.route}{tried}); "
                         f"{done.fetched_bytes:,} bytes fetched; every file checked; "
                         f"{seconds:.2f} s")


def cmd_mirror(args: argparse.Namespace) -> None:
    import signal
    import threading

    from dcr.files.mirror import sync

    store, root = open_store(args.store), Path(args.dir)
    seed = (args.held, Path(args.seed)) if args.seed else None
    stop = threading.Event()
    if not args.once:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while True:
        t0 = time.perf_counter()
        try:
            want, digest = committed(args)
            done = sync(store, root, version=want, seed=seed, digest=digest, keep=args.keep)
        except DcrError as e:
            if args.once:
                raise
            print(f"dcr mirror: {root}: this sync failed, the current generation stays: "
                  f"{e}", file=sys.stderr, flush=True)
        else:
            if done.built is not None or args.once:
                b = done.built
                summary = {"version": done.current.version, "path": str(done.current.path),
                           "route": b.plan.route if b else "held",
                           "fetched_bytes": b.fetched_bytes if b else 0,
                           "removed": [p.name for p in done.removed],
                           "seconds": round(time.perf_counter() - t0, 4)}
                _emit(args, summary, f"{root}: version {done.current.version} current "
                      f"({summary['fetched_bytes']:,} bytes fetched, "
                      f"{summary['seconds']:.2f} s)")
        if args.once or stop.wait(args.interval):
            return


def cmd_snapshot(args: argparse.Namespace) -> None:
    from dcr.files.history import HistoryStore
    from dcr.files.snapshot import write_snapshot

    store, root = open_store(args.store), Path(args.checkpoint)
    hs = HistoryStore(store)
    want = hs.fingerprints(hs.read(), args.version)  # only versions the history vouches for
    snap = write_snapshot(store, root, args.version, expect=want)
    digest = hs.snapshot(snap) if args.record else None
    _emit(args, {"version": args.version, "bytes": snap.bytes, "index": snap.index.key,
                 "history_digest": digest},
          f"snapshot of version {args.version}: {snap.bytes:,} bytes under "
          f"{snap.index.key.rsplit('/', 1)[0]}/; "
          + ("recorded in the history" if args.record
             else "the coordinator's next commit adopts it into the history"))


def package_version() -> str:
    """The installed distribution's version (``dcr --version``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dcr")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; a command of :data:`_BUILT_WHEN_RUN` gets its options only when it is
    ``command`` (or ``command`` is None)."""
    p = argparse.ArgumentParser(
        prog="dcr",
        description="Delta-Compressed Refit: ship only the changed bits of a checkpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"dcr {package_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_encode_commands(sub)

    pa = sub.add_parser("patch", help="apply version N in place to a checkpoint at its base")
    pa.add_argument("checkpoint", metavar="CKPT", help="HF checkpoint dir or .safetensors file")
    pa.add_argument("--store", required=True, metavar="URI", help=STORE_READ_HELP)
    pa.add_argument("--version", type=version, required=True, metavar="N",
                    help="the version to reach; CKPT must hold its base version")
    pa.add_argument("--json", action="store_true", help="print one JSON summary object")
    pa.set_defaults(func=cmd_patch)

    ma = sub.add_parser("materialize", help="build a committed version's checkpoint from "
                        "the store alone (snapshot plus deltas, every file checked)")
    ma.add_argument("--store", required=True, metavar="URI",
                    help="the store the history is in (file://, s3://)")
    ma.add_argument("--out", required=True, metavar="DIR",
                    help="the checkpoint directory to write or advance")
    ma.add_argument("--version", type=version, metavar="N",
                    help="the version to build (default: the newest committed)")
    ma.add_argument("--held", type=version, metavar="N", help="DIR already holds version N "
                    "(checked by fingerprints first): replay the deltas after it if cheaper")
    ma.add_argument("--seed", metavar="DIR", help="a checkpoint of version --held this pod "
                    "has (the run's public starting model), or one that records its version "
                    "(a mirror's current generation): DIR starts as its copy, unless an "
                    "earlier run recorded a version there")
    ma.add_argument("--history-digest", metavar="HEX", help=HISTORY_DIGEST_HELP)
    ma.add_argument("--commit-file", metavar="PATH", help=COMMIT_FILE_HELP)
    ma.add_argument("--json", action="store_true", help="print the summary as JSON")
    ma.set_defaults(func=cmd_materialize)

    mi = sub.add_parser("mirror", help="keep a rollout cluster's dense copy of the committed "
                        "version current, in whole generations (pods start from it)")
    mi.add_argument("--store", required=True, metavar="URI",
                    help="the store the history is in (file://, s3://)")
    mi.add_argument("--dir", required=True, metavar="DIR",
                    help="the mirror: generations v<N>/ and the symlink current")
    mi.add_argument("--seed", metavar="DIR", help="a checkpoint of version --held to start "
                    "from while the mirror holds nothing (default: the newest snapshot)")
    mi.add_argument("--held", type=version, metavar="N", help="the version --seed holds")
    mi.add_argument("--keep", type=int, default=2, metavar="N",
                    help="generations kept, the current one included (default 2: a reader "
                    "of the previous one can finish)")
    mi.add_argument("--interval", type=float, default=10.0, metavar="S",
                    help="seconds between reads of the history (default 10)")
    mi.add_argument("--once", action="store_true", help="sync once and exit (an error "
                    "exits non-zero)")
    mi.add_argument("--history-digest", metavar="HEX", help=HISTORY_DIGEST_HELP)
    mi.add_argument("--commit-file", metavar="PATH", help=COMMIT_FILE_HELP + "; read "
                    "again before every sync")
    mi.add_argument("--json", action="store_true", help="print each sync's summary as JSON")
    mi.set_defaults(func=cmd_mirror)

    sn = sub.add_parser("snapshot", help="put a committed version's checkpoint in the store "
                        "as a snapshot (checked against the history's fingerprints)")
    sn.add_argument("checkpoint", metavar="CKPT", help="the version's checkpoint directory")
    sn.add_argument("--store", required=True, metavar="URI",
                    help="the store the history is in (file://, s3://)")
    sn.add_argument("--version", type=version, required=True, metavar="N",
                    help="a version the history vouches for")
    sn.add_argument("--record", action="store_true",
                    help="record it in the history now: only where no coordinator writes "
                    "the history (one that does adopts snapshots at its next commit)")
    sn.add_argument("--json", action="store_true", help="print the summary as JSON")
    sn.set_defaults(func=cmd_snapshot)

    i = sub.add_parser("inspect", help="summarise the delta of version N (one `dcr diff` "
                       "wrote, or one a coordinator committed)")
    i.add_argument("--store", required=True, metavar="URI", help=STORE_READ_HELP)
    i.add_argument("--version", type=version, required=True, metavar="N",
                   help="the version whose delta to describe")
    i.add_argument("--history-digest", metavar="HEX", help=HISTORY_DIGEST_HELP)
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(func=cmd_inspect)

    h = sub.add_parser("history", help="list what a store's history commits and keeps: "
                       "versions, their attempts and bytes, snapshots")
    h.add_argument("--store", required=True, metavar="URI",
                   help="the store the history is in (file://, s3://)")
    h.add_argument("--history-digest", metavar="HEX", help=HISTORY_DIGEST_HELP)
    h.add_argument("--json", action="store_true", help="print the report as JSON")
    h.set_defaults(func=cmd_history)

    for name, (help_, options) in _BUILT_WHEN_RUN.items():
        # No abbreviations: a flag that moved elsewhere (the agent's --model is dcr
        # serve's now) must be refused, not taken for a prefix of another (--model-version).
        sp = sub.add_parser(name, help=help_, allow_abbrev=False)
        if command in (None, name):
            options(sp)
    return p


REFERENCE_MARK = "<!-- generated by `make cli-doc` from the settings classes: edit those -->"


def reference() -> str:
    """Every command's ``--help`` as Markdown, at a fixed width: the generated part of
    ``docs/cli.md`` (a test keeps the two in sync)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = [REFERENCE_MARK, ""]
    for name, sp in sub.choices.items():
        sp.formatter_class = functools.partial(argparse.HelpFormatter, width=100)
        parts += [f"## `dcr {name}`", "", "```", sp.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def write_reference(doc: Path = CLI_DOC) -> None:
    """Replace the generated part of ``doc`` (from :data:`REFERENCE_MARK` on)."""
    text = doc.read_text()
    doc.write_text(text[:text.index(REFERENCE_MARK)] + reference())


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        args.func(args)
    except DcrError as e:
        termination.write(e)
        print(f"dcr: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        termination.write(e)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
