"""A fleet of 100 receivers refit by the real operator (tests/support/farm.py): the refit
commits bit-exact on every engine, status stays small, and the agents' store requests do
not grow with the time they wait. bench/scale.py runs the same at 10, 100 and 1,000."""

from __future__ import annotations

from pathlib import Path

import pytest
from controlplane import ControlPlane
from farm import ScaleFleet
from transitions import reference_transition

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

N = 100


def test_a_fleet_of_100_receivers_commits_bit_exact_with_small_status(
        control_plane: ControlPlane, helm: Path, tmp_path: Path) -> None:
    if not control_plane.has_controller_manager:
        pytest.skip("no kube-controller-manager: encoder Jobs would never get pods")
    with ScaleFleet(control_plane, helm, N, tmp_path, reference_transition()) as fleet:
        r = fleet.refit()
        status = r["refit"]["status"]
        assert r["phase"] == "Committed", status
        assert status["receiverCount"] == N
        (attempt,) = status["attempts"]
        assert (attempt["outcome"], attempt["receiverCount"]) == ("Committed", N)
        assert fleet.farm.exact()
        # Status stays small: counts and a capped list, not one entry per receiver.
        assert len(status.get("receivers", [])) <= 100
        assert r["weightrefit_status_bytes"] < 64 * 1024
        assert r["rolloutfleet_status_bytes"] < 64 * 1024
        # Every agent read at least its attempt's manifest from the store. (How many lists
        # the waits cost depends on how long they wait: bench/scale.py reports it.)
        assert r["agent_store_requests"].get("get", 0) >= N
