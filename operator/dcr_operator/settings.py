"""The operator's settings: one tree, parsed once from the environment at startup.

Each field is ``DCR_OPERATOR_<FIELD>``, set by the Helm chart; an unknown ``DCR_OPERATOR_*``
variable or a value that does not parse is an error naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from dcr.errors import ConfigError

PREFIX = "DCR_OPERATOR_"


@dataclass(frozen=True, kw_only=True)
class OperatorSettings:
    # The image encoder Jobs run (it must provide the `dcr` command), unless the
    # RolloutFleet's encoder profile names another that encoder_images allows.
    encoder_image: str = "ghcr.io/dcr-dev/dcr:0.1.0"
    encoder_image_pull_policy: str = "IfNotPresent"
    # Images a RolloutFleet's encoder profiles may name besides encoder_image,
    # comma-separated; an entry ending in "*" allows every image that starts with the
    # rest ("registry.example/dcr:*"). Empty: encoder_image only. The cluster admin's
    # say over what the operator's Jobs run, whoever writes the fleets.
    encoder_images: str = ""
    # ServiceAccount of encoder pods ("" = the namespace's default), unless the fleet's
    # encoder profile names another.
    encoder_service_account: str = ""
    # ttlSecondsAfterFinished of encoder Jobs; 0 keeps them until their WeightRefit is
    # deleted (owner references then remove them), which keeps them inspectable.
    encoder_ttl_seconds: int = 0
    # Seconds between polls of an encoder Job's status while an attempt waits for it.
    job_poll_seconds: float = 1.0
    # Seconds before a refit that waits (base version not committed yet, fleet busy, too
    # few receivers, API server unreachable) is looked at again.
    retry_seconds: float = 10.0
    # Seconds between polls of every fleet's agents for status.receivers and Ready.
    fleet_status_seconds: float = 30.0
    # Delete a WeightRefit's payloads from the store when it is deleted (the finalizer).
    cleanup_store: bool = True
    # Seconds the finalizer keeps retrying a store it cannot clean before giving up
    # (with a Warning event) so the WeightRefit can still be deleted.
    cleanup_give_up_seconds: float = 300.0

    # Seconds a peering record lives without a keepalive. A crashed operator's record
    # pauses its successor of the same priority this long; a lower-priority standby takes
    # over once it expires.
    peering_lifetime_seconds: int = 60
    # Port of the Prometheus endpoint (GET /metrics on all addresses); 0 turns it off.
    metrics_port: int = 8081

    def __post_init__(self) -> None:
        if self.job_poll_seconds <= 0 or self.retry_seconds <= 0:
            raise ConfigError(f"Poll and retry intervals must be positive: {self}.")
        if self.peering_lifetime_seconds < 2:
            raise ConfigError(f"peering_lifetime_seconds must be >= 2: {self}.")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"{PREFIX}METRICS_PORT={self.metrics_port} is not a port.")
        if self.fleet_status_seconds <= 0 or self.encoder_ttl_seconds < 0:
            raise ConfigError(f"fleet_status_seconds must be positive and "
                              f"encoder_ttl_seconds >= 0: {self}.")
        if self.encoder_image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ConfigError(f"{PREFIX}ENCODER_IMAGE_PULL_POLICY="
                              f"{self.encoder_image_pull_policy!r}: Always, IfNotPresent or "
                              "Never.")

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
        known = {f.name.upper(): f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(PREFIX):
                continue
            field = known.get(key[len(PREFIX):])
            if field is None:
                raise ConfigError(f"Unknown setting {key}; known: "
                                  f"{', '.join(PREFIX + k for k in sorted(known))}.")
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
