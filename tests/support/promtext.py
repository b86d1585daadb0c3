"""Prometheus text, parsed by prometheus_client's own parser, for tests that scrape."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, frozenset[tuple[str, str]]]


def samples(text: str) -> dict[Key, float]:
    """Every sample of an exposition: (name, labels) -> value. Parsing fails on bad text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(parsed: dict[Key, float], name: str, **labels: str) -> float:
    """One sample's value; KeyError names what is missing and what the family has."""
    key = (name, frozenset(labels.items()))
    if key not in parsed:
        have = sorted(repr(dict(k[1])) for k in parsed if k[0] == name)
        raise KeyError(f"no sample {name}{labels}; {name} has {have or 'no samples'}")
    return parsed[key]


def matching(parsed: dict[Key, float], name: str, **labels: str) -> dict[frozenset, float]:
    """The samples of ``name`` whose labels include ``labels``: their label sets -> value."""
    want = set(labels.items())
    return {k[1]: v for k, v in parsed.items() if k[0] == name and want <= k[1]}
