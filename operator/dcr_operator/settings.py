"""The operator's settings: one tree, parsed once from the environment at startup.

Each field is declared once, here, with :func:`setting`: its variable
(``DCR_OPERATOR_<FIELD>``), its unit (in its name), default, bounds, why (its doc), and the
Helm value that sets it (a path into ``charts/dcr/values.yaml``). The chart's values schema
is generated from these declarations (``python -m dcr_operator.values_schema``), and a test
holds the chart's deployment template and ``values.yaml`` to them. An unknown
``DCR_OPERATOR_*`` variable, a value that does not parse, or one out of bounds is an error
naming it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from dcr.errors import ConfigError
from dcr.settings import option

PREFIX = "DCR_OPERATOR_"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")

# A bound, by its JSON-schema keyword: does a value keep it, and how an error says it.
BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "minimum": (operator.ge, ">="),
    "exclusiveMinimum": (operator.gt, ">"),
    "maximum": (operator.le, "<="),
}
POSITIVE = {"exclusiveMinimum": 0}  # an interval or deadline: 0 would spin or give up at once


@dataclass(frozen=True, kw_only=True)
class Declared:
    """What a field declares besides its default and doc."""

    value: str  # the Helm value that sets it: a dotted path into charts/dcr/values.yaml
    bounds: Mapping[str, float]  # BOUNDS keyword -> limit, kept by the field and the chart
    choices: tuple[str, ...]  # the only values allowed; () allows any
    # The chart value's JSON schema where its form differs from the field's (a list the
    # template joins with commas, a narrower range), over what the field implies.
    chart: Mapping[str, Any]


def setting(default: Any, *, doc: str, value: str, bounds: Mapping[str, float] | None = None,
            choices: tuple[str, ...] = (), chart: Mapping[str, Any] | None = None) -> Any:
    """A field of :class:`OperatorSettings`: ``doc`` says what it does and why the default;
    ``value`` names the Helm value that sets it."""
    declared = Declared(value=value, bounds=dict(bounds or {}), choices=choices,
                        chart=dict(chart or {}))
    base = option(default, doc=doc, cli=False)
    return dataclasses.field(default=default, metadata={**base.metadata, "declared": declared})


def env_name(field: dataclasses.Field[Any]) -> str:
    """The environment variable that sets ``field``."""
    return PREFIX + field.name.upper()


def declared(field: dataclasses.Field[Any]) -> Declared:
    """What ``field`` declares (every field of :class:`OperatorSettings` declares it)."""
    found: Declared = field.metadata["declared"]
    return found


@dataclass(frozen=True, kw_only=True)
class OperatorSettings:
    encoder_image: str = setting(
        "ghcr.io/dcr-dev/dcr:0.1.0", value="encoder.image",
        doc="The image encoder Jobs run (it must provide the `dcr` command), unless a "
            "RolloutFleet's encoder profile names another that the allowed images admit. "
            "The chart's empty default is the operator's own image.")
    encoder_image_pull_policy: str = setting(
        "IfNotPresent", value="encoder.pullPolicy", choices=PULL_POLICIES,
        doc="imagePullPolicy of encoder pods.")
    encoder_images: str = setting(
        "", value="encoder.allowedImages",
        chart={"type": "array",
               "items": {"type": "string", "minLength": 1, "pattern": "^[^,\\s]+$"}},
        doc="Images a RolloutFleet's encoder profiles may name besides the encoder image, "
            "comma-separated in the variable (a list in the chart); an entry ending in "
            "\"*\" allows every image that starts with the rest (\"registry.example/dcr:*\"). "
            "Empty: the encoder image only. The cluster admin's say over what the "
            "operator's Jobs run, whoever writes the fleets.")
    encoder_service_account: str = setting(
        "", value="encoder.serviceAccount",
        doc="ServiceAccount of encoder pods (empty: the namespace's default), unless the "
            "fleet's encoder profile names another.")
    encoder_ttl_seconds: int = setting(
        0, value="encoder.ttlSecondsAfterFinished", bounds={"minimum": 0},
        doc="ttlSecondsAfterFinished of encoder Jobs; 0 keeps them until their WeightRefit "
            "is deleted (owner references then remove them), which keeps them inspectable.")
    job_poll_seconds: float = setting(
        1.0, value="settings.jobPollSeconds", bounds=POSITIVE,
        doc="Seconds between polls of an encoder Job's status while an attempt waits for "
            "it.")
    retry_seconds: float = setting(
        10.0, value="settings.retrySeconds", bounds=POSITIVE,
        doc="Seconds before a refit that waits (base version not committed yet, fleet busy, "
            "too few receivers, API server unreachable) is looked at again.")
    fleet_status_seconds: float = setting(
        30.0, value="settings.fleetStatusSeconds", bounds=POSITIVE,
        doc="Seconds between polls of every fleet's agents for status.receivers and Ready.")
    cleanup_store: bool = setting(
        True, value="settings.cleanupStore",
        doc="Delete a WeightRefit's payloads from the store when it is deleted (the "
            "finalizer).")
    cleanup_give_up_seconds: float = setting(
        300.0, value="settings.cleanupGiveUpSeconds", bounds=POSITIVE,
        doc="Seconds the finalizer keeps retrying a store it cannot clean before giving up "
            "(with a Warning event) so the WeightRefit can still be deleted.")
    peering_lifetime_seconds: int = setting(
        60, value="peering.lifetimeSeconds", bounds={"minimum": 2},
        doc="Seconds a peering record lives without a keepalive. A crashed operator's record "
            "pauses its successor of the same priority this long; a lower-priority standby "
            "takes over once it expires.")
    metrics_port: int = setting(
        8081, value="metrics.port", bounds={"minimum": 0, "maximum": 65535},
        chart={"minimum": 1},
        doc="Port of the Prometheus endpoint (GET /metrics on all addresses); 0 turns it "
            "off, which the chart's metrics.enabled: false sets.")

    def __post_init__(self) -> None:
        for f in fields(self):
            value, rules = getattr(self, f.name), declared(f)
            if rules.choices and value not in rules.choices:
                raise ConfigError(f"{env_name(f)}={value!r} is not one of "
                                  f"{', '.join(rules.choices)}.")
            for keyword, limit in rules.bounds.items():
                holds, says = BOUNDS[keyword]
                if not holds(value, limit):
                    raise ConfigError(f"{env_name(f)}={value!r} must be {says} {limit}.")

    def allows_image(self, image: str) -> bool:
        """May an encoder profile name ``image`` (``encoder_image`` always may)?"""
        if image == self.encoder_image:
            return True
        for entry in filter(None, (e.strip() for e in self.encoder_images.split(","))):
            if image == entry or (entry.endswith("*") and image.startswith(entry[:-1])):
                return True
        return False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorSettings:
        known = {env_name(f): f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(PREFIX):
                continue
            field = known.get(key)
            if field is None:
                raise ConfigError(f"Unknown setting {key}; known: "
                                  f"{', '.join(sorted(known))}.")
            values[field.name] = _parse(key, raw, field)
        return cls(**values)


def _parse(key: str, raw: str, field: dataclasses.Field[Any]) -> Any:
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    try:
        if kind == "bool":
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a valid {kind}.") from None
    return raw
