"""The number tables of docs/benchmarks.md, apply.md, trainer.md, evaluation-catchup.md and
evaluation-peer.md, and the fault campaign's in evaluation.md, written from bench/results
(``bench/evaluate.py`` writes docs/evaluation.md's others).

Each table sits between ``<!-- table NAME -->`` and ``<!-- /table -->`` in its doc and is
written from the JSON a benchmark left; the prose around the markers is written by hand.

    .venv/bin/python bench/doctables.py           # rewrite the tables (make tables)
    .venv/bin/python bench/doctables.py --check   # exit 1 if a doc differs from its JSON
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def table(head: list[str], body: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    """A markdown table: the columns ``left`` names align left, the others (numbers)
    right."""
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i in left else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def load(name: str) -> Any:
    return json.loads((RESULTS / f"{name}.json").read_text())


def pct(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}%"


def mb(n: float) -> str:
    if n < 1e5:
        return f"{n / 1e3:.0f} kB"
    return f"{n / 1e6:.0f} MB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# --- docs/benchmarks.md ----------------------------------------------------------------


def codec_size() -> str:
    rows = [[r["dataset"], pct(r["change_pct"]), pct(r["payload_pct_dense"], 3),
             f"{r['ratio_to_bound']:.3f}", f"{r['bytes_per_changed']:.3f}",
             f"{r['vs_full_xor']:.2f}x", f"{r['vs_int32_index_value']:.2f}x",
             pct(100 * r["overwrite_only_bytes"] / r["dense_bytes"], 3),
             pct(100 * r["dense_zstd1"] / r["dense_bytes"])]
            for r in load("codec")["results"]]
    return table(["dataset", "changed", "DCR payload, % of dense", "x entropy bound",
                  "bytes / changed", "vs full XOR + zstd-1",
                  "vs int32 index + value + zstd-1", "overwrite-only, % dense",
                  "dense zstd-1, % dense"], rows)


def codec_speed() -> str:
    rows = [[r["dataset"], f"{r['codec_encode_gbps_1t']:.2f}", f"{r['encode_gbps_1t']:.2f}",
             f"{r['encode_gbps_2t']:.2f}", f"{r['apply_gbps_1t']:.2f}",
             f"{r['apply_gbps_2t']:.2f}",
             f"{r['peak_traced_encode_bytes'] / 1e6:.0f} MB / "
             f"{r['peak_traced_apply_bytes'] / 1e6:.0f} MB"]
            for r in load("codec")["results"]]
    return table(["dataset", "codec encode GB/s, 1 thread", "`dcr diff` GB/s, 1 thread",
                  "2 threads", "decode + apply GB/s, 1 thread", "2 threads",
                  "peak traced memory, encode / apply"], rows)


def manifest() -> str:
    rows = []
    for r in load("manifest")["results"]:
        v2_pct = r["v2_pct_of_payload"]
        rows.append([r["model"], f"{r['tensors']:,}", pct(r["changed_pct"]),
                     f"{r['payload_bytes']:,} B", f"{r['v1_json_indent1']:,} B",
                     pct(r["v1_pct_of_payload"], 1), f"{r['v2']:,} B",
                     pct(v2_pct, 2 if v2_pct < 1 else 1), f"{r['v1_over_v2']:.1f}x",
                     f"{r['v2_over_binary_bound']:.2f}"])
    return table(["model", "tensors", "changed", "payload", "manifest v1", "% of payload",
                  "manifest v2", "% of payload", "smaller", "x binary bound"], rows)


def transport() -> str:
    rows = []
    for name, topology in (("transport", "per-node"), ("transport-shared", "shared")):
        d = load(name)
        setup, res = d["setup"], d["results"]
        label = f"{topology} {setup['link_mbit']:.0f} Mbit/s"
        nodes = setup["nodes"]
        for way, what in (("full", "full checkpoint"), ("dcr-s3", "DCR via S3"),
                          ("dcr-relay", "DCR via relay")):
            r = res[way]
            crossed = mb(r["boundary_bytes"])
            if topology == "per-node":
                copies = round(r["boundary_bytes"] / (setup["checkpoint_bytes"]
                                                      if way == "full" else r["payload_bytes"]))
                unit = "1 GiB" if way == "full" else "payload"
                crossed += f" ({copies} x {unit})"
            rows.append([label, what, f"{r['total_s']:.2f}", f"{r['publish_s']:.2f}",
                         crossed, f"{d['speedup_vs_full'][way]:.1f}x"])
        assert nodes == 4, nodes  # the prose says four nodes
    return table(["topology", "way", "total s", "publish s", "bytes across the boundary",
                  "speedup vs full"], rows, left=(0, 1))


def relay_owners() -> str:
    d = load("transport-relay-owners")
    rows = []
    for k, med in d["median"].items():
        runs = [r for r in d["runs"] if str(r["owners"]) == k]
        totals = [r["total_s"] for r in runs]
        rows.append([k, str(len(runs)), f"{med['total_s']:.2f}",
                     f"{min(totals):.2f}-{max(totals):.2f}", f"{med['publish_s']:.2f}",
                     mb(med["boundary_bytes"]), f"{med['total_over_first']:.2f}x",
                     f"{med['boundary_over_first']:.3f}x",
                     "yes" if all(r["exact"] for r in runs) else "NO"])
    return table(["owners", "runs", "median total s", "range s", "median publish s",
                  "bytes across the boundary", "time vs 1 owner", "bytes vs 1 owner",
                  "every node exact"], rows, left=(8,))


def protocol() -> str:
    d = load("protocol")
    return table(["measure", "result", "target"], [
        ["protocol overhead (a refit with nothing to send: prepare + gates + open_apply, "
         "flush, commit, finish)", f"{d['protocol_overhead_s']:.3f} s", "<= 0.5 s"],
        ["clean 1% refit, end to end, median of 3", f"{d['clean_refit_s_median']:.2f} s", ""],
        ["recovery: the first attempt's last payload is corrupted in the store, so every "
         "agent fails late; stop; overwrite retry; median of 3",
         f"{d['recovery_refit_s_median']:.2f} s", ""],
        ["recovery / clean", f"{d['recovery_over_clean']:.2f}x", "<= 3x"],
    ])


# --- docs/apply.md -----------------------------------------------------------------------

COVERAGE = {
    "transformers Llama": "transformers Llama",
    "vllm-reference moe (TP2)": "vLLM-layout MoE, TP2 with and without EP",
    "vllm-reference dense+fp8 o_proj (TP2)": "vLLM-layout dense model with FP8 `o_proj`, TP2",
}


def share(x: float) -> str:
    """A fraction as a percentage: whole when it is, else two decimals under 10%."""
    if abs(100 * x - round(100 * x)) < 1e-9:
        return f"{100 * x:.0f}%"
    return f"{100 * x:.2f}%" if x < 0.1 else f"{100 * x:.1f}%"


def coverage() -> str:
    cov = load("apply")["coverage"]
    rows = [[label, *(f"{100 * cov[key][c]:.1f}%".replace(".0%", "%")
                      for c in ("xor", "overwrite", "dense"))]
            for key, label in COVERAGE.items()]
    return table(["runtime", "xor", "overwrite", "dense"], rows)


CASES = {"adamw": "AdamW", "ulp-1%": "1%", "ulp-3%": "3%", "ulp-5%": "5%"}
METHODS = {  # the first case's rows say what each is; the others use the short name
    "dcr": ("DCR (payloads + manifest, in place through `load_weights`)", "DCR"),
    "dcr_staged": ("DCR, one loader call per tensor (`defer=False`)", "DCR, `defer=False`"),
    "vllm_patch": ("vLLM `load_checkpoint_weight_patches` (int32 index + BF16 value per "
                   "change, as `sparse_nccl` sends them)", "vLLM sparse patch"),
    "dense": ("dense `load_weights` of the whole checkpoint, from memory", "dense"),
}


def seconds(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def engines() -> str:
    d = load("engines")
    dense_bytes = d["model"]["dense_bytes"]
    rows = []
    for n, case in enumerate(d["cases"]):
        label = CASES[case["case"]]
        if case["case"] == "adamw":
            label += f" {100 * case['changed_fraction']:.2f}%"
        dense_best = case["methods"]["dense"]["best_s"]
        for i, (key, names) in enumerate(METHODS.items()):
            m, method = case["methods"][key], names[n > 0]
            wire = m["wire_bytes"]
            dcr = key == "dcr"
            rows.append([
                label if i == 0 else "", method, f"{wire:,}",
                share(wire / dense_bytes),
                seconds(m["best_s"]), seconds(m["median_s"]),
                f"{dense_bytes / m['best_s'] / 1e9:.1f}" if dcr else "",
                f"{m['best_s'] / dense_best:.2f}" if dcr else "",
                ("(the reference)" if n == 0 else "") if key == "dense"
                else ("yes" if m["bit_exact"] else "NO"),
            ])
    return table(["case", "method", "wire bytes", "share of dense", "apply best s",
                  "apply median s", "GB/s", "best / dense best", "bit-exact vs dense"], rows,
                 left=(0, 1, 8))


def reference() -> str:
    rows = []
    for r in load("apply")["throughput"]:
        rank = "TP1" if r["tp"] == 1 else f"TP{r['tp']} rank {r['rank']}"
        rows.append([rank, f"{r['apply_gbps']:.2f}",
                     f"{r.get('apply_gbps_rank_bytes', r['apply_gbps']):.2f}",
                     f"{r['decode_s']:.3f}", f"{r['scatter_s']:.3f}", f"{r['loader_s']:.3f}",
                     f"{r['intercept_s']:.3f}", f"{r['dense_refit_s']:.3f}",
                     f"{r['scratch_vs_largest']:.2f}"])
    return table(["rank", "apply GB/s (canonical bytes)", "GB/s (bytes the rank holds)",
                  "decode s", "scatter s", "loader s", "intercept s",
                  "dense refit through the same loader s", "scratch / largest tensor"], rows)


def expand() -> str:
    rows = []
    for r in load("expand")["rows"]:
        h, d = r["host"], r["device"]
        rows.append([f"TP{r['tp']} rank 0", f"{r['changed_pct']:.0f}%", f"{r['records']:,}",
                     f"{h['seconds']:.3f}", f"{d['seconds']:.3f}",
                     f"{r['device_over_host']:.2f}", f"{h['scatter_s']:.3f}",
                     f"{d['scatter_s']:.3f}", f"{d['expand_s']:.3f}",
                     "yes" if r["bit_exact"] else "NO"])
    return table(["rank", "changed", "records", "host path s", "device path s",
                  "device / host", "host scatter s", "device scatter s",
                  "of which expand s", "bit-exact"], rows, left=(0, 9))


# --- docs/evaluation-catchup.md, docs/evaluation-peer.md -----------------------------------

WAYS = {"replay": "replay the committed deltas", "snapshot": "snapshot + the deltas after it",
        "mirror": "copy the rollout cluster's mirror", "full": "download the full checkpoint",
        "peer": "take a live peer's copy", "rejoin": "the agent's rejoin from its history"}
WAYS |= {"relay": WAYS["rejoin"], "relay-peer": WAYS["peer"]}  # a relay fleet's pod


def catchup() -> str:
    d = load("catchup")
    full = {r["missed"]: r for r in d["results"] if r["way"] == "full"}
    rows = []
    for r in d["results"]:
        f = full[r["missed"]]
        how = WAYS[r["way"]]
        if r["route"] in ("replay", "snapshot"):
            how += f" ({r['deltas']} from v{r['from']})"
        if r["route"] == "peer":
            how += f" (v{r['from']}, {mb(r['peer_bytes'])} inside the cluster)"
        rows.append([str(r["missed"]), r.get("fleet", "store"), how, f"{r['seconds']:.1f}",
                     mb(r["boundary_bytes"]),
                     f"{f['boundary_bytes'] / r['boundary_bytes']:,.1f}x",
                     f"{f['seconds'] / r['seconds']:.2f}x",
                     "yes" if r["bit_exact"] else "NO"])
    return table(["versions missed", "fleet", "way", "seconds", "bytes across the link",
                  "fewer bytes than full", "faster than full", "bit-exact"], rows,
                 left=(0, 1, 2, 7))


def peer() -> str:
    d = load("modelexpress")["results"]
    rows = [[str(r["step"]), f"{r['changed_elements']:,}", f"{r['mx_bytes']:,}",
             f"{r['dcr_bytes']:,}", f"{r['mx_over_dcr']:.2f}x",
             "yes" if r["mx_bit_exact"] and r["dcr_bit_exact"] else "NO"]
            for r in d["steps"]]
    t = d["totals"]
    rows.append(["all", "", f"{t['mx_bytes']:,}", f"{t['dcr_bytes']:,}",
                 f"{t['mx_over_dcr']:.2f}x", ""])
    return table(["step", "elements changed", "ModelExpress 0.7.0 bytes", "DCR bytes",
                  "ModelExpress / DCR", "both bit-exact"], rows, left=(0, 5))


# --- docs/trainer.md ---------------------------------------------------------------------


def rank_owner() -> str:
    d = load("rank-owner")
    rows = [[f"v{r['version']}", f"{r['changed_elements']:,}", f"{r['offer_s']:.2f}",
             f"{r['write_s']:.2f}", f"{r['advance_s']:.2f}", mb(r["payload_bytes"]),
             f"{r['held_over_shard']:.3f}x"] for r in d["steps"][1:]]
    g = d["per_gib_of_shard"]
    rows.append(["per GiB of shard (median)", "", f"{g['offer']:.2f}", f"{g['write']:.2f}",
                 f"{g['advance']:.2f}", "", ""])
    return table(["step", "elements changed", "offer s", "write s", "advance s", "payloads",
                  "host memory / shard"], rows)


# --- docs/benchmarks.md, region sums -------------------------------------------------------


def region_sums() -> str:
    d = load("region-sums")
    rows = [[name, f"{c['seconds']:.3f}", f"{c['gb_per_s_of_tensor']:.2f}",
             f"{c['over_xxh3']:.1f}x"] for name, c in d["cases"].items()]
    return table([f"{d['tensor_bytes'] >> 20} MiB BF16 tensor", "seconds",
                  "GB/s of tensor", "time / xxh3"], rows)


# --- docs/benchmarks.md, the store's checks ------------------------------------------------


def store_checks_refit() -> str:
    d = load("store-checks")["refit"]
    rows = []
    for kind, r in d.items():
        b, a, x = r["before"], r["after"], r["after_over_before"]
        rows.append([kind, str(a["refits"]), f"{b['prepare_to_commit_s']:.3f}",
                     f"{a['prepare_to_commit_s']:.3f}", f"{x['prepare_to_commit_s']:.2f}x",
                     f"{b['total_s']:.3f}", f"{a['total_s']:.3f}", f"{x['total_s']:.2f}x",
                     f"{b['flush_s']:.3f} / {a['flush_s']:.3f}",
                     f"{b['commit_s'] + b['finish_s']:.3f} / "
                     f"{a['commit_s'] + a['finish_s']:.3f}"])
    return table(["refit", "refits", "prepare..commit s, before", "after", "after / before",
                  "whole refit s, before", "after", "after / before",
                  "flush s, before / after", "commit + finish s, before / after"], rows)


def store_checks_catch_up() -> str:
    d = load("store-checks")["catch_up"]
    how = {"replay": "replay every delta from a seed of v0",
           "snapshot": "newest snapshot + the deltas after it"}
    rows = [[how[route], f"{r['before_s']:.2f}", f"{r['after_s']:.2f}",
             f"{r['after_over_before']:.2f}x", mb(r["fetched_bytes"])]
            for route, r in d.items()]
    return table(["materialize the newest version by", "before s", "after s",
                  "after / before", "fetched"], rows)


def faults() -> str:
    d = load("faults")
    r = d["recovery_s"]
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(d["faults_by_kind"].items()))
    stages = ", ".join(f"{k} {n}" for k, n in sorted(d["kills_by_stage"].items()))
    runs = d["coordinator_runs_per_commit"]
    rows = [["seeds", f"{len(d['seeds'])} ({d['seeds'][0]}..{d['seeds'][-1]}), "
             f"{d['minutes']:g} min on {d['cpus']} cores"],
            ["refits committed / not", f"{d['refits_committed']} / {d['refits_not_committed']}"],
            ["faults landed, by kind", kinds], ["kills, by stage", stages],
            ["invariant violations", str(len(d["violations"]))],
            ["recovery after faults stop, p50 / p99 / max s",
             f"{r['p50']:.1f} / {r['p99']:.1f} / {r['max']:.1f} (bound {r['bound']:.0f}, "
             f"{r['n']} settles)"],
            ["attempts per commit, mean / max",
             f"{d['attempts_per_commit']['mean']:.2f} / {d['attempts_per_commit']['max']}"],
            ["coordinator processes per commit, mean / max",
             f"{runs['mean']:.2f} / {runs['max']}"]]
    return table(["fault campaign", "measured"], rows)


TABLES: dict[str, dict[str, Callable[[], str]]] = {
    "docs/benchmarks.md": {"codec-size": codec_size, "codec-speed": codec_speed,
                           "manifest": manifest, "transport": transport,
                           "relay-owners": relay_owners,
                           "protocol": protocol, "region-sums": region_sums,
                           "store-checks-refit": store_checks_refit,
                           "store-checks-catch-up": store_checks_catch_up},
    "docs/apply.md": {"coverage": coverage, "engines": engines, "reference": reference,
                      "expand": expand},
    "docs/evaluation-catchup.md": {"catchup": catchup},
    "docs/evaluation-peer.md": {"peer": peer},
    "docs/trainer.md": {"rank-owner": rank_owner},
    "docs/evaluation.md": {"faults": faults},
}


def render(text: str, tables: dict[str, Callable[[], str]], doc: str) -> str:
    for name, make in tables.items():
        pattern = re.compile(rf"(<!-- table {re.escape(name)} -->\n).*?(\n<!-- /table -->)",
                             re.DOTALL)
        found = pattern.search(text)
        if found is None:
            raise SystemExit(f"{doc}: no <!-- table {name} --> ... <!-- /table --> markers")
        text = text[:found.end(1)] + make() + text[found.start(2):]
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 naming each doc whose tables differ")
    args = ap.parse_args()
    stale = []
    for doc, tables in TABLES.items():
        path = ROOT / doc
        text = path.read_text()
        new = render(text, tables, doc)
        if new != text:
            stale.append(doc)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        sys.exit(f"tables differ from bench/results in {', '.join(stale)}: run "
                 "`make tables`")
    for doc in stale:
        print(f"rewrote the tables of {doc}")


if __name__ == "__main__":
    main()
