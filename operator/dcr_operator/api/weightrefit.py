"""The WeightRefit kind: one transition of one RolloutFleet to a target version.

Its spec is immutable (create another to change it); its status holds the phase, the
conditions, every attempt and each receiver's progress (docs/operations.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from dcr_operator.api.common import (
    AGE,
    CONDITIONS_LIST,
    IMMUTABLE,
    RFC3339,
    CommitRecordStatus,
    Condition,
    DnsLabel,
    DnsSubdomain,
    SpecModel,
    StatusModel,
    column,
    condition_column,
    list_map,
)
from dcr_operator.api.conditions import RefitCondition
from dcr_operator.api.rolloutfleet import DEFAULT_PROFILE

KIND = "WeightRefit"
PLURAL = "weightrefits"
SHORT_NAMES = ["wr", "refit"]
DESCRIPTION = "One transition of one RolloutFleet to a target version."

class RefitEncoder(SpecModel):
    """What a WeightRefit chooses of its encoder Job: a profile of its fleet and the split.

    No image, ServiceAccount or scheduling: those come from the fleet's profile, so
    creating a WeightRefit never amounts to creating pods of one's own making.
    """

    profile: DnsLabel = Field(
        default=DEFAULT_PROFILE, description="One of the fleet's spec.encoderProfiles.")
    owners: Annotated[int, Field(ge=1, le=256)] = Field(
        default=1, description="Parallel owners: Job completions, tensors split by name.")
    bucket_mib: Annotated[int | None, Field(ge=1, le=4096, alias="bucketMiB")] = None


class SourceSpec(SpecModel):
    checkpoint: Annotated[str, Field(min_length=1)] = Field(
        description="The target version's Hugging Face checkpoint (training side).")


class WeightRefitSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": IMMUTABLE, "message": "a WeightRefit's spec is immutable: create another"},
        {"rule": "self.targetVersion > self.baseVersion",
         "message": "targetVersion must be greater than baseVersion"},
    ]})

    fleet: DnsSubdomain = Field(description="The RolloutFleet (same namespace) to refit.")
    target_version: Annotated[int, Field(ge=1)]
    base_version: Annotated[int, Field(ge=0)]
    source: SourceSpec
    encoder: RefitEncoder = Field(default_factory=RefitEncoder)
    mode_policy: Literal["MixedThenOverwrite", "Overwrite"] = Field(
        default="MixedThenOverwrite", description="MixedThenOverwrite: XOR where the "
        "loaders allow, overwrite on retries; Overwrite: absolute values every attempt.")
    deadline_seconds: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Seconds from creation after which no attempt starts.")


Phase = Literal["Pending", "Encoding", "Applying", "Committed", "Failed"]
AttemptOutcome = Literal["Running", "Committed", "Failed", "Conflict", "Abandoned"]


class AttemptStatus(StatusModel):
    id: str
    mode: Literal["mixed", "overwrite"]
    outcome: AttemptOutcome
    reason: str | None = None
    start_time: Annotated[str, Field(json_schema_extra=RFC3339)]
    completion_time: Annotated[str | None, Field(json_schema_extra=RFC3339)] = None
    stages: dict[str, float] = Field(default={}, description="Wall seconds per stage.")
    payloads: int = Field(default=0, description="Payloads each receiver applied.")
    bytes: int = Field(default=0, description="Payload bytes applied, summed over receivers.")
    receivers: list[str] = Field(default_factory=list)
    rejoined: list[str] = Field(default_factory=list)
    job: str | None = Field(default=None, description="The encoder Job that published it.")
    endpoint: str | None = Field(
        default=None, description="The encoder profile whose warm endpoint published it "
        "(no Job ran).")


class ReceiverProgress(StatusModel):
    name: str
    attempt: str | None = None
    state: str | None = None
    payloads: int = 0
    bytes: int = 0
    apply_seconds: float | None = None
    last_ack: Annotated[str | None, Field(json_schema_extra=RFC3339)] = None
    error: str | None = None


class WeightRefitStatus(StatusModel):
    observed_generation: int | None = None
    phase: Phase | None = None
    attempts: list[AttemptStatus] = Field(default_factory=list, json_schema_extra=list_map("id"))
    attempt_count: int = 0
    bytes: int = Field(default=0, description="Payload bytes over all attempts and receivers.")
    receivers: list[ReceiverProgress] = Field(default_factory=list,
                                              json_schema_extra=list_map("name"))
    committed: CommitRecordStatus | None = None
    start_time: Annotated[str | None, Field(json_schema_extra=RFC3339)] = None
    completion_time: Annotated[str | None, Field(json_schema_extra=RFC3339)] = None
    conditions: list[Condition] = Field(default_factory=list,
                                      json_schema_extra=CONDITIONS_LIST)



PRINTER_COLUMNS = [
    column("Fleet", ".spec.fleet"),
    column("Version", ".spec.targetVersion", "integer"),
    column("Phase", ".status.phase"),
    column("Attempts", ".status.attemptCount", "integer"),
    column("Bytes", ".status.bytes", "integer"),
    AGE,
    column("Base", ".spec.baseVersion", "integer", priority=1),
    condition_column("Message", RefitCondition.FAILED, "message", priority=1),
]
