"""Condition types and reasons of both kinds: one documented constant each, said once.

The reconcilers set conditions with them and the printer columns read them; an Event of a
condition change shares its reason where they coincide.
"""

from __future__ import annotations

from typing import Final


class FleetCondition:
    """Condition types of a RolloutFleet, refreshed on every pass over its pods."""

    READY: Final = "Ready"
    """True when every receiver reports the committed version without an error."""
    PROGRESSING: Final = "Progressing"
    """True while a WeightRefit holds the fleet (``status.activeRefit``)."""
    DEGRADED: Final = "Degraded"
    """True while some receiver's agent does not answer."""
    RECEIVERS_READ_ONLY: Final = "ReceiversReadOnly"
    """False while a selected pod is handed the store's write credentials
    (``spec.store.credentialsSecretRef``); set only when the fleet names them."""


class FleetReason:
    """Reasons of a RolloutFleet's conditions."""

    NO_RECEIVERS: Final = "NoReceivers"
    """Ready is False: the selector matches no Running pod."""
    RECEIVERS_BEHIND: Final = "ReceiversBehind"
    """Ready is False: some receiver reports another version, or an error."""
    ALL_RECEIVERS_COMMITTED: Final = "AllReceiversCommitted"
    """Ready is True: every receiver reports the committed version."""
    REFIT_RUNNING: Final = "RefitRunning"
    """Progressing is True: a WeightRefit is running."""
    IDLE: Final = "Idle"
    """Progressing is False: no refit is running."""
    RECEIVERS_UNREACHABLE: Final = "ReceiversUnreachable"
    """Degraded is True: some agents do not answer."""
    ALL_RECEIVERS_REACHABLE: Final = "AllReceiversReachable"
    """Degraded is False: every receiver's agent answers."""
    NO_POD_HOLDS_WRITE_CREDENTIALS: Final = "NoPodHoldsWriteCredentials"
    """ReceiversReadOnly is True: no selected pod is handed the store's write credentials."""
    PODS_HOLD_WRITE_CREDENTIALS: Final = "PodsHoldWriteCredentials"
    """ReceiversReadOnly is False: some selected pods are handed the store's write
    credentials, with which whoever controls such a pod could choose the weights."""


class RefitCondition:
    """Condition types of a WeightRefit; the first true of Committed, Failed, Encoding
    and Applying names its phase (Pending while none is)."""

    VALIDATED: Final = "Validated"
    """True once the refit's base version is committed and its encoder profile is taken;
    False while it waits for them, or when it was refused."""
    ENCODING: Final = "Encoding"
    """True while an encoder Job or warm endpoint publishes an attempt's payloads."""
    APPLYING: Final = "Applying"
    """True while an attempt runs on the receivers; False while it waits for them."""
    COMMITTED: Final = "Committed"
    """True once the target version is the fleet's commit record (final)."""
    FAILED: Final = "Failed"
    """True when the refit gave up, with the reason why (final)."""


class RefitReason:
    """Reasons of a WeightRefit's conditions (Validated unless said otherwise)."""

    FLEET_NOT_FOUND: Final = "FleetNotFound"
    """False: ``spec.fleet`` names no RolloutFleet of the namespace (yet)."""
    ALREADY_COMMITTED: Final = "AlreadyCommitted"
    """True: the fleet has already committed this refit's target and checkpoint."""
    DEADLINE_EXCEEDED: Final = "DeadlineExceeded"
    """Failed: ``spec.deadlineSeconds`` passed before the refit committed."""
    BASE_VERSION_COMMITTED: Final = "BaseVersionCommitted"
    """True: the fleet holds the base version; attempts may start."""
    WAITING_FOR_BASE_VERSION: Final = "WaitingForBaseVersion"
    """False: the fleet holds an older version than the base; the refit waits."""
    TARGET_COMMITTED_ELSEWHERE: Final = "TargetCommittedElsewhere"
    """Failed: the fleet committed the target version from another checkpoint."""
    BASE_VERSION_MISMATCH: Final = "BaseVersionMismatch"
    """Failed: the fleet moved past the base version."""
    ENCODER_PROFILE_REFUSED: Final = "EncoderProfileRefused"
    """False: the encoder profile cannot run (unknown, image not allowed, bad endpoint)."""
    SECRET_NOT_OPTED_IN: Final = "SecretNotOptedIn"
    """False: a Secret the refit needs lacks the label that allows the operator to use it."""
    WAITING_FOR_RECEIVERS: Final = "WaitingForReceivers"
    """Applying is False: fewer receivers than the commit policy asks for."""
    RETRY_LIMIT_REACHED: Final = "RetryLimitReached"
    """Failed: ``spec.retryLimit`` attempts of the fleet failed."""
    COMMIT_CONFLICT: Final = "CommitConflict"
    """Failed: another writer changed the fleet's commit record during an attempt."""
    COMMITTED: Final = "Committed"
    """Committed is True (and Applying, Encoding and Failed False): the refit committed."""
    ATTEMPT_RUNNING: Final = "AttemptRunning"
    """Applying is True: an attempt runs on its receivers."""
    ENCODER_JOB_RUNNING: Final = "EncoderJobRunning"
    """Encoding is True: the attempt's encoder Job was created."""
    ENCODER_JOB_SUCCEEDED: Final = "EncoderJobSucceeded"
    """Encoding is False: the encoder Job published every payload."""
    ENCODER_JOB_FAILED: Final = "EncoderJobFailed"
    """Encoding is False: the encoder Job failed (the attempt fails with it)."""
    ENCODER_ENDPOINT_RUNNING: Final = "EncoderEndpointRunning"
    """Encoding is True: the profile's warm encoders were asked to publish."""
    ENCODER_ENDPOINT_SUCCEEDED: Final = "EncoderEndpointSucceeded"
    """Encoding is False: the warm encoders published every payload."""
    ENCODER_ENDPOINT_FAILED: Final = "EncoderEndpointFailed"
    """Encoding is False: a warm encoder failed (the attempt fails with it)."""
