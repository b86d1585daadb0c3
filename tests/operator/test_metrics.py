"""The operator's Prometheus instruments: what a scrape shows after refits, attempts and
fleet polls, parsed by prometheus_client's own parser."""

from __future__ import annotations

from promtext import matching, samples, value

from dcr.protocol.coordinator import AttemptResult
from dcr_operator.metrics import STAGE_BUCKETS, Metrics

FLEET = {"namespace": "team-a", "fleet": "policy"}


def test_attempts_count_by_mode_outcome_and_error_kind_and_time_their_stages() -> None:
    m = Metrics()
    failed = AttemptResult(attempt="a1", mode="mixed", receivers=("r0",), outcome="failed: x",
                           stages={"prepare": 0.2, "flush": 7.0}, error="AgentError")
    ok = AttemptResult(attempt="a2", mode="overwrite", receivers=("r0",),
                       outcome="committed", stages={"prepare": 0.1, "commit": 0.01})
    m.attempt_ended(failed, mode="mixed", outcome="Failed", **FLEET)
    m.attempt_ended(ok, mode="overwrite", outcome="Committed", **FLEET)
    s = samples(m.render())
    assert value(s, "dcr_operator_attempts_total", mode="mixed", outcome="Failed",
                 **FLEET) == 1
    assert value(s, "dcr_operator_attempts_total", mode="overwrite", outcome="Committed",
                 **FLEET) == 1
    assert value(s, "dcr_operator_attempt_failures_total", reason="AgentError", **FLEET) == 1
    assert len(matching(s, "dcr_operator_attempt_failures_total")) == 1  # commits: none
    assert value(s, "dcr_operator_attempt_stage_duration_seconds_count", stage="prepare") == 2
    assert value(s, "dcr_operator_attempt_stage_duration_seconds_sum",
                 stage="prepare") == 0.2 + 0.1
    # 7 s of flush lands in the 10 s bucket, not in the 5 s one.
    assert {5, 10} <= set(STAGE_BUCKETS)
    flush = {"stage": "flush"}
    assert value(s, "dcr_operator_attempt_stage_duration_seconds_bucket", le="5.0",
                 **flush) == 0
    assert value(s, "dcr_operator_attempt_stage_duration_seconds_bucket", le="10.0",
                 **flush) == 1


def test_a_commit_feeds_the_refit_histogram_bytes_version_and_time_per_fleet() -> None:
    m = Metrics()
    m.refit_committed(version=4, seconds=42.0, payload_bytes=1000, at=1.7e9, **FLEET)
    m.refit_committed(version=5, seconds=3.0, payload_bytes=500, at=1.8e9, **FLEET)
    m.refit_failed(reason="RetryLimitReached", **FLEET)
    s = samples(m.render())
    assert value(s, "dcr_operator_refits_total", outcome="Committed", **FLEET) == 2
    assert value(s, "dcr_operator_refits_total", outcome="Failed", **FLEET) == 1
    assert value(s, "dcr_operator_refit_failures_total", reason="RetryLimitReached",
                 **FLEET) == 1
    assert value(s, "dcr_operator_refit_duration_seconds_count", **FLEET) == 2
    assert value(s, "dcr_operator_refit_duration_seconds_sum", **FLEET) == 45.0
    assert value(s, "dcr_operator_refit_duration_seconds_bucket", le="5.0", **FLEET) == 1
    assert value(s, "dcr_operator_refit_duration_seconds_bucket", le="60.0", **FLEET) == 2
    assert value(s, "dcr_operator_payload_bytes_total", **FLEET) == 1500
    assert value(s, "dcr_operator_committed_version", **FLEET) == 5
    assert value(s, "dcr_operator_last_commit_timestamp_seconds", **FLEET) == 1.8e9


def test_fleet_polls_set_where_each_fleet_stands_and_a_deleted_fleet_drops_it() -> None:
    m = Metrics()
    other = {"namespace": "team-b", "fleet": "policy"}
    m.refit_committed(version=1, seconds=1.0, payload_bytes=1, at=1.0, **FLEET)
    m.fleet_polled(version=7, committed_at=2.0, receivers=10, behind=3, **FLEET)
    m.fleet_polled(version=0, committed_at=None, receivers=2, behind=0, **other)
    m.fleet_refits(unfinished=2, **FLEET)
    s = samples(m.render())
    # The record as polled wins over what this process committed (another one did since).
    assert value(s, "dcr_operator_committed_version", **FLEET) == 7
    assert value(s, "dcr_operator_last_commit_timestamp_seconds", **FLEET) == 2.0
    assert not matching(s, "dcr_operator_last_commit_timestamp_seconds", **other)
    assert value(s, "dcr_operator_fleet_receivers", **FLEET) == 10
    assert value(s, "dcr_operator_fleet_receivers_behind", **FLEET) == 3
    assert value(s, "dcr_operator_fleet_refits_unfinished", **FLEET) == 2
    # A polled fleet's outcome counters exist at 0 before anything fails.
    assert value(s, "dcr_operator_refits_total", outcome="Failed", **other) == 0
    for mode in ("mixed", "overwrite"):
        for outcome in ("Committed", "Failed", "Conflict"):
            assert value(s, "dcr_operator_attempts_total", mode=mode, outcome=outcome,
                         **other) == 0
    m.fleet_deleted(**FLEET)
    m.fleet_deleted(namespace="team-c", fleet="never-seen")  # no error
    s = samples(m.render())
    for gauge in ("dcr_operator_fleet_receivers", "dcr_operator_fleet_receivers_behind",
                  "dcr_operator_committed_version",
                  "dcr_operator_last_commit_timestamp_seconds",
                  "dcr_operator_fleet_refits_unfinished"):
        assert not matching(s, gauge, **FLEET), gauge
    assert value(s, "dcr_operator_fleet_receivers_behind", **other) == 0
    # Its counters and its refit histogram go too: nothing of a deleted fleet stays.
    assert not [k for k in s if {("namespace", "team-a"), ("fleet", "policy")} <= k[1]]


def churn(m: Metrics, namespace: str, fleet: str) -> None:
    """Everything a fleet's life records: polls, refits, attempts, failures."""
    where = {"namespace": namespace, "fleet": fleet}
    m.fleet_polled(version=1, committed_at=1.0, receivers=4, behind=1, **where)
    m.fleet_refits(unfinished=1, **where)
    m.refit_committed(version=2, seconds=3.0, payload_bytes=10, at=2.0, **where)
    m.refit_failed(reason="RetryLimitReached", **where)
    m.attempt_ended(AttemptResult(attempt="a1", mode="mixed", receivers=("r0",),
                                  outcome="failed: x", stages={"flush": 1.0},
                                  error="AgentError"), mode="mixed", outcome="Failed", **where)


def test_churned_fleets_leave_the_scrape_as_it_was() -> None:
    """Fails without forgetting a deleted fleet's counters and histograms: each of the
    100 deleted fleets kept 9 counter series at 0 (more once counted) and its refit
    histogram's 15; the 100 swept ones are the poll's second line (``keep_fleets``)."""
    m = Metrics()
    churn(m, "team-a", "stays")
    baseline = samples(m.render())
    for i in range(100):
        churn(m, "churn", f"fleet-{i}")
        m.fleet_deleted(namespace="churn", fleet=f"fleet-{i}")
    assert set(samples(m.render())) == set(baseline)  # the same series, no more
    for i in range(100):  # a refit that ended after its fleet went: swept by the poll
        churn(m, "late", f"fleet-{i}")
    assert m.keep_fleets([("team-a", "stays")]) == sorted(
        ("late", f"fleet-{i}") for i in range(100))
    assert set(samples(m.render())) == set(baseline)  # the same series, no more
