"""S3 and S3-compatible object storage behind the ``Store`` seam.

Multipart uploads with Content-MD5, a BLAKE2b-128 digest in ``dcr-blake2b`` metadata checked
on every ``get``, retries of its own, ``put_if_absent`` as a conditional PUT; credentials
from the AWS chain, redacted from botocore's logs. docs/architecture.md, "The S3 store".
"""

from __future__ import annotations

import base64
import hashlib
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlparse

import botocore.loaders
import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

from dcr.errors import ConfigError, ObjectNotFound, StoreError
from dcr.format.layout import check_key
from dcr.format.names import object_digest
from dcr.settings import MiB, option

log = logging.getLogger(__name__)

DIGEST_META = "dcr-blake2b"  # user-metadata key holding the BLAKE2b-128 hex digest
MIN_PART = 5 * MiB  # S3's smallest part, except the last
MAX_PART = 5 * 1024 * MiB  # S3's largest part
MAX_PARTS = 10_000  # S3's most parts per upload

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class S3Settings:
    """How ``S3Store`` splits, parallelises, retries and times out requests.

    Units are in the docs: sizes in bytes, waits in seconds.
    """

    multipart_threshold: int = option(64 * MiB, doc="bytes; objects at least this large go "
                                      "multipart (one PUT runs at one connection's speed)")
    part_size: int = option(16 * MiB, doc="bytes per uploaded part; S3 requires 5 MiB..5 GiB "
                            "(last part smaller); grown automatically when an object would "
                            "need more than 10,000 parts")
    upload_concurrency: int = option(8, doc="parts in flight per object")
    range_size: int = option(16 * MiB, doc="bytes per ranged GET; objects up to this size are "
                             "fetched with one GET")
    download_concurrency: int = option(8, doc="ranged GETs in flight per object")
    max_attempts: int = option(5, doc="tries per request, the first included; 1 disables "
                               "retries")
    base_backoff: float = option(0.1, doc="seconds; try n waits uniform(0, min(max_backoff, "
                                 "base_backoff * 2**(n-1))) after failing (full jitter, so "
                                 "many receivers do not retry in lockstep)")
    max_backoff: float = option(10.0, doc="seconds; ceiling of one wait")
    connect_timeout: float = option(10.0, doc="seconds to open a connection")
    read_timeout: float = option(60.0, doc="seconds a socket read may wait for data (not the "
                                 "whole transfer)")
    require_digest: bool = option(True, doc="refuse objects without dcr-blake2b metadata, "
                                  "whose bytes cannot be checked")

    def __post_init__(self) -> None:
        rules: list[tuple[str, bool, str]] = [
            ("part_size", MIN_PART <= self.part_size <= MAX_PART, "must be 5 MiB..5 GiB"),
            ("multipart_threshold", self.multipart_threshold >= 1, "must be positive"),
            ("upload_concurrency", self.upload_concurrency >= 1, "must be at least 1"),
            ("range_size", self.range_size >= 1, "must be positive"),
            ("download_concurrency", self.download_concurrency >= 1, "must be at least 1"),
            ("max_attempts", self.max_attempts >= 1, "must be at least 1"),
            ("base_backoff", self.base_backoff >= 0, "must not be negative"),
            ("max_backoff", self.max_backoff >= self.base_backoff, "must be >= base_backoff"),
            ("connect_timeout", self.connect_timeout > 0, "must be positive"),
            ("read_timeout", self.read_timeout > 0, "must be positive"),
        ]
        for name, ok, why in rules:
            if not ok:
                raise ConfigError(f"S3Settings.{name} = {getattr(self, name)!r} {why}.")


# S3 error codes worth another try whatever their status (AWS's retry tables).
_RETRY_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
    "TooManyRequestsException", "RequestTimeout", "InternalError", "ServiceUnavailable",
    "ConditionalRequestConflict",
})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})


class _BadBody(StoreError):
    """A response body of the wrong length or range: the transfer broke, try again."""


# Transport failures: refused or reset connections, timeouts, bodies cut short.
_TRANSIENT = (BotoConnectionError, HTTPClientError, IncompleteReadError, _BadBody)

# Credential scopes, signatures and session tokens as botocore and urllib3 log them
# (Authorization header, presigned query strings, "Signature:\n<hex>").
_SECRETS = re.compile(
    r"(?i)((?:x-amz-)?credential=|(?:x-amz-)?signature=|x-amz-security-token=|signature:\n"
    r"|'x-amz-security-token': b?')([^\s,'\"&]+)"
)


def _redact(text: str) -> str:
    return _SECRETS.sub(r"\1<redacted>", text)


class _RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = _redact(msg)
        if clean != msg:
            record.msg, record.args = clean, ()
        return True


_REDACT = _RedactSecrets()
# Records are created only when DEBUG is on for these loggers, so this costs nothing
# otherwise. A logger's filters see only its own records, hence the list.
for _name in ("botocore.endpoint", "botocore.auth", "botocore.httpsession",
              "urllib3.connectionpool"):
    logging.getLogger(_name).addFilter(_REDACT)


# Building a client parses botocore's S3 model and endpoint rules (over 0.1 s of CPU);
# stores share one loader, which caches them, so a store opened per refit costs ~20 ms.
_LOADER = botocore.loaders.create_loader()
_LOADER_LOCK = threading.Lock()


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


def _status(e: ClientError) -> int | None:
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _retryable(e: Exception) -> bool:
    if isinstance(e, ClientError):
        status = _status(e) or 0
        return _code(e) in _RETRY_CODES or status == 429 or (status >= 500 and status != 501)
    return isinstance(e, _TRANSIENT)


def _what(e: Exception) -> str:
    """The failure in words: status, code and server message, or the exception."""
    if isinstance(e, ClientError):
        status, code = _status(e), _code(e)
        msg = str(e.response.get("Error", {}).get("Message", ""))
        head = f"HTTP {status}" if code in ("", str(status)) else f"HTTP {status} {code}"
        return head + (f" ({msg})" if msg and msg != code else "")
    if isinstance(e, _BadBody):
        return f"response body: {e}"
    return f"{type(e).__name__}: {e}"


def _fill(body: Any, out: memoryview) -> None:
    """Read exactly ``len(out)`` bytes of ``body`` into ``out``; a body that ends early or
    runs on is a broken transfer."""
    n, got = len(out), 0
    while got < n:
        k = body.readinto(out[got:])
        if not k:
            break
        got += k
    extra = len(body.read(1))
    if got != n or extra:
        more = " or more" if extra else ""
        raise _BadBody(f"{got + extra}{more} bytes where {n} were expected")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at either end)."""
    p = urlparse(uri)
    if p.scheme != "s3" or p.query or p.params or p.fragment:
        raise ConfigError(f"Store URI {uri!r}: expected s3://bucket/prefix.")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", p.netloc):
        raise ConfigError(f"Store URI {uri!r}: {p.netloc!r} is not an S3 bucket name.")
    prefix = p.path.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ConfigError(f"Store URI {uri!r}: prefix {prefix!r} has an empty, '.' or '..' part.")
    return p.netloc, prefix


class S3Store:
    """Objects under ``s3://bucket/prefix``, digest-checked, with parallel transfers."""

    def __init__(
        self,
        uri: str,
        settings: S3Settings | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        endpoint: str | None = None,
        region: str | None = None,
        credentials: Mapping[str, str] | None = None,
    ) -> None:
        """``endpoint``, ``region``, ``credentials`` (``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``): what botocore would otherwise
        take from the environment, for a process that holds several stores' (the
        operator)."""
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.settings = s = settings or S3Settings()
        self._sleep = sleep
        self._rng = random.Random()
        self._root = f"{self.prefix}/" if self.prefix else ""
        config = Config(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1, "mode": "standard"},  # retries are ours
            connect_timeout=s.connect_timeout,
            read_timeout=s.read_timeout,
            max_pool_connections=max(s.upload_concurrency, s.download_concurrency) + 2,
            # Our digest covers integrity; flexible checksums break older S3 clones.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        with _LOADER_LOCK:  # one session per store (credentials), one parsed S3 model
            session = botocore.session.get_session()
            session.register_component("data_loader", _LOADER)
            creds = credentials or {}
            self._client = session.create_client(
                "s3", config=config, endpoint_url=endpoint, region_name=region,
                aws_access_key_id=creds.get("AWS_ACCESS_KEY_ID"),
                aws_secret_access_key=creds.get("AWS_SECRET_ACCESS_KEY"),
                aws_session_token=creds.get("AWS_SESSION_TOKEN"))

    def close(self) -> None:
        """Close the pooled connections."""
        self._client.close()

    # --- the retry loop ------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        s = self.settings
        return self._rng.uniform(0.0, min(s.max_backoff, s.base_backoff * 2 ** (attempt - 1)))

    def _attempt(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """``fn()``, tried up to ``max_attempts`` times while it fails transiently."""
        tries = self.settings.max_attempts
        for attempt in range(1, tries + 1):
            try:
                return fn()
            except (ClientError, BotoCoreError, _BadBody) as e:
                if attempt == tries or not _retryable(e):
                    raise self._error(op, key, e, attempt) from e
                delay = self._backoff(attempt)
                log.info("S3 %s of %r in %s: try %d of %d failed (%s); retrying in %.3f s",
                         op, key, self.uri, attempt, tries, _redact(_what(e)), delay)
                self._sleep(delay)
        raise AssertionError("unreachable: the last try returns or raises")

    def _error(self, op: str, key: str, e: Exception, tries: int) -> StoreError:
        if isinstance(e, ClientError) and _status(e) == 404 and _code(e) in _NOT_FOUND_CODES:
            return ObjectNotFound(f"No object {key!r} in {self.uri} (S3 {op}: {_what(e)}).")
        hint = ""
        if isinstance(e, ClientError) and _status(e) == 412 and op.startswith("GET"):
            hint = "; the object changed while it was being read"
        n = f"{tries} {'try' if tries == 1 else 'tries'}"
        return StoreError(_redact(f"S3 {op} of {key!r} in {self.uri} failed after {n}: "
                                  f"{_what(e)}{hint}."))

    # --- Store ---------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._root + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key``, replacing any object there."""
        self._put(key, data, if_absent=False)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Store ``data`` at ``key`` unless an object is there; False if one was.

        Relies on the server enforcing ``If-None-Match: *`` (AWS S3 does; rclone serve
        s3 does not and overwrites). A 412 after a retried try may mean that our own
        earlier try landed; callers needing certainty compare the stored object.
        """
        return self._put(key, data, if_absent=True)

    def _put(self, key: str, data: bytes, *, if_absent: bool) -> bool:
        okey = self._key(key)
        meta = {DIGEST_META: object_digest(data)}
        if len(data) < self.settings.multipart_threshold:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Key": okey, "Body": data,
                                  "Metadata": meta, "ContentMD5": _md5(data)}
            if if_absent:
                kw["IfNoneMatch"] = "*"
            stored = self._attempt("PUT", key, partial(self._conditional,
                                                       self._client.put_object, kw))
            log.debug("S3 PUT %s/%s: %d bytes, stored=%s", self.uri, key, len(data), stored)
            return stored
        return self._put_multipart(key, okey, data, meta, if_absent)

    @staticmethod
    def _conditional(call: Callable[..., Any], kw: Mapping[str, Any]) -> bool:
        """``call(**kw)``; False when a conditional write finds the key taken (412)."""
        try:
            call(**kw)
        except ClientError as e:
            if "IfNoneMatch" in kw and _status(e) == 412:
                return False
            raise
        return True

    def _put_multipart(
        self, key: str, okey: str, data: bytes, meta: dict[str, str], if_absent: bool
    ) -> bool:
        s, n = self.settings, len(data)
        size = max(s.part_size, -(-n // MAX_PARTS))
        spans = [(i + 1, lo, min(lo + size, n)) for i, lo in enumerate(range(0, n, size))]
        upload_id: str = self._attempt("CreateMultipartUpload", key, partial(
            self._client.create_multipart_upload, Bucket=self.bucket, Key=okey, Metadata=meta,
        ))["UploadId"]

        def send(span: tuple[int, int, int]) -> dict[str, Any]:
            number, lo, hi = span
            body = data[lo:hi]
            resp = self._attempt(f"UploadPart {number}/{len(spans)}", key, partial(
                self._client.upload_part, Bucket=self.bucket, Key=okey, UploadId=upload_id,
                PartNumber=number, Body=body, ContentMD5=_md5(body),
            ))
            return {"PartNumber": number, "ETag": resp["ETag"]}

        try:
            pool = ThreadPoolExecutor(min(s.upload_concurrency, len(spans)), "dcr-s3-put")
            try:
                parts = list(pool.map(send, spans))
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
            kw: dict[str, Any] = {"Bucket": self.bucket, "Key": okey, "UploadId": upload_id,
                                  "MultipartUpload": {"Parts": parts}}
            if if_absent:
                kw["IfNoneMatch"] = "*"
            stored = self._attempt("CompleteMultipartUpload", key, partial(
                self._conditional, self._client.complete_multipart_upload, kw))
        except BaseException:
            self._abort(key, okey, upload_id)
            raise
        if not stored:
            self._abort(key, okey, upload_id)
        log.debug("S3 PUT %s/%s: %d bytes in %d parts, stored=%s",
                  self.uri, key, n, len(spans), stored)
        return stored

    def _abort(self, key: str, okey: str, upload_id: str) -> None:
        try:
            self._attempt("AbortMultipartUpload", key, partial(
                self._client.abort_multipart_upload, Bucket=self.bucket, Key=okey,
                UploadId=upload_id))
        except StoreError as e:  # the original failure matters more; parts expire
            log.warning("Multipart upload of %r in %s not aborted: %s", key, self.uri, e)

    def get(self, key: str) -> bytes:
        """The object's bytes, after checking their length and BLAKE2b digest.

        The first GET asks for the first ``range_size`` bytes: its answer carries the
        size, ETag and digest a HEAD would (one round trip, not two, for an object that
        fits); the rest, if any, comes in parallel ranged GETs pinned to that ETag.
        """
        okey, s = self._key(key), self.settings
        first = self._attempt("GET", key, partial(self._first, key, okey))
        if first is None:  # 416: no byte 0 to range over, so the object is empty
            first = self._attempt("GET", key, partial(self._first, key, okey, ranged=False))
            assert first is not None  # an unranged GET is never answered 416
        buf, got, etag, expected = first
        size = len(buf)
        view = memoryview(buf)
        spans = [(lo, min(lo + s.range_size, size)) for lo in range(got, size, s.range_size)]
        if len(spans) == 1:
            self._read(key, okey, etag, view[spans[0][0]:], spans[0][0], size)
        elif spans:
            pool = ThreadPoolExecutor(min(s.download_concurrency, len(spans)), "dcr-s3-get")
            try:
                futures: list[Future[None]] = [
                    pool.submit(self._read, key, okey, etag, view[lo:hi], lo, size)
                    for lo, hi in spans
                ]
                for f in futures:
                    f.result()
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        digest = object_digest(buf)
        if expected is not None and digest != expected.lower():
            raise StoreError(f"Object {key!r} in {self.uri}: digest mismatch (expected "
                             f"{expected}, got {digest}); the stored bytes are corrupt.")
        log.debug("S3 GET %s/%s: %d bytes in %d requests", self.uri, key, size, 1 + len(spans))
        return bytes(buf)

    def _first(self, key: str, okey: str, *, ranged: bool = True
               ) -> tuple[bytearray, int, str | None, str | None] | None:
        """One GET of the object's first ``range_size`` bytes (all of it if not
        ``ranged``): a buffer of the object's size holding them, how many, the ETag and
        the digest metadata. None if the server answers 416 (an empty object)."""
        s = self.settings
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": okey}
        if ranged:
            kw["Range"] = f"bytes=0-{s.range_size - 1}"
        try:
            resp = self._client.get_object(**kw)
        except ClientError as e:
            if ranged and _status(e) == 416:
                return None
            raise
        body = resp["Body"]
        try:
            meta = {k.lower(): v for k, v in resp.get("Metadata", {}).items()}
            expected = meta.get(DIGEST_META)
            if expected is None and s.require_digest:
                raise StoreError(f"Object {key!r} in {self.uri} has no {DIGEST_META} metadata, "
                                 "so its bytes cannot be checked; refusing it.")
            content_range = resp.get("ContentRange")
            if content_range is None:  # the whole object (unranged, or Range ignored)
                size = length = int(resp["ContentLength"])
            else:
                m = re.fullmatch(r"bytes 0-(\d+)/(\d+)", content_range)
                length, size = (int(m[1]) + 1, int(m[2])) if m else (-1, -1)
                if length != min(s.range_size, size) or length < 1:
                    raise _BadBody(f"asked for the first {s.range_size} bytes, got "
                                   f"{content_range}")
            buf = bytearray(size)
            _fill(body, memoryview(buf)[:length])
            return buf, length, resp.get("ETag"), expected
        finally:
            body.close()

    def _read(self, key: str, okey: str, etag: str | None, out: memoryview, start: int,
              size: int) -> None:
        """Fill ``out`` with the object's bytes from ``start``, with one ranged GET of the
        version ``etag`` names (a replaced object fails instead of being mixed)."""
        n = len(out)
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": okey,
                              "Range": f"bytes={start}-{start + n - 1}"}
        if etag:
            kw["IfMatch"] = etag
        want_range = f"bytes {start}-{start + n - 1}/{size}"

        def once() -> None:
            resp = self._client.get_object(**kw)
            body = resp["Body"]
            try:
                if resp.get("ContentRange") != want_range:
                    raise _BadBody(f"asked for {want_range}, got {resp.get('ContentRange')}")
                _fill(body, out)
            finally:
                body.close()

        self._attempt(f"GET {want_range}", key, once)

    def exists(self, key: str) -> bool:
        okey = self._key(key)

        def once() -> bool:
            try:
                self._client.head_object(Bucket=self.bucket, Key=okey)
            except ClientError as e:
                if _status(e) == 404:
                    return False
                raise
            return True

        return self._attempt("HEAD", key, once)

    def tag(self, key: str) -> str | None:
        """The object's ETag (a HEAD), or None when there is none."""
        okey = self._key(key)

        def once() -> str | None:
            try:
                answer = self._client.head_object(Bucket=self.bucket, Key=okey)
            except ClientError as e:
                if _status(e) == 404:
                    return None
                raise
            return str(answer["ETag"])

        return self._attempt("HEAD", key, once)

    def list(self, prefix: str) -> list[str]:
        """Keys under the store that start with ``prefix``, sorted."""
        keys: list[str] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._root + prefix}
        while True:
            page = self._attempt("LIST", prefix, partial(self._client.list_objects_v2, **kw))
            keys += [o["Key"][len(self._root):] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(keys)
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key succeeds, as on S3."""
        self._attempt("DELETE", key, partial(
            self._client.delete_object, Bucket=self.bucket, Key=self._key(key)))
