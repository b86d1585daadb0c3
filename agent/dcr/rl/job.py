"""``make demo-rl``: GRPO (TRL) whose rollouts the fleet serves and DCR refits every step.

The main job's parts, in an RL loop: a small Llama trained by TRL's ``GRPOTrainer`` on
:mod:`dcr.rl.task`; rollout pods (``dcr serve`` and ``dcr agent`` with its client door)
reaching a real S3 server through emulated links; per optimizer step a refit through the
store by :mod:`dcr.integrations.trl` (no checkpoint written), one agent killed in the
middle of one refit. Per step it prints the reward, generate / train / refit seconds, the
refit's share of the step, tokens per second and the versions in the batch, checks every
pod bit-exact against a dense load of the trainer's weights, and (``--dense``) times a
full-checkpoint refit through the same store and links beside it. It writes
``summary.json`` and ``rl.png``. docs/trainer.md, "With TRL".

    python -m dcr.rl.job --steps 30 --out rl-out
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dcr.errors import ConfigError
from dcr.settings import add_options, from_args, option

log = logging.getLogger(__name__)
SIZES: dict[str, dict[str, int]] = {  # the model sizes the job and bench/rl.py run
    "tiny": {"hidden_size": 64, "intermediate_size": 172, "layers": 2},
    "small": {"hidden_size": 256, "intermediate_size": 688, "layers": 4},
    "main": {"hidden_size": 512, "intermediate_size": 1376, "layers": 8},  # dcr refit's
}


@dataclass(frozen=True, kw_only=True)
class RlSettings:
    """The RL main job: the model, the GRPO batch, the pods, the links, what breaks."""

    out: Path = option(Path("rl-out"), metavar="DIR", doc="working directory, emptied first")
    steps: int = option(30, metavar="K", doc="GRPO optimizer steps, each refit to every pod")
    size: Literal["tiny", "small", "main"] = option(
        "tiny", doc="the Llama's size: tiny (hidden 64, 2 layers, ~0.1M parameters: learns "
        "the task in minutes on 2 cores), small (256, 4 layers), main (dcr refit's 23M)")
    pods: int = option(2, metavar="N", doc="rollout pods, each a dcr serve and a dcr agent")
    prompts: int = option(4, metavar="N", doc="prompts per step")
    generations: int = option(8, metavar="G", doc="completions per prompt (GRPO's group)")
    max_tokens: int = option(16, metavar="N", doc="tokens per completion")
    lr: float = option(3e-3, doc="learning rate (constant; high, for a tiny model to learn "
                       "in few steps, which changes nearly every BF16 element each step; "
                       "RL fine-tuning's 1e-6..1e-5 changes a few percent)")
    kill_step: int = option(2, metavar="K", doc="kill a pod's agent in the middle of this "
                            "step's refit (0: never)")
    overlap: bool = option(False, doc="refit while the next batch is generated (one step "
                           "off) instead of before it")
    max_staleness: int | None = option(None, metavar="K", doc="drop samples with a token "
                                       "more than K versions behind the trainer")
    pause_mode: Literal["wait", "abort", "keep"] = option(
        "wait", doc="how the pods' gates pause their engines during a refit")
    dense: bool = option(False, doc="also time a full-checkpoint refit through the same "
                         "store and links after each DCR refit (the step-time ratio)")
    store_kind: Literal["s3", "file"] = option("s3", doc="s3: a real S3 server on loopback "
                                               "behind each pod's emulated link; file: a "
                                               "directory")
    link_mbit: float = option(200.0, metavar="MBIT", doc="each pod's link to the store")
    rtt_ms: float = option(20.0, metavar="MS", doc="each link's round-trip delay")
    seed: int = option(0, metavar="N", doc="seed of the weights and the samplers")

    def __post_init__(self) -> None:
        counts = {"steps": self.steps, "pods": self.pods, "prompts": self.prompts,
                  "max_tokens": self.max_tokens}
        for name, value in counts.items():
            if value < 1:
                raise ConfigError(f"RL job setting {name}={value} must be at least 1.")
        if self.generations < 2:
            raise ConfigError(f"--generations {self.generations}: GRPO compares at least 2 "
                              "completions of a prompt.")
        if not self.lr > 0:
            raise ConfigError(f"--lr {self.lr} must be positive.")
        if not 0 <= self.kill_step <= self.steps:
            raise ConfigError(f"--kill-step {self.kill_step} is outside 0..{self.steps}.")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr.rl.job", description=__doc__.split(
        "\n\n")[0])
    add_options(p, RlSettings)
    from dcr.rl.loop import run_rl

    summary = run_rl(from_args(RlSettings, p.parse_args(argv)))
    return 0 if summary["bit_exact"] else 1


@dataclass(frozen=True, kw_only=True)
class StepRow:
    """One GRPO step as the job prints and records it."""

    step: int
    reward: float
    generate_s: float
    train_s: float
    refit_s: float  # offer + the coordinator's refit (with any kill's rejoin)
    refit_share: float  # of the step's seconds
    step_s: float
    tokens_per_s: float  # completion tokens over generate seconds
    versions: dict[str, int]  # completion tokens per weight version
    dropped: int  # samples over the staleness bound, drawn again
    samples: int  # samples the reward functions saw
    versioned: int  # of them, those whose weight_versions cover every completion token
    changed_elements: int
    changed_share: float  # of the model's elements: what the step changed in BF16
    attempts: int
    bit_exact: bool
    killed: str | None
    dense_refit_s: float | None  # export + upload + every pod's download and dense load
    dcr_bytes: int | None  # down every pod's link during the DCR refit (None: no links)
    dense_bytes: int | None  # and during the dense refit


def summarize(s: RlSettings, rows: list[StepRow], parameters: int) -> dict[str, Any]:
    """The run's summary: settings, per-step rows, and the medians the docs quote."""
    def med(key: str) -> float:
        return float(statistics.median(getattr(r, key) for r in rows))

    dense = [r.dense_refit_s for r in rows if r.dense_refit_s is not None]
    sent = [(r.dcr_bytes, r.dense_bytes) for r in rows
            if r.dcr_bytes is not None and r.dense_bytes is not None]
    out: dict[str, Any] = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items()},
        "parameters": parameters, "rows": [asdict(r) for r in rows],
        "bit_exact": all(r.bit_exact for r in rows),
        "reward_first": rows[0].reward, "reward_last": rows[-1].reward,
        "median": {k: med(k) for k in ("generate_s", "train_s", "refit_s", "refit_share",
                                       "step_s", "tokens_per_s", "changed_share")},
    }
    if sent:
        out["median"]["dcr_bytes"] = statistics.median(a for a, _ in sent)
        out["median"]["dense_bytes"] = statistics.median(b for _, b in sent)
    if dense:
        other = statistics.median(r.generate_s + r.train_s for r in rows)
        dense_step = other + statistics.median(dense)
        out["median"]["dense_refit_s"] = statistics.median(dense)
        out["median"]["dense_refit_share"] = statistics.median(dense) / dense_step
        out["dense_step_ratio"] = dense_step / (other + med("refit_s"))
    return out


def write_summary(out: Path, summary: dict[str, Any]) -> Path:
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return path


def environment() -> None:
    """Quiet libraries for a job that prints its own table."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
    warnings.filterwarnings("ignore", message=".*PAD/BOS/EOS.*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["SIZES", "RlSettings", "StepRow", "environment", "main", "summarize",
           "write_summary"]
