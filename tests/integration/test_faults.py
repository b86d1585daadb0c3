"""A short fault campaign (bench/faults.py): fixed seeds, every party a process, zero violations.

Each seed starts the main job's pods (``dcr serve`` + ``dcr agent``, each pod's staging
directory a small tmpfs), two ``dcr encoder`` owners and a coordinator process per refit
against a real S3 server behind Toxiproxy and the 5xx layer, draws kills, store faults,
link faults and full staging volumes from the seed, and hands the parties' answers to the
checker (bench/faultcheck.py, whose own test shows it fails on each kind of bad log). One
seed runs through a relay tree (``dcr relay`` processes), whose nodes are killed too.
Seeds that once found a bug stay here as regressions.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import faults

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SEEDS = (5, 10, 14)  # together: kills of each party kind, every store fault, partitions,
# and (with 217) six full staging volumes
RELAY_SEEDS = (37,)  # through the relay: its root and a leaf killed, two volumes filled
# Seeds that found a bug. 217: an engine killed at gate open was labelled with the commit
# after it restarted (the timing-exact regression: test_receiver_service.py::
# test_an_engine_restarted_while_its_label_is_retried_is_not_labelled_the_commit).
# 37 (relay): a full staging volume failed the attempt with an error naming no path
# (test_receiver_service.py::
# test_a_full_staging_volume_fails_the_attempt_naming_it_and_a_later_one_commits).
REGRESSIONS = (217,)
STEPS = 3


@pytest.mark.parametrize(("seed", "transport"), [(s, "store") for s in SEEDS + REGRESSIONS]
                         + [(s, "relay") for s in RELAY_SEEDS])
def test_a_seeded_fault_campaign_commits_and_breaks_no_invariant(
        seed: int, transport: str, tmp_path: Path) -> None:
    campaign = faults.run(seed, STEPS, tmp_path / f"seed-{seed}", transport=transport)
    assert [str(v) for v in campaign.report.violations] == []
    assert campaign.refits == STEPS, "a refit under faults never committed"
    assert len(campaign.report.recovery_s) == STEPS  # the fleet settled after each


def test_a_seed_replays_the_same_schedule() -> None:
    for transport in faults.TRANSPORTS:
        one = faults.schedule(5, 6, 3, 2, transport)
        assert one == faults.schedule(5, 6, 3, 2, transport)
        assert one != faults.schedule(6, 6, 3, 2, transport)


def test_the_staging_volume_draws_leave_a_seeds_other_faults_as_they_were() -> None:
    """Full volumes come from a generator of their own: seeds kept as regressions still
    draw the kills and toxics that found their bugs."""
    rng = random.Random(217)
    alone = [faults.draw(rng, 3, 2) for _ in range(3)]
    drawn = faults.schedule(217, 3, 3, 2)
    assert [(s.kill, s.toxics) for s in drawn] == [(s.kill, s.toxics) for s in alone]
    assert any(s.fill for s in drawn)
