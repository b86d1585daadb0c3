"""Prometheus text exposition of values read at scrape time, shared by the agent's and
``dcr serve``'s ``/metrics`` (the operator keeps live instruments in its own registry).

A thin layer over ``prometheus_client``: a scrape builds the families from the process's
current state and renders them in the text format.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Family:
    name: str  # a counter's name ends in _total, as it is exported
    kind: str  # "counter" or "gauge"
    help: str
    samples: list[tuple[Labels, float]]  # (labels, value)

    def metric(self) -> Metric:
        names = sorted({k for labels, _ in self.samples for k in labels})
        family: CounterMetricFamily | GaugeMetricFamily
        if self.kind == "counter":
            family = CounterMetricFamily(self.name, self.help, labels=names)
        else:
            family = GaugeMetricFamily(self.name, self.help, labels=names)
        for labels, value in self.samples:
            family.add_metric([labels.get(k, "") for k in names], value)
        return family


class _Snapshot(Collector):
    def __init__(self, families: Iterable[Family]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return (f.metric() for f in self.families)


def render(families: Iterable[Family]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(registry).decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` whose labels include ``labels`` in an exposition
    (parsed by prometheus_client); None when there is none."""
    want = labels.items()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and want <= s.labels.items():
                return float(s.value)
    return None
