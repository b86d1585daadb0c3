"""What the WeightRefit finalizer removes: its Jobs, and its attempts from the object store.

Jobs still running in the refit's namespace, and every Job of a training cluster
(:func:`delete_refit_jobs`); the objects of every attempt the refit recorded but the one the
store's history says committed, and the version manifest only if it names one of them
(:func:`clean_refit_store`). Attempt ids come from status, which others may write: one that
is not an attempt id (:data:`dcr.format.names.ATTEMPT_RE`) is never made into a key or a
path, only reported (``Cleaned.rejected``), and a file store's directory is removed only
under its root.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from dcr.errors import DcrError, ManifestError
from dcr.format.layout import manifest_key, version_prefix
from dcr.format.manifest import Manifest
from dcr.format.names import ATTEMPT_RE
from dcr_operator.api.rolloutfleet import RolloutFleetSpec
from dcr_operator.api.weightrefit import WeightRefitSpec
from dcr_operator.errors import InvalidResource, NotFound
from dcr_operator.fleet import fleet_path, store_credentials
from dcr_operator.history import committed_attempt
from dcr_operator.jobs import delete_jobs, delete_profile_copy
from dcr_operator.kube import KubeClient
from dcr_operator.prefixes import S3Bucket, remove_under
from dcr_operator.progress import Emit
from dcr_operator.sites import Site, encoder_site

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Cleaned:
    removed: tuple[str, ...]  # keys or key prefixes deleted
    skipped: str | None = None  # why nothing was done, if nothing could be
    rejected: tuple[str, ...] = ()  # "attempt ids" that are not: nothing done for them


def attempt_prefixes(version: int, attempts: Iterable[str]) -> list[str]:
    return [f"{version_prefix(version)}/{a}/" for a in sorted(set(attempts))
            if ATTEMPT_RE.fullmatch(a)]


def _manifest_is_ours(data: bytes, attempts: set[str]) -> bool:
    """Whether a version manifest names one of ``attempts``; one that cannot be read as a
    manifest is not ours, and stays."""
    try:
        return Manifest.parse(data, "at the version").attempt in attempts
    except ManifestError:
        return False


def clean_file_store(uri: str, version: int, attempts: Iterable[str]) -> Cleaned:
    root = Path(unquote(urlparse(uri).path))
    if not root.is_dir():
        return Cleaned(removed=(), skipped=f"{root} is not visible to the operator")
    ours = set(attempts)
    removed = remove_under(root, attempt_prefixes(version, ours))
    manifest = root / manifest_key(version)
    if manifest.is_file() and _manifest_is_ours(manifest.read_bytes(), ours):
        manifest.unlink()
        removed.append(manifest_key(version))
    return Cleaned(removed=tuple(removed))


def clean_s3_store(uri: str, version: int, attempts: Iterable[str], *,
                   endpoint: str | None, region: str | None,
                   credentials: Mapping[str, str]) -> Cleaned:
    s3 = S3Bucket(uri, endpoint=endpoint, region=region, credentials=credentials)
    ours = set(attempts)
    removed = s3.remove(attempt_prefixes(version, ours))
    client, bucket, key = s3.client, s3.bucket, s3.key(manifest_key(version))
    try:
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        data = None
    if data is not None and _manifest_is_ours(data, ours):
        client.delete_object(Bucket=bucket, Key=key)
        removed.append(manifest_key(version))
    return Cleaned(removed=tuple(removed))


def clean_store(uri: str, version: int, attempts: Iterable[str], *,
                endpoint: str | None = None, region: str | None = None,
                credentials: Mapping[str, str] | None = None) -> Cleaned:
    scheme = urlparse(uri).scheme
    given = list(attempts)
    attempts = [a for a in given if ATTEMPT_RE.fullmatch(a)]
    rejected = tuple(a for a in given if not ATTEMPT_RE.fullmatch(a))
    for a in rejected:
        log.warning("cleanup of %s v%s: %r is not an attempt id; skipped", uri, version, a)
    if not attempts:
        return Cleaned(removed=(), rejected=rejected)
    if scheme == "file":
        done = clean_file_store(uri, version, attempts)
    elif scheme == "s3":
        done = clean_s3_store(uri, version, attempts, endpoint=endpoint, region=region,
                              credentials=credentials or {})
    else:
        raise InvalidResource(f"Store URI {uri!r}: cannot clean scheme {scheme!r}.")
    return replace(done, rejected=rejected)


# --- a deleted WeightRefit ------------------------------------------------------------


def delete_refit_jobs(kube: KubeClient, refit: Mapping[str, Any], *, emit: Emit) -> None:
    """Stop the refit's Jobs: in its namespace those still running (the garbage collector
    takes the rest); in a training cluster all of them, and the profile copy, which no
    ownerReference collects there."""
    namespace = refit["metadata"]["namespace"]
    delete_jobs(Site(kube, namespace), refit, running_only=True)
    try:
        site = _encoder_site(kube, refit)
    except NotFound:
        return  # no fleet: no profile says the Jobs ran elsewhere
    except InvalidResource as e:  # its kubeconfig Secret is gone or changed
        emit(refit, "Warning", "CleanupSkipped", f"The refit's encoder cluster cannot be "
             f"reached ({e}); its Jobs there were not deleted (their TTL and deadline end "
             "them).")
        return
    if site.remote:
        delete_jobs(site, refit, running_only=False)
        delete_profile_copy(site, refit)


def _encoder_site(kube: KubeClient, refit: Mapping[str, Any]) -> Site:
    spec = WeightRefitSpec.model_validate(refit["spec"])
    namespace = refit["metadata"]["namespace"]
    fleet = RolloutFleetSpec.model_validate(kube.get(fleet_path(namespace, spec.fleet))["spec"])
    profile = fleet.encoder_profile(spec.encoder.profile)
    if profile is None or profile.cluster is None:
        return Site(kube, namespace)
    return encoder_site(kube, namespace, profile)


def clean_refit_store(kube: KubeClient, refit: Mapping[str, Any], *, emit: Emit) -> None:
    """Remove the refit's attempts from its fleet's store, but the one the history says
    committed its target (catch-up replays it) and the one its status names; each outcome
    is an Event on the refit."""
    meta, spec = refit["metadata"], refit["spec"]
    attempts = [a["id"] for a in (refit.get("status") or {}).get("attempts") or []]
    if not attempts:
        return
    try:
        fleet = kube.get(fleet_path(meta["namespace"], spec["fleet"]))
    except NotFound:
        emit(refit, "Warning", "CleanupSkipped", f"RolloutFleet {spec['fleet']} is gone: "
             f"the store of attempts {', '.join(attempts)} is unknown.")
        return
    fleet_spec = RolloutFleetSpec.model_validate(fleet["spec"])
    store = fleet_spec.store
    if store is None:  # a relay fleet: relays keep nothing past their memory budget
        return
    creds = store_credentials(kube, meta["namespace"], fleet_spec)
    version = int(spec["targetVersion"])
    try:  # catch-up replays the committed attempt: retention keeps it
        kept = {committed_attempt(kube, meta["namespace"], fleet_spec, version)}
    except DcrError as e:  # the detail goes to the log only: store bytes stay out of status
        log.warning("cleanup of %s: the history of %s cannot be read: %s",
                    meta["name"], store.uri, e)
        emit(refit, "Warning", "CleanupSkipped", f"Store {store.uri}: its history cannot be "
             "read, so what catch-up needs is unknown; nothing was removed (the operator's "
             "log says why).")
        return
    # Status may be written by others: it can only keep more, never remove more.
    kept.add(((refit.get("status") or {}).get("committed") or {}).get("attempt"))
    attempts = [a for a in attempts if a not in kept]
    t0 = time.monotonic()
    done = clean_store(store.uri, version, attempts,
                       endpoint=store.endpoint, region=store.region, credentials=creds)
    if done.rejected:  # status is writable by more than the operator: never a path
        emit(refit, "Warning", "CleanupRefused", f"Skipped {len(done.rejected)} attempt "
             f"ids that are not attempt ids (nothing deleted for them): "
             f"{', '.join(repr(a)[:80] for a in done.rejected[:5])}.")
    if done.skipped:
        emit(refit, "Warning", "CleanupSkipped", f"Store {store.uri}: {done.skipped}.")
    else:
        emit(refit, "Normal", "StoreCleaned", f"Removed {len(done.removed)} prefixes of "
             f"{len(attempts)} attempts from {store.uri} in {time.monotonic() - t0:.2f} s.")
