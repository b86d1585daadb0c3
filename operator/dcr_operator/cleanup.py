"""What the WeightRefit finalizer removes from the object store.

The objects of every attempt the refit recorded, and the version manifest only if it names
one of them. Attempt ids come from status, which others may write: one that is not an
attempt id (:data:`dcr.format.names.ATTEMPT_RE`) is never made into a key or a path, only
reported (``Cleaned.rejected``), and a file store's directory is removed only under its root.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from dcr.errors import ManifestError
from dcr.format.layout import manifest_key, version_prefix
from dcr.format.manifest import Manifest
from dcr.format.names import ATTEMPT_RE
from dcr_operator.errors import InvalidResource

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


def _remove_under(root: Path, prefixes: Iterable[str]) -> list[str]:
    """Remove the directories ``prefixes`` name under a file store's ``root`` (never one
    that resolves outside it); those that existed."""
    removed = []
    inside = root.resolve()
    for prefix in prefixes:
        path = root / prefix
        if not path.resolve().is_relative_to(inside):  # a link out of the store
            log.warning("not removing %s: it resolves outside the store %s", path, root)
            continue
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(prefix)
    return removed


def clean_file_store(uri: str, version: int, attempts: Iterable[str]) -> Cleaned:
    root = Path(unquote(urlparse(uri).path))
    if not root.is_dir():
        return Cleaned(removed=(), skipped=f"{root} is not visible to the operator")
    ours = set(attempts)
    removed = _remove_under(root, attempt_prefixes(version, ours))
    manifest = root / manifest_key(version)
    if manifest.is_file() and _manifest_is_ours(manifest.read_bytes(), ours):
        manifest.unlink()
        removed.append(manifest_key(version))
    return Cleaned(removed=tuple(removed))


class _S3:
    """An S3 store's bucket and prefix, through a client with the fleet's credentials."""

    def __init__(self, uri: str, *, endpoint: str | None, region: str | None,
                 credentials: Mapping[str, str]) -> None:
        import boto3  # only when an S3 store is cleaned
        from botocore.config import Config

        parsed = urlparse(uri)
        self.bucket, self.base = parsed.netloc, parsed.path.strip("/")
        self.client: Any = boto3.client(
            "s3", endpoint_url=endpoint, region_name=region,
            aws_access_key_id=credentials.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=credentials.get("AWS_SECRET_ACCESS_KEY"),
            aws_session_token=credentials.get("AWS_SESSION_TOKEN"),
            config=Config(s3={"addressing_style": "path"}))

    def key(self, k: str) -> str:
        return f"{self.base}/{k}" if self.base else k

    def remove(self, prefixes: Iterable[str]) -> list[str]:
        removed = []
        for prefix in prefixes:
            keys = [o["Key"] for page in self.client.get_paginator("list_objects_v2")
                    .paginate(Bucket=self.bucket, Prefix=self.key(prefix))
                    for o in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            if keys:
                removed.append(prefix)
        return removed


def clean_s3_store(uri: str, version: int, attempts: Iterable[str], *,
                   endpoint: str | None, region: str | None,
                   credentials: Mapping[str, str]) -> Cleaned:
    s3 = _S3(uri, endpoint=endpoint, region=region, credentials=credentials)
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


def remove_prefixes(uri: str, prefixes: Iterable[str], *, endpoint: str | None = None,
                    region: str | None = None,
                    credentials: Mapping[str, str] | None = None) -> list[str]:
    """Remove every object under ``prefixes`` (keys below the store's root, as the
    history's pruning names them); the prefixes that held something."""
    if urlparse(uri).scheme == "file":
        return _remove_under(Path(unquote(urlparse(uri).path)), prefixes)
    return _S3(uri, endpoint=endpoint, region=region, credentials=credentials or {}
               ).remove(prefixes)


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
