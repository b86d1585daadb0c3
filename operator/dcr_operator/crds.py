"""The RolloutFleet and WeightRefit CRDs: pydantic models, the one source of truth.

The models parse what arrives from the API server (specs strictly, statuses leniently)
and :func:`crd_manifests` generates the CustomResourceDefinitions from them: a
structural schema (:mod:`.schema`), CEL rules for the immutable fields, conditions as a
list-map keyed by ``type``, the status subresource and the printer columns. kopf's
peering CRDs ship beside them. ``python -m dcr_operator.crds`` writes every CRD into
``crds/`` and ``charts/dcr/crds/``; a test keeps the checked-in files equal to the
generated ones.

Timestamps in status are RFC 3339 strings in UTC (``2025-01-31T12:00:00Z``), as the
API server writes them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from dcr_operator.schema import structural
from dcr_operator.volumes import ProfileVolumes

GROUP = "dcr.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
FLEET_PLURAL = "rolloutfleets"
REFIT_PLURAL = "weightrefits"
REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUT_DIRS = (REPO_ROOT / "crds", REPO_ROOT / "charts" / "dcr" / "crds")

_IMMUTABLE = "self == oldSelf"
_RFC3339 = {"format": "date-time"}
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"

# Names of other objects, as Kubernetes requires them for that kind, checked by pydantic
# and by the API server (the pattern is in the CRD schema). A name goes into a REST path,
# so a '#', '?', '/' or '..' there would change which object a request reaches.
DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=f"^{_LABEL}$")]
"""An RFC 1123 label: encoder profile names."""
DnsSubdomain = Annotated[str, Field(min_length=1, max_length=253,
                                    pattern=rf"^{_LABEL}(\.{_LABEL})*$")]
"""An RFC 1123 subdomain: the names of RolloutFleets, Secrets and ServiceAccounts."""
SecretKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]
"""A key of a Secret's data, as Kubernetes allows it."""


class _Spec(BaseModel):
    """What users write: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel,
                              populate_by_name=True)


class _Status(BaseModel):
    """What the operator writes; read leniently (another writer may add fields)."""

    model_config = ConfigDict(extra="ignore", frozen=True, alias_generator=to_camel,
                              populate_by_name=True)


# --- shared pieces --------------------------------------------------------------------

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Status):
    """One condition, following the Kubernetes API conventions (metav1.Condition)."""

    type: Annotated[str, Field(min_length=1, max_length=316)]
    status: ConditionStatus
    reason: Annotated[str, Field(min_length=1, max_length=1024,
                                 pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")]
    message: Annotated[str, Field(max_length=32768)] = ""
    last_transition_time: Annotated[str, Field(json_schema_extra=_RFC3339)]
    observed_generation: Annotated[int, Field(ge=0)] | None = None


_CONDITIONS: dict[str, Any] = {
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}


class SecretKeyRef(_Spec):
    """A key of a Secret in the resource's namespace (labelled for its use: see fleet.py)."""

    name: DnsSubdomain
    key: SecretKey = "token"


class SecretRef(_Spec):
    """A Secret in the resource's namespace (labelled for its use: see fleet.py)."""

    name: DnsSubdomain


class CommitRecordStatus(_Status):
    """The fleet's commit record: the one durable fact of a refit (docs/protocol.md)."""

    committed_version: Annotated[int, Field(ge=0)]
    baseline_id: str = Field(description="The committed version's checkpoint (its source).")
    attempt: str = Field(description="The attempt that committed it; empty initially.")
    refit: str | None = Field(default=None, description="The WeightRefit that committed it.")
    committed_at: Annotated[str | None, Field(json_schema_extra=_RFC3339)] = None


# --- RolloutFleet ---------------------------------------------------------------------


class LabelSelectorRequirement(_Spec):
    key: Annotated[str, Field(min_length=1, max_length=317)]
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: Annotated[list[Annotated[str, Field(max_length=63)]] | None,
                      Field(max_length=64)] = None


_NARROWING = ("In", "Exists")  # operators that select only pods carrying a label
_SELECTS_SOME = ("(has(self.matchLabels) && size(self.matchLabels) > 0) || "
                 "(has(self.matchExpressions) && self.matchExpressions.exists(e, "
                 + " || ".join(f"e.operator == '{o}'" for o in _NARROWING) + "))")
_EMPTY_SELECTOR = ("selector needs a matchLabels entry or an In or Exists expression: an "
                   "empty selector (or NotIn / DoesNotExist alone) makes every pod of the "
                   "namespace a receiver, and every receiver gets the agent token")


class LabelSelector(_Spec):
    """Which pods of the namespace are the fleet's rollout ranks (metav1.LabelSelector).

    Never one that selects (nearly) every pod: each receiver is sent the agent token.
    """

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": _SELECTS_SOME, "message": _EMPTY_SELECTOR}]})

    match_labels: Annotated[dict[str, Annotated[str, Field(max_length=63)]] | None,
                            Field(max_length=64)] = None
    match_expressions: Annotated[list[LabelSelectorRequirement] | None,
                                 Field(max_length=64)] = None

    @model_validator(mode="after")
    def _selects_some(self) -> LabelSelector:
        if not self.match_labels and not any(
                e.operator in _NARROWING for e in self.match_expressions or []):
            raise ValueError(_EMPTY_SELECTOR)
        return self


class AgentSpec(_Spec):
    """How the operator reaches each pod's agent sidecar."""

    port: Annotated[int, Field(ge=1, le=65535)] = 8471
    scheme: Literal["http", "https"] = "http"
    token_secret_ref: SecretKeyRef = Field(
        description="Secret key holding the agents' bearer token (at least 16 characters).")
    timeout_seconds: Annotated[float, Field(gt=0, le=600)] = Field(
        default=30.0, description="Seconds per agent call that does not wait for staging.")


class StoreSpec(_Spec):
    """The object store encoder Jobs publish to and agents read from."""

    uri: Annotated[str, Field(pattern=r"^(s3|file)://.+")] = Field(
        description="s3://bucket/prefix, or file:///path on a volume every party mounts.")
    endpoint: str | None = Field(default=None, description="S3 endpoint URL (S3-compatible).")
    region: str | None = None
    credentials_secret_ref: SecretRef | None = Field(
        default=None, description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "passed to encoder Jobs as environment and used by the finalizer's cleanup.")


class RelaySpec(_Spec):
    """The root of a relay tree encoder Jobs publish to (agents read from their own node).

    The relay nodes run beside the agents (``dcr relay``, see docs/operations.md); each
    payload crosses from the training side once. A relay carries one manifest per
    attempt, so refits of a relay fleet run one encoder owner.
    """

    url: Annotated[str, Field(pattern=r"^https?://.+")] = Field(
        description="The root node's URL, as encoder pods reach it.")
    token_secret_ref: SecretKeyRef = Field(
        description="Secret key holding the relay tree's bearer token.")


class InitialVersion(_Spec):
    """The version the fleet's pods start with: the commit record before any refit."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": _IMMUTABLE, "message": "initial is immutable: it seeds the commit record"}]})

    version: Annotated[int, Field(ge=0)] = 0
    checkpoint: Annotated[str, Field(min_length=1)] = Field(
        description="That version's checkpoint, as encoder Jobs and agents read it.")


class CommitPolicy(_Spec):
    """When a refit may commit, and how long an attempt may take."""

    min_receivers: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Receivers that must take part in an attempt; default: "
        "every pod the selector matches when the refit starts.")
    attempt_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 600
    gate: Literal["Sync", "Async"] = Field(
        default="Sync", description="Sync: close request gates first; Async: after staging.")


class Resources(_Spec):
    """Container resources (quantities as Kubernetes writes them: 2, "500m", "4Gi")."""

    requests: dict[str, Annotated[int | str, Field(
        json_schema_extra={"x-kubernetes-int-or-string": True})]] | None = None
    limits: dict[str, Annotated[int | str, Field(
        json_schema_extra={"x-kubernetes-int-or-string": True})]] | None = None


class Toleration(_Spec):
    """One toleration of encoder pods (core/v1 Toleration)."""

    key: Annotated[str, Field(max_length=317)] | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: Annotated[str, Field(max_length=63)] | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


DEFAULT_PROFILE = "default"
MAX_ENDPOINT_URLS = 256  # as a WeightRefit's spec.encoder.owners
_HTTP_URL = r"^https?://[^\s/?#]+(/[^\s?#]*)?$"


class EncoderEndpoint(_Spec):
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


class EncoderProfile(_Spec):
    """How one kind of encoder pod runs; a WeightRefit picks one by name.

    Everything that shapes the pod lives here, in the fleet (which its admin owns), and
    never in a WeightRefit: whoever may write this may run that image, as that
    ServiceAccount, on those nodes, with those volumes (docs/operations.md, "Who may do
    what"). Unset fields take the operator's defaults (Helm ``encoder.*``).
    """

    name: DnsLabel = Field(description="What WeightRefits name in spec.encoder.profile.")
    image: Annotated[str, Field(min_length=1, max_length=512)] | None = Field(
        default=None, description="The image (it must provide `dcr`); one the operator "
        "allows (Helm encoder.image and encoder.allowedImages). Default: encoder.image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    service_account_name: DnsSubdomain | None = Field(
        default=None, description="Default: the operator's encoder.serviceAccount.")
    resources: Resources | None = None
    node_selector: Annotated[dict[str, Annotated[str, Field(max_length=63)]] | None,
                             Field(max_length=64)] = None
    tolerations: Annotated[list[Toleration] | None, Field(max_length=64)] = None
    volumes: ProfileVolumes | None = Field(
        default=None, description="Volumes the encoder container mounts, such as the "
        "one holding the checkpoints (dcr encode reads the base and target checkpoints "
        "from a path): each a persistentVolumeClaim, hostPath or nfs, read-only unless "
        "readOnly is false.")
    endpoint: EncoderEndpoint | None = Field(
        default=None, description="Warm encoders to call instead of starting an encoder "
        "Job per attempt (docs/operations.md, \"Warm encoder\"); the pod fields above "
        "then go unused.")


class RolloutFleetSpec(_Spec):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "has(self.store) != has(self.relay)",
        "message": "set exactly one of store and relay: where encoder Jobs publish"}]})

    selector: LabelSelector
    # Documentation only. The agent, not the operator, talks to the serving engine, and
    # each pod's agent picks its adapter from its own --engine flag: the engine is a
    # property of the pod template, which may change in a rolling update. Kept (not
    # removed) so v1alpha1 manifests that set it still pass strict field validation,
    # and shown by `kubectl get rolloutfleets -o wide`.
    runtime: Literal["vllm", "sglang", "hf", "vllm-ref"] | None = Field(
        default=None, description="What the fleet's pods serve with, for whoever reads "
        "the fleet (kubectl get -o wide): vllm, sglang, or the reference engine (dcr "
        "serve --runtime hf|vllm-ref). Documentation only: the operator never reads it; "
        "each pod's agent drives its engine as its --engine flag says.")
    agent: AgentSpec
    store: StoreSpec | None = None
    relay: RelaySpec | None = None
    initial: InitialVersion
    commit_policy: CommitPolicy = Field(default_factory=CommitPolicy)
    retry_limit: Annotated[int, Field(ge=1, le=32)] = Field(
        default=4, description="Attempts per transition before the refit fails.")
    encoder_profiles: Annotated[list[EncoderProfile], Field(max_length=16, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})] = Field(
        default=[], description="The encoder pods WeightRefits of this fleet may ask for, "
        f"by name; without one named {DEFAULT_PROFILE!r}, that one is the operator's "
        "defaults.")

    @model_validator(mode="after")
    def _one_destination(self) -> RolloutFleetSpec:
        if (self.store is None) == (self.relay is None):
            raise ValueError("set exactly one of store and relay: where encoder Jobs publish")
        return self


class ReceiverState(_Status):
    """One rollout rank as its agent last reported it."""

    name: str
    url: str | None = None
    version: int | None = None
    state: str | None = None
    attempt: str | None = None
    error: str | None = None
    last_ack: Annotated[str | None, Field(json_schema_extra=_RFC3339)] = Field(
        default=None, description="When it last acknowledged a flush.")
    last_seen: Annotated[str | None, Field(json_schema_extra=_RFC3339)] = None


class RolloutFleetStatus(_Status):
    observed_generation: int | None = None
    commit: CommitRecordStatus | None = None
    active_refit: str | None = None
    receivers: Annotated[list[ReceiverState], Field(json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})] = []
    receiver_count: int | None = None
    ready_receivers: int | None = Field(
        default=None, description="Receivers reporting the committed version.")
    conditions: Annotated[list[Condition], Field(json_schema_extra=_CONDITIONS)] = []


# --- WeightRefit ----------------------------------------------------------------------


class RefitEncoder(_Spec):
    """What a WeightRefit chooses of its encoder Job: a profile of its fleet and the split.

    No image, ServiceAccount or scheduling: those come from the fleet's profile, so
    creating a WeightRefit never amounts to creating pods of one's own making.
    """

    profile: DnsLabel = Field(
        default=DEFAULT_PROFILE, description="One of the fleet's spec.encoderProfiles.")
    owners: Annotated[int, Field(ge=1, le=256)] = Field(
        default=1, description="Parallel owners: Job completions, tensors split by name.")
    bucket_mib: Annotated[int | None, Field(ge=1, le=4096, alias="bucketMiB")] = None


class SourceSpec(_Spec):
    checkpoint: Annotated[str, Field(min_length=1)] = Field(
        description="The target version's Hugging Face checkpoint (training side).")


class WeightRefitSpec(_Spec):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": _IMMUTABLE, "message": "a WeightRefit's spec is immutable: create another"},
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


class AttemptStatus(_Status):
    id: str
    mode: Literal["mixed", "overwrite"]
    outcome: AttemptOutcome
    reason: str | None = None
    start_time: Annotated[str, Field(json_schema_extra=_RFC3339)]
    completion_time: Annotated[str | None, Field(json_schema_extra=_RFC3339)] = None
    stages: dict[str, float] = Field(default={}, description="Wall seconds per stage.")
    payloads: int = Field(default=0, description="Payloads each receiver applied.")
    bytes: int = Field(default=0, description="Payload bytes applied, summed over receivers.")
    receivers: list[str] = []
    rejoined: list[str] = []
    job: str | None = Field(default=None, description="The encoder Job that published it.")
    endpoint: str | None = Field(
        default=None, description="The encoder profile whose warm endpoint published it "
        "(no Job ran).")


class ReceiverProgress(_Status):
    name: str
    attempt: str | None = None
    state: str | None = None
    payloads: int = 0
    bytes: int = 0
    apply_seconds: float | None = None
    last_ack: Annotated[str | None, Field(json_schema_extra=_RFC3339)] = None
    error: str | None = None


class WeightRefitStatus(_Status):
    observed_generation: int | None = None
    phase: Phase | None = None
    attempts: Annotated[list[AttemptStatus], Field(json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]})] = []
    attempt_count: int = 0
    bytes: int = Field(default=0, description="Payload bytes over all attempts and receivers.")
    receivers: Annotated[list[ReceiverProgress], Field(json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})] = []
    committed: CommitRecordStatus | None = None
    start_time: Annotated[str | None, Field(json_schema_extra=_RFC3339)] = None
    completion_time: Annotated[str | None, Field(json_schema_extra=_RFC3339)] = None
    conditions: Annotated[list[Condition], Field(json_schema_extra=_CONDITIONS)] = []


# --- CRD manifests --------------------------------------------------------------------


def _column(name: str, path: str, kind: str = "string", *,
            priority: int | None = None) -> dict[str, Any]:
    """A printer column; priority 1 shows only with ``kubectl get -o wide``."""
    out: dict[str, Any] = {"name": name, "type": kind, "jsonPath": path}
    if priority is not None:
        out["priority"] = priority
    return out


_AGE = _column("Age", ".metadata.creationTimestamp", "date")


def _crd(kind: str, plural: str, short: list[str], spec: type[BaseModel],
         status: type[BaseModel], columns: list[dict[str, Any]],
         description: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": structural(spec.model_json_schema(by_alias=True)),
            "status": structural(status.model_json_schema(by_alias=True), defaults=False),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural,
                      "singular": kind.lower(), "shortNames": short, "categories": ["dcr"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
            }],
        },
    }


def fleet_crd() -> dict[str, Any]:
    return _crd("RolloutFleet", FLEET_PLURAL, ["fleet"], RolloutFleetSpec, RolloutFleetStatus, [
        _column("Version", ".status.commit.committedVersion", "integer"),
        _column("Ready", ".status.readyReceivers", "integer"),
        _column("Receivers", ".status.receiverCount", "integer"),
        _column("Refit", ".status.activeRefit"),
        _column("Status", '.status.conditions[?(@.type=="Ready")].status'),
        _AGE,
        _column("Runtime", ".spec.runtime", priority=1),
        _column("Message", '.status.conditions[?(@.type=="Ready")].message', priority=1),
    ], "A set of rollout pods (label selector) refit together; its status holds the "
       "commit record.")


def refit_crd() -> dict[str, Any]:
    return _crd("WeightRefit", REFIT_PLURAL, ["wr", "refit"], WeightRefitSpec,
                WeightRefitStatus, [
        _column("Fleet", ".spec.fleet"),
        _column("Version", ".spec.targetVersion", "integer"),
        _column("Phase", ".status.phase"),
        _column("Attempts", ".status.attemptCount", "integer"),
        _column("Bytes", ".status.bytes", "integer"),
        _AGE,
        _column("Base", ".spec.baseVersion", "integer", priority=1),
        _column("Message", '.status.conditions[?(@.type=="Failed")].message', priority=1),
    ], "One transition of one RolloutFleet to a target version.")


def _peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    """kopf's peering resource (operators of one deployment find each other through it)."""
    preserve = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {
            "group": "kopf.dev",
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "status": preserve}, "x-kubernetes-preserve-unknown-fields": True}},
            }],
        },
    }


def crd_manifests() -> dict[str, dict[str, Any]]:
    """File name -> CRD, for every CRD the chart installs."""
    return {
        f"{GROUP}_{FLEET_PLURAL}.yaml": fleet_crd(),
        f"{GROUP}_{REFIT_PLURAL}.yaml": refit_crd(),
        "kopf.dev_clusterkopfpeerings.yaml":
            _peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
        "kopf.dev_kopfpeerings.yaml": _peering_crd("KopfPeering", "kopfpeerings", "Namespaced"),
    }


def render(crd: dict[str, Any]) -> str:
    header = ("# Generated by `python -m dcr_operator.crds` from dcr_operator/crds.py. "
              "Do not edit.\n")
    return header + yaml.safe_dump(crd, sort_keys=False, width=100)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr_operator.crds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a checked-in CRD differs")
    p.add_argument("--out", type=Path, action="append",
                   help="output directory (repeatable; default: crds/ and charts/dcr/crds/)")
    args = p.parse_args(argv)
    stale = []
    for out in args.out or OUTPUT_DIRS:
        for name, crd in crd_manifests().items():
            path, text = out / name, render(crd)
            if path.exists() and path.read_text() == text:
                continue
            stale.append(path)
            if not args.check:
                out.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'} {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
