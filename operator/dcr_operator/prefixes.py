"""Removing key prefixes from a fleet's store: directories of a file store, objects of an
S3 bucket.

Both the WeightRefit finalizer (:mod:`~dcr_operator.cleanup`) and retention after a commit
(:mod:`~dcr_operator.history`) remove through here, once the history has said what stays.
A file store's directory is removed only under its root.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

log = logging.getLogger(__name__)


def remove_under(root: Path, prefixes: Iterable[str]) -> list[str]:
    """Remove the directories ``prefixes`` name under a file store's ``root`` (never one
    that resolves outside it), or the one object a prefix names (a history's copy); those
    that existed."""
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
        elif path.is_file():
            path.unlink()
            removed.append(prefix)
    return removed

class S3Bucket:
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


def remove_prefixes(uri: str, prefixes: Iterable[str], *, endpoint: str | None = None,
                    region: str | None = None,
                    credentials: Mapping[str, str] | None = None) -> list[str]:
    """Remove every object under ``prefixes`` (keys below the store's root, as the
    history's pruning names them); the prefixes that held something."""
    if urlparse(uri).scheme == "file":
        return remove_under(Path(unquote(urlparse(uri).path)), prefixes)
    return S3Bucket(uri, endpoint=endpoint, region=region, credentials=credentials or {}
                       ).remove(prefixes)
