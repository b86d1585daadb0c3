"""What both kinds share: the group and version, the model bases, names, conditions.

Specs are parsed strictly (unknown keys are errors), statuses leniently (another writer may
add fields); both take Kubernetes' camelCase keys, and status times are RFC 3339 in UTC.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "dcr.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

IMMUTABLE = "self == oldSelf"
"""The CEL transition rule of a field that may not change once written."""
RFC3339 = {"format": "date-time"}
"""``json_schema_extra`` of a timestamp field."""
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"

# Names of other objects, as Kubernetes requires them for that kind, checked by pydantic
# and by the API server (the pattern is in the CRD schema). A name goes into a REST path,
# so a '#', '?', '/' or '..' there would change which object a request reaches.
DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=f"^{_LABEL}$")]
"""An RFC 1123 label: encoder profile names, volume names."""
DnsSubdomain = Annotated[str, Field(min_length=1, max_length=253,
                                    pattern=rf"^{_LABEL}(\.{_LABEL})*$")]
"""An RFC 1123 subdomain: the names of RolloutFleets, Secrets, ServiceAccounts and PVCs."""
SecretKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]
"""A key of a Secret's data, as Kubernetes allows it."""


class SpecModel(BaseModel):
    """What users write: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel,
                              populate_by_name=True)


class StatusModel(BaseModel):
    """What the operator writes; read leniently (another writer may add fields)."""

    model_config = ConfigDict(extra="ignore", frozen=True, alias_generator=to_camel,
                              populate_by_name=True)


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(StatusModel):
    """One condition, following the Kubernetes API conventions (metav1.Condition)."""

    type: Annotated[str, Field(min_length=1, max_length=316)] = Field(
        description="The condition's type, such as Ready or Committed (api/conditions.py).")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: Annotated[str, Field(min_length=1, max_length=1024,
                                 pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")] = Field(
        description="Why the condition has its status: a CamelCase identifier.")
    message: Annotated[str, Field(max_length=32768)] = Field(
        default="", description="A sentence for people, with the values; default empty.")
    last_transition_time: Annotated[str, Field(json_schema_extra=RFC3339)] = Field(
        description="When the status last changed (RFC 3339, UTC).")
    observed_generation: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="The metadata.generation the condition was set for.")


def list_map(*keys: str) -> dict[str, Any]:
    """``json_schema_extra`` of a list whose items are keyed by ``keys`` (a list-map)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


CONDITIONS_LIST = list_map("type")
"""``json_schema_extra`` of a ``conditions`` list: a list-map keyed by ``type``."""


class SecretKeyRef(SpecModel):
    """A key of a Secret in the resource's namespace (labelled for its use: see fleet.py)."""

    name: DnsSubdomain = Field(description="The Secret's name, in the resource's namespace.")
    key: SecretKey = Field(default="token", description="The key of the Secret's data that "
                           "holds the value; default token.")


class SecretRef(SpecModel):
    """A Secret in the resource's namespace (labelled for its use: see fleet.py)."""

    name: DnsSubdomain = Field(description="The Secret's name, in the resource's namespace.")


class CommitRecordStatus(StatusModel):
    """The fleet's commit record: the one durable fact of a refit (docs/protocol.md)."""

    committed_version: Annotated[int, Field(ge=0)] = Field(
        description="The version every receiver holds once it has applied the commit.")
    baseline_id: str = Field(description="The committed version's checkpoint (its source).")
    attempt: str = Field(description="The attempt that committed it; empty initially.")
    history_digest: Annotated[str | None, Field(pattern=r"^[0-9a-f]{32}$")] = Field(
        default=None, description="BLAKE2b-128 of the store's history written with this "
        "commit: readers of the store (agents, init containers, mirrors) refuse any other "
        "history. Absent for a fleet without a store and before the first commit.")
    refit: str | None = Field(default=None, description="The WeightRefit that committed it.")
    committed_at: Annotated[str | None, Field(json_schema_extra=RFC3339)] = Field(
        default=None, description="When it was committed (RFC 3339, UTC).")


def column(name: str, path: str, kind: str = "string", *,
           priority: int | None = None, description: str | None = None) -> dict[str, Any]:
    """A printer column; priority 1 shows only with ``kubectl get -o wide``."""
    out: dict[str, Any] = {"name": name, "type": kind, "jsonPath": path}
    if priority is not None:
        out["priority"] = priority
    if description is not None:
        out["description"] = description
    return out


def one_of(words: Iterable[str]) -> str:
    """The states a description names, as ``one of a, b, c``: built from the constants of
    ``dcr.protocol.states``, and read back by the test that holds the CRDs to them."""
    return "one of " + ", ".join(words)


def condition_column(name: str, type_: str, field: str, *,
                     priority: int | None = None) -> dict[str, Any]:
    """A printer column showing ``field`` of the condition of type ``type_``."""
    return column(name, f'.status.conditions[?(@.type=="{type_}")].{field}',
                  priority=priority)


AGE = column("Age", ".metadata.creationTimestamp", "date")
