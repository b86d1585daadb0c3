"""Encoder Jobs: one indexed Job per attempt, and the owner handles that wait for it.

Index ``k`` runs ``dcr encode ... --owner k --owners N``. The Job's name is a function of
the refit and the attempt (:func:`job_name`), so creating it again finds the same Job; what
shapes its pods comes from the fleet's encoder profile, never the WeightRefit
(:func:`encoder_pod`). :class:`JobOwner` waits for index ``k`` to complete.
docs/operator.md, "What happens, and when things go wrong".
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

from dcr.format.payload import Mode
from dcr.http.tls import ENV_CA_DATA, ENV_SERVER_NAME
from dcr.owner.settings import EncodeSettings
from dcr.protocol import termination
from dcr.protocol.records import Attempt, CommitRecord
from dcr.settings import MiB
from dcr_operator.api.common import GROUP
from dcr_operator.api.rolloutfleet import (
    DEFAULT_PROFILE,
    EncoderProfile,
    RelaySpec,
    RolloutFleetSpec,
)
from dcr_operator.api.volumes import PROFILE_DIR, PROFILE_VOLUME
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.errors import (
    ApiError,
    ApiUnreachable,
    Conflict,
    EncoderJobFailed,
    InvalidResource,
    NotFound,
)
from dcr_operator.kube import api_path
from dcr_operator.settings import OperatorSettings
from dcr_operator.sites import UID_LABEL, Site

log = logging.getLogger(__name__)

PROFILE_KEY = "profile.json"
COMPONENT_LABEL = f"{GROUP}/component"
REFIT_LABEL = f"{GROUP}/refit"
ATTEMPT_LABEL = f"{GROUP}/attempt"
# What the Pod Security "restricted" level asks, as the operator's own Deployment runs: the
# image's user must be numeric and not root (the dcr image's is 65532).
POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False,
                                      "readOnlyRootFilesystem": True,
                                      "capabilities": {"drop": ["ALL"]}}
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
MESSAGE_BYTES, MESSAGES_SHOWN = 512, 2  # of each failed pod's message, and how many differ
OWNER_REF = "$(DCR_OWNER)"  # the one reference the kubelet expands: the completion index
_MAX_JOB_NAME = 52  # pods of indexed Jobs are named <job>-<index>-<5 chars>; hostnames <= 63


def short_name(name: str, limit: int) -> str:
    """``name`` if it fits, else a prefix and a digest of the whole (stable, unique)."""
    if len(name) <= limit:
        return name
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    return f"{name[: limit - 9].rstrip('-')}-{digest}"


def job_name(refit: str, attempt: str) -> str:
    """The encoder Job of ``attempt`` of WeightRefit ``refit``: the same on every call."""
    return f"{short_name(refit, _MAX_JOB_NAME - len(attempt) - 1)}-{attempt}"


def profile_name(refit: str) -> str:
    return short_name(f"{refit}-profile", 253)


def encode_args(*, base: str, target: str, store: str, attempt: Attempt, owners: int,
                profile: bool, bucket_mib: int | None, threads: int | None = None
                ) -> list[str]:
    """``dcr encode`` arguments of one attempt; ``$(DCR_OWNER)`` is the Job index.

    Built by :meth:`EncodeSettings.argv <dcr.owner.settings.EncodeSettings.argv>`, as
    ``ProcessOwner``'s are; a ``bucket_mib`` of None keeps the encoder's default, and
    ``threads`` of None the cores the encoder's container may use.
    """
    t = attempt.transition
    settings = EncodeSettings(
        target_version=t.target_version, base_version=t.base_version, mode=attempt.mode,
        attempt=attempt.id, owners=owners,
        bucket_bytes=EncodeSettings.bucket_bytes if bucket_mib is None else bucket_mib * MiB,
        threads=threads, profile_path=Path(PROFILE_DIR, PROFILE_KEY) if profile else None)
    return settings.argv(base, target, store=store, owner=OWNER_REF)


def kubelet_literal(arg: str) -> str:
    """``arg`` as the kubelet must pass it: it expands ``$(NAME)`` in a container's args
    from the container's environment (the store credentials among it) and ``$$`` is the
    only escape. Every argument built from a fleet's or refit's fields goes through it."""
    return arg.replace("$", "$$")


def encoder_pod(spec: WeightRefitSpec, fleet: RolloutFleetSpec, fleet_name: str,
                settings: OperatorSettings) -> EncoderProfile:
    """The fleet's encoder profile the refit names, with the operator's defaults filled in.

    InvalidResource if the fleet has no such profile or names an image the operator
    does not allow: the fleet's owner can fix either, and the refit then proceeds.
    """
    wanted = spec.encoder.profile
    found = fleet.encoder_profile(wanted)
    if found is None and wanted != DEFAULT_PROFILE:
        have = ", ".join(p.name for p in fleet.encoder_profiles) or "none"
        raise InvalidResource(f"The WeightRefit asks for encoder profile {wanted!r}, which "
                              f"RolloutFleet {fleet_name} does not define (its "
                              f"spec.encoderProfiles: {have}).")
    profile = found or EncoderProfile(name=DEFAULT_PROFILE)
    image = profile.image or settings.encoder_image
    if not settings.allows_image(image):
        raise InvalidResource(f"Encoder profile {profile.name!r} of RolloutFleet {fleet_name} "
                              f"names image {image!r}, which the operator does not allow "
                              "(Helm encoder.image and encoder.allowedImages).")
    return profile.model_copy(update={
        "image": image,
        "image_pull_policy": profile.image_pull_policy or settings.encoder_image_pull_policy,
        "service_account_name": (profile.service_account_name
                                 or settings.encoder_service_account or None)})


def volumes_of(shape: EncoderProfile, profile: str | None
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The encoder container's volume mounts and the pod's volumes: the receiver
    profile's ConfigMap (when there is one), then the encoder profile's own volumes."""
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if profile is not None:
        mounts.append({"name": PROFILE_VOLUME, "mountPath": PROFILE_DIR, "readOnly": True})
        volumes.append({"name": PROFILE_VOLUME, "configMap": {"name": profile}})
    for v in shape.volumes or []:
        mounts.append(v.volume_mount())
        volumes.append(v.pod_volume())
    return mounts, volumes


def _pod(shape: EncoderProfile, fleet: RolloutFleetSpec, args: list[str],
         env: list[dict[str, Any]], profile: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec of an encoder-profile pod running ``dcr`` with ``args``, and its one
    container: the store's endpoint and credentials, the profile's volumes and shape.
    Every argument reaches ``dcr`` as written (:func:`kubelet_literal`), but the owner
    index reference."""
    store = fleet.store
    env = [*env, {"name": termination.PATH_ENV, "value": termination.KUBERNETES_PATH}]
    if store is not None and store.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": store.endpoint})
    if store is not None and store.region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": store.region})
    container: dict[str, Any] = {"name": "encoder", "image": shape.image,
                                 "imagePullPolicy": shape.image_pull_policy,
                                 "command": ["dcr"], "env": env,
                                 "args": [a if a == OWNER_REF else kubelet_literal(a)
                                          for a in args],
                                 "securityContext": CONTAINER_SECURITY,
                                 # dcr writes why it failed there, one sanitized sentence
                                 "terminationMessagePath": termination.KUBERNETES_PATH,
                                 "terminationMessagePolicy": "File"}
    if store is not None and store.credentials_secret_ref is not None:
        container["envFrom"] = [{"secretRef": {"name": store.credentials_secret_ref.name}}]
    if shape.resources is not None:
        container["resources"] = shape.resources.model_dump(exclude_none=True)
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container],
                           "securityContext": POD_SECURITY,
                           "automountServiceAccountToken": False}  # dcr never calls the API
    mounts, volumes = volumes_of(shape, profile)
    if volumes:
        container["volumeMounts"], pod["volumes"] = mounts, volumes
    if shape.service_account_name:
        pod["serviceAccountName"] = shape.service_account_name
    if shape.node_selector:
        pod["nodeSelector"] = dict(shape.node_selector)
    if shape.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True)
                              for t in shape.tolerations]
    return pod, container


def relay_tls_env(relay: RelaySpec) -> list[dict[str, Any]]:
    """What an encoder Job verifies a TLS relay root with (:mod:`dcr.http.tls`): the CA
    bundle from its Secret, as data (no volume), and the name its certificate carries."""
    env: list[dict[str, Any]] = []
    if relay.ca_secret_ref is not None:
        env.append({"name": ENV_CA_DATA, "valueFrom": {"secretKeyRef": {
            "name": relay.ca_secret_ref.name, "key": relay.ca_secret_ref.key}}})
    if relay.server_name:
        env.append({"name": ENV_SERVER_NAME, "value": relay.server_name})
    return env


def job_manifest(*, refit: Mapping[str, Any], spec: WeightRefitSpec, fleet: RolloutFleetSpec,
                 fleet_name: str, base_checkpoint: str, attempt: Attempt,
                 settings: OperatorSettings, profile: str | None, site: Site
                 ) -> dict[str, Any]:
    """The indexed Job that publishes ``attempt`` (every owner one index), in ``site``."""
    enc, store, relay = spec.encoder, fleet.store, fleet.relay
    shape = encoder_pod(spec, fleet, fleet_name, settings)
    name, refit_name = job_name(refit["metadata"]["name"], attempt.id), refit["metadata"]["name"]
    labels = {"app.kubernetes.io/name": "dcr-encoder", "app.kubernetes.io/managed-by":
              "dcr-operator", COMPONENT_LABEL: "encoder", REFIT_LABEL: short_name(refit_name, 63),
              ATTEMPT_LABEL: attempt.id, **site.labels(refit)}
    env: list[dict[str, Any]] = [{"name": "DCR_OWNER", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}}]
    if relay is not None:  # the token from its Secret, never in the arguments
        env.append({"name": "DCR_RELAY_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": relay.token_secret_ref.name, "key": relay.token_secret_ref.key}}})
        env.extend(relay_tls_env(relay))
    destination = store.uri if store is not None else ""
    if relay is not None:  # with a store beside it, each attempt is written through to it
        destination = f"relay+{relay.url}" + (
            f"?through={quote(store.uri, safe=':/')}" if store is not None else "")
    args = encode_args(base=base_checkpoint, target=spec.source.checkpoint, store=destination,
                       attempt=attempt, owners=enc.owners, profile=profile is not None,
                       bucket_mib=enc.bucket_mib,
                       threads=shape.resources.threads() if shape.resources else None)
    pod, _ = _pod(shape, fleet, args, env, profile)
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed", "completions": enc.owners, "parallelism": enc.owners,
        "backoffLimit": 0,  # a failed encoder fails the attempt; the protocol retries it
        "activeDeadlineSeconds": max(1, math.ceil(attempt.deadline - time.time())),
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }
    if settings.encoder_ttl_seconds:
        job_spec["ttlSecondsAfterFinished"] = settings.encoder_ttl_seconds
    t = attempt.transition
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {
            "name": name, "namespace": site.namespace, "labels": labels,
            "annotations": {f"{GROUP}/attempt": attempt.id, f"{GROUP}/mode": attempt.mode,
                            f"{GROUP}/transition": f"{t.base_version}->{t.target_version}",
                            f"{GROUP}/fleet": fleet_name},
            "ownerReferences": site.owner_references(refit),
        },
        "spec": job_spec,
    }


def snapshot_job_manifest(*, refit: Mapping[str, Any], spec: WeightRefitSpec,
                          fleet: RolloutFleetSpec, fleet_name: str,
                          settings: OperatorSettings, site: Site) -> dict[str, Any]:
    """The Job that writes a snapshot of the version the refit committed, from its source
    checkpoint on the training side (``dcr snapshot``; the next commit adopts it)."""
    assert fleet.store is not None  # a fleet without a store keeps no history
    shape = encoder_pod(spec, fleet, fleet_name, settings)
    refit_name = refit["metadata"]["name"]
    labels = {"app.kubernetes.io/name": "dcr-encoder", "app.kubernetes.io/managed-by":
              "dcr-operator", COMPONENT_LABEL: "snapshot",
              REFIT_LABEL: short_name(refit_name, 63), **site.labels(refit)}
    args = ["snapshot", spec.source.checkpoint, "--store", fleet.store.uri,
            "--version", str(spec.target_version)]
    pod, _ = _pod(shape, fleet, args, [], None)
    job_spec: dict[str, Any] = {"completions": 1, "backoffLimit": 2,
                                "template": {"metadata": {"labels": labels}, "spec": pod}}
    if settings.encoder_ttl_seconds:
        job_spec["ttlSecondsAfterFinished"] = settings.encoder_ttl_seconds
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": short_name(f"{refit_name}-snapshot", 63),
                     "namespace": site.namespace, "labels": labels,
                     "annotations": {f"{GROUP}/fleet": fleet_name,
                                     f"{GROUP}/snapshot": str(spec.target_version)},
                     "ownerReferences": site.owner_references(refit)},
        "spec": job_spec,
    }


def refit_selector(refit: Mapping[str, Any]) -> str:
    """The label selector of a refit's Jobs (by uid too: another cluster's namespace may
    hold Jobs of refits of the same name from other namespaces)."""
    return (f"{REFIT_LABEL}={short_name(refit['metadata']['name'], 63)},"
            f"{UID_LABEL}={refit['metadata']['uid']}")


def parse_indexes(text: str | None) -> set[int]:
    """``status.completedIndexes`` ("0,2-4") as a set of indexes."""
    out: set[int] = set()
    for part in (text or "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def job_state(job: Mapping[str, Any], index: int) -> str:
    """``done`` (index completed), ``failed`` (the Job failed) or ``running``."""
    status = job.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("Failed", "FailureTarget"):
            return "failed"
    if index in parse_indexes(status.get("completedIndexes")):
        return "done"
    for c in status.get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "done"
    return "running"


def job_failure(job: Mapping[str, Any]) -> str:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("Failed", "FailureTarget"):
            return f"{c.get('reason', 'Failed')}: {c.get('message', '')}".rstrip(": ")
    return "failed"


def pod_failures(pods: Mapping[str, Any]) -> str:
    """What the failed pods of a Job (a pod list) said as they ended: each distinct
    termination message once, with the owner index of its first pod, sanitized again (a
    pod writes what it likes there), "" if none said anything."""
    ended: list[tuple[int, str]] = []
    for pod in pods.get("items") or []:
        index = (pod.get("metadata", {}).get("annotations") or {}).get(COMPLETION_INDEX, "")
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            state = (c.get("state") or {}).get("terminated") or {}
            message = termination.sanitize(str(state.get("message") or ""), MESSAGE_BYTES)
            if state.get("exitCode") and message:
                ended.append((int(index) if str(index).isdigit() else -1, message))
    said: dict[str, int] = {}
    for index, message in sorted(ended):
        said.setdefault(message, index)
    return "; ".join(f"owner {index}: {message}"
                     for message, index in list(said.items())[:MESSAGES_SHOWN])


@dataclass(kw_only=True)
class EncoderJobs:
    """The encoder Jobs of one WeightRefit run (shared by its owner handles)."""

    site: Site  # where the Jobs run
    refit: Mapping[str, Any]  # the WeightRefit object (metadata.name, namespace, uid)
    spec: WeightRefitSpec
    fleet: RolloutFleetSpec
    fleet_name: str
    base_checkpoint: str  # the committed version's checkpoint: the encoders' baseline
    settings: OperatorSettings
    profile: str | None = None  # ConfigMap holding the merged receiver profile
    forced_mode: Mode | None = None  # "overwrite" for modePolicy Overwrite
    on_created: Callable[[Attempt, str], None] | None = None
    on_finished: Callable[[Attempt, str, str | None], None] | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, int] = {}
        self.kube, self.namespace = self.site.kube, self.site.namespace

    def path(self, name: str = "") -> str:
        return api_path("batch", "v1", "jobs", self.namespace, name)

    def attempt_for(self, attempt: Attempt) -> Attempt:
        return replace(attempt, mode=self.forced_mode) if self.forced_mode else attempt

    def ensure(self, attempt: Attempt) -> str:
        """Create the attempt's Job unless it exists; its name."""
        attempt = self.attempt_for(attempt)
        name = job_name(self.refit["metadata"]["name"], attempt.id)
        with self._lock:
            body = job_manifest(refit=self.refit, spec=self.spec, fleet=self.fleet,
                                fleet_name=self.fleet_name,
                                base_checkpoint=self.base_checkpoint, attempt=attempt,
                                settings=self.settings, profile=self.profile,
                                site=self.site)
            try:
                self._create(body, attempt)
            except Conflict:
                existing = self.kube.get(self.path(name))
                found = existing["metadata"].get("annotations", {}).get(f"{GROUP}/attempt")
                if found != attempt.id:
                    raise EncoderJobFailed(f"Job {name} exists for attempt {found}, not "
                                           f"{attempt.id}.") from None
                return name
            log.info("created encoder Job %s/%s for attempt %s (%s, %d owners)",
                     self.namespace, name, attempt.id, attempt.mode, self.spec.encoder.owners)
            if self.on_created is not None:
                self.on_created(attempt, name)
            return name

    def _create(self, body: dict[str, Any], attempt: Attempt) -> None:
        """Create the Job; while the API server does not answer (a restart), try again until
        the attempt's deadline, as :meth:`wait` reads through it. A create that got no
        answer may have been made: the next one's Conflict finds it."""
        while True:
            try:
                self.kube.create(self.path(), body)
                return
            except ApiUnreachable as e:
                if attempt.expired:
                    raise
                log.warning("encoder Job of attempt %s not created yet: %s", attempt.id, e)
            time.sleep(self.settings.job_poll_seconds)

    def wait(self, attempt: Attempt, index: int) -> None:
        """Return once index ``index`` completed; raise if the Job fails or runs late."""
        name = job_name(self.refit["metadata"]["name"], attempt.id)
        while True:
            try:
                job = self.kube.get(self.path(name))
            except NotFound:
                raise EncoderJobFailed(f"Encoder Job {name} of attempt {attempt.id} was "
                                       "deleted.") from None
            except ApiUnreachable as e:
                log.warning("encoder Job %s: %s", name, e)
                job = None
            if job is not None:
                state = job_state(job, index)
                if state == "done":
                    self._finished(attempt, name, index, None)
                    return
                if state == "failed":
                    reason = self._failure(job, name)
                    self._finished(attempt, name, index, reason)
                    raise EncoderJobFailed(f"Encoder Job {name} (owner {index} of attempt "
                                           f"{attempt.id}) failed: {reason}.")
            if attempt.expired:
                self._finished(attempt, name, index, "deadline")
                raise EncoderJobFailed(f"Encoder Job {name} (owner {index}) did not finish "
                                       f"by attempt {attempt.id}'s deadline.")
            time.sleep(self.settings.job_poll_seconds)

    def _failure(self, job: Mapping[str, Any], name: str) -> str:
        """The Job's failure condition, and what its failed pods wrote as they ended."""
        reason = job_failure(job)
        try:
            pods = self.kube.get(api_path("", "v1", "pods", self.namespace),
                                 labelSelector=f"batch.kubernetes.io/job-name={name}")
        except ApiError as e:  # the condition alone still says that it failed
            log.warning("encoder Job %s: its pods are unreadable: %s", name, e)
            return reason
        said = pod_failures(pods)
        return f"{reason}; {said}" if said else reason

    def _finished(self, attempt: Attempt, name: str, index: int, failure: str | None) -> None:
        with self._lock:
            self._done[attempt.id] = self._done.get(attempt.id, 0) + 1
            last = self._done[attempt.id] == self.spec.encoder.owners or failure is not None
        if last and self.on_finished is not None:
            self.on_finished(attempt, name, failure)

    def delete(self, name: str) -> None:
        try:
            self.kube.delete(self.path(name))
            log.info("deleted encoder Job %s/%s", self.namespace, name)
        except NotFound:
            pass

    def delete_unfinished(self) -> list[str]:
        """Delete this refit's Jobs still running: their attempts are obsolete."""
        return delete_jobs(self.site, self.refit, running_only=True)


def delete_jobs(site: Site, refit: Mapping[str, Any], *, running_only: bool) -> list[str]:
    """Delete the refit's Jobs in ``site`` (only those still running, or all); their names."""
    path = api_path("batch", "v1", "jobs", site.namespace)
    gone = []
    for job in site.kube.get(path, labelSelector=refit_selector(refit)).get("items", []):
        if running_only and job_state(job, -1) != "running":
            continue
        with contextlib.suppress(NotFound):
            site.kube.delete(f"{path}/{job['metadata']['name']}")
            log.info("deleted Job %s in %s", job["metadata"]["name"], site)
        gone.append(job["metadata"]["name"])
    return gone


def copy_profile(site: Site, refit: Mapping[str, Any], data: str) -> None:
    """Put the refit's receiver profile (``data``) into ``site`` when that is another
    cluster, where the Jobs that mount it run; InvalidResource if a ConfigMap of that
    name there belongs to another refit."""
    if not site.remote:
        return
    name = profile_name(refit["metadata"]["name"])
    labels = {"app.kubernetes.io/managed-by": "dcr-operator", **site.labels(refit)}
    body = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": site.namespace, "labels": labels},
            "data": {PROFILE_KEY: data}}
    try:
        site.kube.create(api_path("", "v1", "configmaps", site.namespace), body)
    except Conflict:
        there = site.kube.get(api_path("", "v1", "configmaps", site.namespace, name))
        if (there["metadata"].get("labels") or {}) != labels:
            raise InvalidResource(f"ConfigMap {name} in {site} belongs to another refit "
                                  "(its labels differ); delete it.") from None


def delete_profile_copy(site: Site, refit: Mapping[str, Any]) -> None:
    """Delete the copy of the refit's receiver profile in another cluster (in the refit's
    own namespace, its ownerReference lets the garbage collector do it)."""
    if not site.remote:
        return
    name = profile_name(refit["metadata"]["name"])
    path = api_path("", "v1", "configmaps", site.namespace, name)
    with contextlib.suppress(NotFound):
        there = site.kube.get(path)
        if (there["metadata"].get("labels") or {}).get(UID_LABEL) == refit["metadata"]["uid"]:
            site.kube.delete(path)


@dataclass(kw_only=True)
class JobOwner:
    """``OwnerHandle`` for owner ``index``: publishes through the attempt's encoder Job."""

    jobs: EncoderJobs
    index: int

    def publish(self, attempt: Attempt) -> None:
        name = self.jobs.ensure(attempt)
        try:
            self.jobs.wait(self.jobs.attempt_for(attempt), self.index)
        except (EncoderJobFailed, ApiError):
            self.jobs.delete(name)  # its pods must not keep writing for an obsolete attempt
            raise

    def advance_baseline(self, record: CommitRecord) -> None:
        log.debug("owner %d: baseline is now %s (v%s)", self.index, record.baseline_id,
                  record.committed_version)
