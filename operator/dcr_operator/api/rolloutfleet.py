"""The RolloutFleet kind: a set of rollout pods refit together, and its commit record.

Its fields: docs/fleets.md, "Describe a fleet and refit it".
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from dcr.protocol.states import AttemptState
from dcr_operator.api.common import (
    AGE,
    CONDITIONS_LIST,
    IMMUTABLE,
    RFC3339,
    CommitRecordStatus,
    Condition,
    DnsLabel,
    DnsSubdomain,
    SecretKey,
    SecretKeyRef,
    SecretRef,
    SpecModel,
    StatusModel,
    column,
    condition_column,
    list_map,
    one_of,
)
from dcr_operator.api.conditions import FleetCondition
from dcr_operator.api.volumes import CheckpointPath, ProfileVolumes

KIND = "RolloutFleet"
PLURAL = "rolloutfleets"
SHORT_NAMES = ["fleet"]
DESCRIPTION = ("A set of rollout pods (label selector) refit together; its status holds the "
               "commit record.")

class LabelSelectorRequirement(SpecModel):
    """One term of a label selector: a key, an operator and values."""

    key: Annotated[str, Field(min_length=1, max_length=317)] = Field(
        description="The label key the term applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How the label's value relates to values: In, NotIn, Exists or "
        "DoesNotExist.")
    values: Annotated[list[Annotated[str, Field(max_length=63)]] | None,
                      Field(max_length=64)] = Field(
        default=None, description="The values for In and NotIn; empty for Exists and "
        "DoesNotExist.")


_NARROWING = ("In", "Exists")  # operators that select only pods carrying a label
_SELECTS_SOME = ("(has(self.matchLabels) && size(self.matchLabels) > 0) || "
                 "(has(self.matchExpressions) && self.matchExpressions.exists(e, "
                 + " || ".join(f"e.operator == '{o}'" for o in _NARROWING) + "))")
_EMPTY_SELECTOR = ("selector needs a matchLabels entry or an In or Exists expression: an "
                   "empty selector (or NotIn / DoesNotExist alone) makes every pod of the "
                   "namespace a receiver, and every receiver gets the agent token")


class LabelSelector(SpecModel):
    """Which pods of the namespace are the fleet's rollout ranks (metav1.LabelSelector).

    Never one that selects (nearly) every pod: each receiver is sent the agent token.
    """

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": _SELECTS_SOME, "message": _EMPTY_SELECTOR}]})

    match_labels: Annotated[dict[str, Annotated[str, Field(max_length=63)]] | None,
                            Field(max_length=64)] = Field(
        default=None, description="Labels a pod must carry, key to value (all of them).")
    match_expressions: Annotated[list[LabelSelectorRequirement] | None,
                                 Field(max_length=64)] = Field(
        default=None, description="Terms a pod's labels must meet (all of them).")

    @model_validator(mode="after")
    def _selects_some(self) -> LabelSelector:
        if not self.match_labels and not any(
                e.operator in _NARROWING for e in self.match_expressions or []):
            raise ValueError(_EMPTY_SELECTOR)
        return self


LWS_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
MAX_GROUP_SIZE = 64  # pods per group: a leader's agent calls each member


class ReplicaGroups(SpecModel):
    """Replicas that span pods: the selected pods form groups (a LeaderWorkerSet's, by
    default), and each group is one receiver, driven through its leader pod's agent.

    A group takes part only while exactly ``size`` of its pods are Running and one of them
    is its leader; the operator calls the leader's agent only, which reaches its members
    itself (docs/replica-groups.md, "Replicas across pods").
    """

    size: Annotated[int, Field(ge=2, le=MAX_GROUP_SIZE)] = Field(
        description="Pods per group, its leader included (a LeaderWorkerSet's "
        "leaderWorkerTemplate.size).")
    label: Annotated[str, Field(min_length=1, max_length=317)] = Field(
        default=LWS_GROUP_KEY, description="The pod label whose value names a pod's group; "
        f"default {LWS_GROUP_KEY}.")
    leader_label: Annotated[str, Field(min_length=1, max_length=317)] = Field(
        default=LWS_WORKER_INDEX, description="The pod label that marks a group's leader "
        f"(with leaderValue); default {LWS_WORKER_INDEX}.")
    leader_value: Annotated[str, Field(max_length=63)] = Field(
        default="0", description="The leaderLabel value of the leader pod; default 0.")


class AgentSpec(SpecModel):
    """How the operator reaches each pod's agent sidecar."""

    port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=8471, description="The agent sidecar's port on the pod IP; default 8471.")
    scheme: Literal["http", "https"] = Field(
        default="http", description="http or https; default http.")
    token_secret_ref: SecretKeyRef = Field(
        description="Secret key holding the agents' bearer token (at least 16 characters).")
    timeout_seconds: Annotated[float, Field(gt=0, le=600)] = Field(
        default=30.0, description="Seconds per agent call that does not wait for staging.")


class StoreSpec(SpecModel):
    """The object store encoder Jobs publish to and agents read from."""

    uri: Annotated[str, Field(pattern=r"^(s3|file)://\S+$")] = Field(
        description="s3://bucket/prefix, or file:///path on a volume every party mounts.")
    endpoint: str | None = Field(default=None, description="S3 endpoint URL (S3-compatible).")
    region: str | None = Field(default=None, description="S3 region; default: the S3 "
                               "client's (AWS_REGION).")
    credentials_secret_ref: SecretRef | None = Field(
        default=None, description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "passed to encoder Jobs as environment and used by the finalizer's cleanup.")


class RelaySpec(SpecModel):
    """The root of a relay tree encoder Jobs publish to (agents read from their own node).

    The relay nodes run beside the agents (``dcr relay``, see docs/publishing.md); each
    payload crosses from the training side once, every owner's manifest part beside it.
    With ``store`` set too, encoder Jobs write each attempt through to that store and the
    operator keeps the fleet's history there, which its pods catch up from
    (docs/relay.md, "History and catch-up").
    """

    url: Annotated[str, Field(pattern=r"^https?://\S+$")] = Field(
        description="The root node's URL, as encoder pods reach it.")
    token_secret_ref: SecretKeyRef = Field(
        description="Secret key holding the relay tree's bearer token.")
    ca_secret_ref: SecretKeyRef | None = Field(
        default=None, description="For an https url: the Secret key holding the CA bundle "
        "(PEM; cert-manager's ca.crt) the root's certificate chains to, which encoder Jobs "
        "verify it against (DCR_TLS_CA_DATA); the Secret must be labelled "
        "dcr.dev/relay-ca=true and exist where the Jobs run. Unset: the image's CAs.")
    server_name: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
                           ] | None = Field(default=None, description=(
                               "For an https url: the DNS name the root's certificate "
                               "carries, when not the url's host (DCR_TLS_SERVER_NAME)."))

    @model_validator(mode="after")
    def _tls_needs_https(self) -> RelaySpec:
        if not self.url.startswith("https://") and (self.ca_secret_ref or self.server_name):
            raise ValueError(f"caSecretRef and serverName verify a TLS relay, but url "
                             f"{self.url!r} is plain http: use an https:// url")
        return self


class InitialVersion(SpecModel):
    """The version the fleet's pods start with: the commit record before any refit."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": IMMUTABLE, "message": "initial is immutable: it seeds the commit record"}]})

    version: Annotated[int, Field(ge=0)] = Field(
        default=0, description="The version number the pods start with; default 0.")
    checkpoint: CheckpointPath = Field(
        description="That version's checkpoint, as encoder Jobs read it: an absolute, "
        "canonical path without '$' or control characters.")


DEFAULT_MIN_RECEIVERS = "90%"
_PERCENT = r"^(100|[1-9]?[0-9])%$"


class CommitPolicy(SpecModel):
    """When a refit may commit, and how long an attempt may take."""

    min_receivers: Annotated[int | str, Field(json_schema_extra={
        "x-kubernetes-int-or-string": True, "x-kubernetes-validations": [{
            "rule": f"type(self) == int ? self >= 1 : self.matches('{_PERCENT}')",
            "message": "minReceivers is a count of at least 1 or a percentage 0%-100%"}]})] = Field(
        default=DEFAULT_MIN_RECEIVERS, description="Receivers that must take part in an "
        "attempt: a count (at least 1), or a percentage of the Running pods the selector "
        "matches when the refit starts (with spec.groups: of the complete groups), rounded "
        "down, at least 1. Default 90%: one dead pod "
        "of ten does not stall training; the attempt names who was left out, and they "
        "rejoin the committed version later.")
    attempt_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = Field(
        default=600, description="Seconds an attempt may take before it is abandoned; "
        "default 600.")
    gate: Literal["Sync", "Async"] = Field(
        default="Sync", description="Sync: close request gates first; Async: after staging.")

    @field_validator("min_receivers")
    @classmethod
    def _count_or_percentage(cls, v: int | str) -> int | str:
        if (isinstance(v, int) and v < 1) or (isinstance(v, str) and not re.match(_PERCENT, v)):
            raise ValueError(f"minReceivers {v!r} is neither a count of at least 1 nor a "
                             "percentage from 0% to 100%")
        return v

    def receivers_needed(self, running: int) -> int:
        """How many of ``running`` receivers an attempt needs."""
        if isinstance(self.min_receivers, int):
            return self.min_receivers
        return max(1, running * int(self.min_receivers[:-1]) // 100)


class Retention(SpecModel):
    """What the store keeps for catch-up beyond what the current version needs."""

    snapshot_every: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="After committing every K-th version, have a snapshot "
        "of it written: where the encoder profile's endpoints are trainer ranks, each rank "
        "writes its part from memory; otherwise a Job on the refit's encoder profile writes "
        "a snapshot of its source checkpoint (dcr snapshot). The next commit adopts it into the "
        "history. Default: none (the training side may run dcr snapshot itself).")
    keep_snapshots: Annotated[int, Field(ge=1, le=1000)] | None = Field(
        default=None, description="Keep the newest N snapshots and every committed delta "
        "from the oldest of them on; after a commit the operator removes older ones (a pod "
        "further behind starts from a kept snapshot). Default: keep everything.")


class CatchUp(SpecModel):
    """Where a pod behind the committed version takes it from, besides the store."""

    peers: bool = Field(
        default=False, description="Pods may take the committed version from a live peer "
        "(docs/catch-up.md, \"From a peer\"): the operator keeps a peer read token Secret "
        "<fleet>-peer-token (key token, created once, owned by the fleet) and a headless "
        "Service <fleet>-peers over the selected Ready pods at agent.port; pods mount the "
        "Secret for --peer-token-file and name donors by --donor (status.peers says what). "
        "Needs store (its history judges a peer's copy) and a selector of matchLabels "
        "alone (the Service's). Default false.")


class PeersStatus(StatusModel):
    """What the fleet's pods are given to catch up from each other (spec.catchUp.peers)."""

    service: str | None = Field(default=None, description="The headless Service over the "
                                "fleet's Ready pods: donors are its pods.")
    donor: str | None = Field(default=None, description="A --donor URL naming any Ready "
                              "pod of the fleet, through the Service.")
    token_secret: str | None = Field(default=None, description="The Secret whose key token "
                                     "is the peer read token (mounted as --peer-token-file).")


class HistoryStatus(StatusModel):
    """What the store's history holds, as the operator last wrote it."""

    oldest_version: int | None = Field(
        default=None, description="The oldest version a delta is kept for.")
    committed_version: int | None = Field(
        default=None, description="The newest committed version it names.")
    snapshots: list[int] = Field(
        default_factory=list, description="The versions whose snapshots are kept.")
    pruned: list[str] = Field(
        default_factory=list, description="Store prefixes removed by the last pruning.")


class Resources(SpecModel):
    """Container resources (quantities as Kubernetes writes them: 2, "500m", "4Gi")."""

    requests: dict[str, Annotated[int | str, Field(
        json_schema_extra={"x-kubernetes-int-or-string": True})]] | None = Field(
        default=None, description="Resources the encoder container is guaranteed, by name "
        "(cpu, memory, ...).")
    limits: dict[str, Annotated[int | str, Field(
        json_schema_extra={"x-kubernetes-int-or-string": True})]] | None = Field(
        default=None, description="The most the encoder container may use, by name.")

    def threads(self) -> int | None:
        """The encoder's diff threads: its CPU request (else limit) rounded up; None if
        neither is a plain CPU quantity (2, "1.5", "500m")."""
        cpu = (self.requests or {}).get("cpu") or (self.limits or {}).get("cpu")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", str(cpu)) if cpu is not None else None
        if m is None:
            return None
        cpus = float(m[1]) / (1000 if m[2] else 1)
        return max(1, math.ceil(cpus))


class Toleration(SpecModel):
    """One toleration of encoder pods (core/v1 Toleration)."""

    key: Annotated[str, Field(max_length=317)] | None = Field(
        default=None, description="The taint key tolerated; empty with Exists: every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (to value); default Equal.")
    value: Annotated[str, Field(max_length=63)] | None = Field(
        default=None, description="The taint value tolerated, with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect tolerated; default: every effect.")
    toleration_seconds: int | None = Field(
        default=None, description="Seconds a NoExecute taint is tolerated; default: forever.")


DEFAULT_PROFILE = "default"
MAX_ENDPOINT_URLS = 256  # as a WeightRefit's spec.encoder.owners
_HTTP_URL = r"^https?://[^\s/?#]+(/[^\s?#]*)?$"


class EncoderEndpoint(SpecModel):
    """Warm encoders (``dcr encoder``) that publish a refit's attempts, one per owner.

    With an endpoint, an attempt starts no Job: owner ``k`` is a ``POST /v1/publish`` to
    ``urls[k]`` with the token from ``tokenSecretRef`` (a Secret labelled
    dcr.dev/encoder-token=true), and the refit's ``spec.encoder.owners`` must equal the
    number of URLs. The encoder writes to its own ``--store``, which must be the
    fleet's, and reads checkpoints only under its own ``--checkpoint-root``.
    """

    urls: Annotated[list[Annotated[str, Field(max_length=2048, pattern=_HTTP_URL)]], Field(
        min_length=1, max_length=MAX_ENDPOINT_URLS)] = Field(
        description="The encoders' base URLs (http:// or https://, no query), one per "
        "owner index: a WeightRefit using this profile sets spec.encoder.owners to their "
        "number.")
    token_secret_ref: SecretKeyRef = Field(
        description="Secret key holding the encoders' bearer token (at least 16 "
        "characters); the Secret must be labelled dcr.dev/encoder-token=true.")


class KubeconfigSecretRef(SpecModel):
    """A key of a Secret in the fleet's namespace that holds a kubeconfig."""

    name: DnsSubdomain = Field(description="The Secret's name, in the fleet's namespace.")
    key: SecretKey = Field(default="kubeconfig", description="The key of the Secret's data "
                           "that holds the kubeconfig; default kubeconfig.")


class EncoderCluster(SpecModel):
    """Another Kubernetes cluster (the training cluster) where a profile's encoder and
    snapshot Jobs run: the operator reaches it with the kubeconfig in
    ``kubeconfigSecretRef`` (a Secret labelled dcr.dev/encoder-cluster=true) and creates
    the Jobs, and the receiver profile's ConfigMap they mount, in ``namespace`` there.
    docs/two-clusters.md, "Two clusters"."""

    kubeconfig_secret_ref: KubeconfigSecretRef = Field(
        description="Secret key holding a kubeconfig for the training cluster: its current "
        "context, an https server and an inline token or client certificate only (no exec "
        "plugin, auth provider or file path); the Secret must be labelled "
        "dcr.dev/encoder-cluster=true.")
    namespace: DnsLabel = Field(description="The namespace of the training cluster where "
                                "the Jobs run; the Secrets they name must exist there.")


class EncoderProfile(SpecModel):
    """How one kind of encoder pod runs; a WeightRefit picks one by name.

    Everything that shapes the pod lives here, in the fleet (which its admin owns), and
    never in a WeightRefit: whoever may write this may run that image, as that
    ServiceAccount, on those nodes, with those volumes (docs/operations.md, "Who may do
    what"). Unset fields take the operator's defaults (Helm ``encoder.*``).
    """

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!(has(self.endpoint) && has(self.cluster))",
        "message": "set at most one of endpoint (warm encoders) and cluster (where its Jobs "
                   "run)"}]})

    name: DnsLabel = Field(description="What WeightRefits name in spec.encoder.profile.")
    image: Annotated[str, Field(min_length=1, max_length=512)] | None = Field(
        default=None, description="The image (it must provide `dcr`); one the operator "
        "allows (Helm encoder.image and encoder.allowedImages). Default: encoder.image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Always, IfNotPresent or Never; default: Kubernetes' "
        "(IfNotPresent unless the tag is latest).")
    service_account_name: DnsSubdomain | None = Field(
        default=None, description="Default: the operator's encoder.serviceAccount.")
    resources: Resources | None = Field(
        default=None, description="The encoder container's resource requests and limits; "
        "default: the operator's encoder.resources.")
    node_selector: Annotated[dict[str, Annotated[str, Field(max_length=63)]] | None,
                             Field(max_length=64)] = Field(
        default=None, description="Node labels the encoder pod's node must carry.")
    tolerations: Annotated[list[Toleration] | None, Field(max_length=64)] = Field(
        default=None, description="Taints the encoder pod tolerates.")
    volumes: ProfileVolumes | None = Field(
        default=None, description="Volumes the encoder container mounts, such as the "
        "one holding the checkpoints (dcr encode reads the base and target checkpoints "
        "from a path): each a persistentVolumeClaim, hostPath or nfs, read-only unless "
        "readOnly is false.")
    endpoint: EncoderEndpoint | None = Field(
        default=None, description="Warm encoders to call instead of starting an encoder "
        "Job per attempt (docs/publishing.md, \"Warm encoder\"); the pod fields above "
        "then go unused.")
    cluster: EncoderCluster | None = Field(
        default=None, description="Run the Jobs in another cluster (the training cluster) "
        "instead of the fleet's namespace; not with endpoint.")

    @model_validator(mode="after")
    def _jobs_somewhere(self) -> EncoderProfile:
        if self.cluster is not None and self.endpoint is not None:
            raise ValueError(f"encoder profile {self.name!r}: set at most one of endpoint "
                             "(warm encoders) and cluster (where its Jobs run)")
        return self


_PEERS_NEED = ("catchUp.peers needs store (its history judges a peer's copy) and a selector "
               "of matchLabels alone (the peers' Service selects by them, and every pod it "
               "selects is sent the peer token)")


class RolloutFleetSpec(SpecModel):
    """Which pods are the fleet, how to reach them, and how their refits run."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "has(self.store) || has(self.relay)",
        "message": "set store, relay, or both: where encoder Jobs publish"}, {
        "rule": "has(self.store) || !has(self.retention) || (!has(self.retention.snapshotEvery)"
                " && !has(self.retention.keepSnapshots))",
        "message": "retention needs the store that holds the history: set store (beside "
                   "relay for a relay fleet)"}, {
        "rule": "!has(self.catchUp) || !has(self.catchUp.peers) || !self.catchUp.peers || "
                "(has(self.store) && !has(self.selector.matchExpressions))",
        "message": _PEERS_NEED}]})

    selector: LabelSelector
    agent: AgentSpec
    store: StoreSpec | None = Field(
        default=None, description="The object store encoders publish to; with relay, the "
        "store in the training cluster's region that encoders write every attempt through "
        "to and that holds the fleet's history (pods catch up from it).")
    relay: RelaySpec | None = Field(
        default=None, description="The relay tree encoders publish to (attempts reach the "
        "pods through it); without store the fleet keeps no history.")
    groups: ReplicaGroups | None = Field(
        default=None, description="Replicas span pods: one receiver per group of selected "
        "pods, through its leader's agent. Default: each selected pod is a receiver.")
    initial: InitialVersion
    commit_policy: CommitPolicy = Field(
        default_factory=CommitPolicy, description="When a refit may commit, and how long an "
        "attempt may take; defaults as its fields say.")
    retry_limit: Annotated[int, Field(ge=1, le=32)] = Field(
        default=4, description="Attempts per transition before the refit fails.")
    retention: Retention = Field(
        default_factory=Retention, description="What the store keeps for catch-up (a store "
        "fleet); default: everything.")
    catch_up: CatchUp = Field(
        default_factory=CatchUp, description="Where pods behind the committed version may "
        "take it from besides the store; default: the store alone.")
    refit_history_limit: Annotated[int, Field(ge=0, le=10_000)] = Field(
        default=100, description="Finished (Committed or Failed) WeightRefits of this fleet "
        "the operator keeps, the newest; older ones are deleted, their finalizer removing "
        "what they left in the store (never a committed attempt). Default 100.")
    refit_ttl_seconds_after_finished: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Seconds a finished WeightRefit of this fleet is kept "
        "after its completionTime, whatever refitHistoryLimit allows; default: no limit.")
    encoder_profiles: Annotated[list[EncoderProfile], Field(max_length=16, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})] = Field(
        default=[], description="The encoder pods WeightRefits of this fleet may ask for, "
        f"by name; without one named {DEFAULT_PROFILE!r}, that one is the operator's "
        "defaults.")

    @model_validator(mode="after")
    def _one_destination(self) -> RolloutFleetSpec:
        if self.store is None and self.relay is None:
            raise ValueError("set store, relay, or both: where encoder Jobs publish")
        r = self.retention
        if self.store is None and (r.snapshot_every is not None or r.keep_snapshots is not None):
            raise ValueError("retention needs the store that holds the history: set store "
                             "(beside relay for a relay fleet)")
        if self.catch_up.peers and (self.store is None
                                    or self.selector.match_expressions is not None):
            raise ValueError(_PEERS_NEED)
        return self

    def encoder_profile(self, name: str) -> EncoderProfile | None:
        """The encoder profile named ``name``, if the fleet defines one."""
        return next((p for p in self.encoder_profiles if p.name == name), None)


class ReceiverState(StatusModel):
    """One rollout rank as its agent last reported it."""

    name: str = Field(description="The pod's name (a group's: its leader pod's).")
    url: str | None = Field(default=None, description="The agent's address (pod IP, port).")
    pods: list[str] | None = Field(default=None, description="A group's pods (spec.groups), "
                                   "its leader first.")
    version: int | None = Field(default=None, description="The version the pod serves.")
    state: str | None = Field(
        default=None, description="Where the attempt it takes part in stands, "
        f"{one_of(s.value for s in AttemptState)}; unset between attempts "
        "(dcr/protocol/states.py).")
    attempt: str | None = Field(default=None, description="The attempt it takes part in.")
    error: str | None = Field(default=None, description="Why its agent did not answer, if "
                              "it did not.")
    last_ack: Annotated[str | None, Field(json_schema_extra=RFC3339)] = Field(
        default=None, description="When it last acknowledged a flush.")
    last_seen: Annotated[str | None, Field(json_schema_extra=RFC3339)] = Field(
        default=None, description="When its agent last answered (RFC 3339, UTC).")
    release: str | None = Field(
        default=None, description="The DCR release its agent runs, as its last answer "
        "named it: another release than the operator's is fine within the supported skew "
        "(docs/upgrades.md); an agent API version the operator does not read shows in "
        "error.")


class ServingVersion(StatusModel):
    """How many receivers serve one version."""

    version: int = Field(description="A version the receivers' weights hold.")
    receivers: int = Field(description="Receivers whose agents report it (all of them, "
                           "not only those listed under receivers).")


class RolloutFleetStatus(StatusModel):
    """The fleet's commit record, its receivers and its conditions, as the operator saw them."""

    observed_generation: int | None = Field(
        default=None, description="The metadata.generation this status was written for.")
    commit: CommitRecordStatus | None = None
    active_refit: str | None = Field(
        default=None, description="The WeightRefit that holds the fleet now, if one does.")
    receivers: list[ReceiverState] = Field(
        default_factory=list, json_schema_extra=list_map("name"),
        description="Receivers (selected Running pods) as their agents last reported: "
        "those behind the committed version or unreachable first, then by name, at most 100 "
        "(receiverCount and readyReceivers count all).")
    receiver_count: int | None = Field(
        default=None, description="Receivers: Running pods the selector matches (with "
        "spec.groups: groups, complete or not).")
    pod_count: int | None = Field(
        default=None, description="Pods of the receivers counted (without spec.groups: "
        "receiverCount).")
    ready_receivers: int | None = Field(
        default=None, description="Receivers reporting the committed version.")
    serving_versions: list[ServingVersion] = Field(
        default_factory=list, json_schema_extra=list_map("version"),
        description="The versions the receivers serve, newest first, with how many serve "
        "each: what a trainer bounding staleness (X-DCR-Min-Version) may be answered with.")
    history: HistoryStatus | None = Field(
        default=None, description="What the store keeps for catch-up (a store fleet).")
    peers: PeersStatus | None = Field(
        default=None, description="What the pods are given to catch up from each other "
        "(spec.catchUp.peers).")
    conditions: list[Condition] = Field(
        default_factory=list, json_schema_extra=CONDITIONS_LIST,
        description="Ready, Progressing and Degraded (api/conditions.py).")



PRINTER_COLUMNS = [
    column("Version", ".status.commit.committedVersion", "integer"),
    column("Ready", ".status.readyReceivers", "integer"),
    column("Receivers", ".status.receiverCount", "integer"),
    column("Pods", ".status.podCount", "integer"),
    column("Refit", ".status.activeRefit"),
    condition_column("Status", FleetCondition.READY, "status"),
    AGE,
    condition_column("Message", FleetCondition.READY, "message", priority=1),
]
