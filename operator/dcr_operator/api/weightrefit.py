"""The WeightRefit kind: one transition of one RolloutFleet to a target version.

Its spec is immutable; its status holds the phase, conditions, attempts and each receiver's
progress (docs/monitoring.md, "Watch it").
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from dcr.protocol.states import REFIT_RECEIVER_STATES, AttemptOutcome, Phase
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
    one_of,
)
from dcr_operator.api.conditions import RefitCondition
from dcr_operator.api.rolloutfleet import DEFAULT_PROFILE
from dcr_operator.api.volumes import CheckpointPath

KIND = "WeightRefit"
MAX_REFIT_OWNERS = 256  # owners of one refit (Job completions)
PLURAL = "weightrefits"
SHORT_NAMES = ["wr", "refit"]
DESCRIPTION = "One transition of one RolloutFleet to a target version."

PHASE_TEXT = (f"The refit's phase, {one_of(Phase)}: the first true of the Committed, Failed, "
              f"Encoding and Applying conditions, {Phase.PENDING} while none is.")

REASON_TEXT = ("Why the refit is in its phase: the reason of the condition that names it "
               "(Failed's when the refit failed), or while Pending that of the Applying or "
               "Validated condition, which says what it waits for (api/conditions.py).")


class RefitEncoder(SpecModel):
    """What a WeightRefit chooses of its encoder Job: a profile of its fleet and the split.

    No image, ServiceAccount or scheduling: those come from the fleet's profile, so
    creating a WeightRefit never amounts to creating pods of one's own making.
    """

    profile: DnsLabel = Field(
        default=DEFAULT_PROFILE, description="One of the fleet's spec.encoderProfiles.")
    owners: Annotated[int, Field(ge=1, le=MAX_REFIT_OWNERS)] = Field(
        default=1, description="Parallel owners: Job completions, tensors split by name.")
    bucket_mib: Annotated[int | None, Field(ge=1, le=4096, alias="bucketMiB")] = Field(
        default=None, description="MiB of tensors per payload; default: the encoder's own.")


class SourceSpec(SpecModel):
    """Where the target version's weights come from."""

    checkpoint: CheckpointPath = Field(
        description="The target version's Hugging Face checkpoint (training side): an "
        "absolute, canonical path without '$' or control characters.")


class WeightRefitSpec(SpecModel):
    """Which fleet to refit, from which version to which; immutable."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": IMMUTABLE, "message": "a WeightRefit's spec is immutable: create another"},
        {"rule": "self.targetVersion > self.baseVersion",
         "message": "targetVersion must be greater than baseVersion"},
    ]})

    fleet: DnsSubdomain = Field(description="The RolloutFleet (same namespace) to refit.")
    target_version: Annotated[int, Field(ge=1)] = Field(
        description="The version number the fleet holds once this refit commits.")
    base_version: Annotated[int, Field(ge=0)] = Field(
        description="The version the fleet must hold (committed) for this refit to run.")
    source: SourceSpec
    encoder: RefitEncoder = Field(
        default_factory=RefitEncoder, description="Which encoder profile publishes the "
        "attempts, and how many owners split them; defaults as its fields say.")
    mode_policy: Literal["MixedThenOverwrite", "Overwrite"] = Field(
        default="MixedThenOverwrite", description="MixedThenOverwrite: XOR where the "
        "loaders allow, overwrite on retries; Overwrite: absolute values every attempt.")
    deadline_seconds: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Seconds from creation after which no attempt starts.")


class AttemptStatus(StatusModel):
    """One attempt of the refit: its mode, outcome and numbers."""

    id: str = Field(description="The attempt's id (a-<hex>), unique to the refit.")
    mode: Literal["mixed", "overwrite"] = Field(
        description="mixed: XOR where the loaders allow; overwrite: absolute values.")
    outcome: AttemptOutcome = Field(
        description=f"How it ended, or that it has not: {one_of(AttemptOutcome)} "
        "(dcr/protocol/states.py).")
    reason: str | None = Field(default=None, description="Why it did not commit, if not.")
    start_time: Annotated[str, Field(json_schema_extra=RFC3339)] = Field(
        description="When it started (RFC 3339, UTC).")
    completion_time: Annotated[str | None, Field(json_schema_extra=RFC3339)] = Field(
        default=None, description="When it ended (RFC 3339, UTC).")
    stages: dict[str, float] = Field(default={}, description="Wall seconds per stage.")
    payloads: int = Field(default=0, description="Payloads each receiver applied.")
    bytes: int = Field(default=0, description="Payload bytes applied, summed over receivers.")
    receiver_count: int = Field(default=0, description="How many receivers (pods, or groups) took "
                                "part; their names are in the operator's log and the "
                                "AttemptStarted Event.")
    rejoined: list[str] = Field(default_factory=list, description="Receivers that restored "
                                "the committed version by a dense load instead (at most "
                                "100 names).")
    left_out: list[str] = Field(default_factory=list, description="Selected receivers that "
                                "could not take part (their agents did not answer), as the "
                                "fleet's minReceivers allows; they rejoin the committed "
                                "version later (at most 100 names).")
    job: str | None = Field(default=None, description="The encoder Job that published it.")
    endpoint: str | None = Field(
        default=None, description="The encoder profile whose warm endpoint published it "
        "(no Job ran).")


class ReceiverProgress(StatusModel):
    """One receiver's progress in the refit's latest attempt."""

    name: str = Field(description="The pod's name.")
    attempt: str | None = Field(default=None, description="The attempt it reported on.")
    state: str | None = Field(
        default=None, description=f"Its last step: {one_of(REFIT_RECEIVER_STATES)}; or "
        "'<call> failed' when an agent call failed, with its error (dcr/protocol/states.py).")
    payloads: int = Field(default=0, description="Payloads it applied; default 0.")
    bytes: int = Field(default=0, description="Payload bytes it applied; default 0.")
    apply_seconds: float | None = Field(
        default=None, description="Wall seconds it took to apply the payloads.")
    last_ack: Annotated[str | None, Field(json_schema_extra=RFC3339)] = Field(
        default=None, description="When it last acknowledged a flush (RFC 3339, UTC).")
    error: str | None = Field(default=None, description="Its last error, if any.")


class StateCount(StatusModel):
    """How many receivers are in one state."""

    state: str = Field(description="A receiver's state, as receivers[].state names it.")
    count: int = Field(description="How many receivers are in it.")


class WeightRefitStatus(StatusModel):
    """The refit's phase, conditions, attempts and per-receiver progress."""

    observed_generation: int | None = Field(
        default=None, description="The metadata.generation this status was written for.")
    phase: Phase | None = Field(
        default=None, description=PHASE_TEXT)
    reason: str | None = Field(
        default=None, description=REASON_TEXT)
    attempts: list[AttemptStatus] = Field(
        default_factory=list, json_schema_extra=list_map("id"),
        description="Every attempt, oldest first.")
    attempt_count: int = Field(default=0, description="Attempts made; default 0.")
    bytes: int = Field(default=0, description="Payload bytes over all attempts and receivers.")
    receivers: list[ReceiverProgress] = Field(
        default_factory=list, json_schema_extra=list_map("name"),
        description="Receivers' progress in the latest attempt: those with an error first, "
        "then by name, at most 100 entries; receiverCount and receiverStates count all.")
    receiver_count: int = Field(default=0, description="Receivers the status knows of.")
    receiver_states: list[StateCount] = Field(
        default_factory=list, json_schema_extra=list_map("state"),
        description="How many receivers are in each state, over all of them.")
    committed: CommitRecordStatus | None = Field(
        default=None, description="The commit record this refit wrote, once committed.")
    start_time: Annotated[str | None, Field(json_schema_extra=RFC3339)] = Field(
        default=None, description="When the first attempt started (RFC 3339, UTC).")
    completion_time: Annotated[str | None, Field(json_schema_extra=RFC3339)] = Field(
        default=None, description="When it committed or failed (RFC 3339, UTC).")
    conditions: list[Condition] = Field(
        default_factory=list, json_schema_extra=CONDITIONS_LIST,
        description="Validated, Encoding, Applying, Committed and Failed "
        "(api/conditions.py).")



PRINTER_COLUMNS = [
    column("Fleet", ".spec.fleet"),
    column("Version", ".spec.targetVersion", "integer"),
    column("Phase", ".status.phase", description=PHASE_TEXT),
    column("Reason", ".status.reason", description=REASON_TEXT),
    column("Attempts", ".status.attemptCount", "integer"),
    column("Receivers", ".status.receiverCount", "integer"),
    column("Bytes", ".status.bytes", "integer"),
    AGE,
    column("Base", ".spec.baseVersion", "integer", priority=1),
    condition_column("Message", RefitCondition.FAILED, "message", priority=1),
]
