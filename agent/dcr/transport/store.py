"""Object stores: where owners put payloads and manifests and receivers get them.

``Store`` is the seam. ``FileStore`` writes to a fsynced temporary file renamed over the key,
so a reader sees a whole object or none. Every store checks keys with
:func:`dcr.format.layout.check_key`.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from dcr.errors import ConfigError, ObjectNotFound, StoreError
from dcr.format.layout import check_key


class Store(Protocol):
    uri: str

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]: ...


@runtime_checkable
class Tagged(Protocol):
    """A store that tells, without a GET, whether an object changed: a reader re-fetches
    only when the tag differs from the one it read with."""

    def tag(self, key: str) -> str | None:
        """A value that changes whenever the object does (S3's ETag, a file's mtime and
        size); None when there is no such object."""
        ...


class FileStore:
    """A directory as an object store with atomic puts."""

    def __init__(self, root: Path) -> None:
        self.root = root.absolute()
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:
            raise StoreError(f"Cannot write {key!r} to {self.uri}: {e}.") from e

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"No object {key!r} in {self.uri}.") from None
        except OSError as e:
            raise StoreError(f"Cannot read {key!r} from {self.uri}: {e}.") from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def tag(self, key: str) -> str | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"Cannot stat {key!r} in {self.uri}: {e}.") from e
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"  # puts replace the file

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )


class MemoryStore:
    """Objects in a dict: for in-process senders and receivers, and tests.

    Owners put while receivers list from other threads: ``list`` copies the keys under
    a lock, so it never iterates a dict another thread is growing.
    """

    def __init__(self) -> None:
        self.uri = "memory://"
        self.objects: dict[str, bytes] = {}
        self._puts: dict[str, int] = {}  # key -> the put that wrote it (its tag)
        self._count = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        data = bytes(data)
        with self._lock:
            self.objects[check_key(key)] = data
            self._count += 1
            self._puts[key] = self._count

    def tag(self, key: str) -> str | None:
        with self._lock:
            return str(self._puts[key]) if key in self.objects else None

    def get(self, key: str) -> bytes:
        try:
            return self.objects[key]
        except KeyError:
            raise ObjectNotFound(f"No object {key!r} in {self.uri}.") from None

    def exists(self, key: str) -> bool:
        return key in self.objects

    def list(self, prefix: str) -> list[str]:
        with self._lock:
            keys = list(self.objects)
        return sorted(k for k in keys if k.startswith(prefix))


def open_store(uri: str) -> Store:
    """Open a store from a URI: ``file:///abs/path``, a plain path, ``s3://bucket/prefix``,
    or ``relay+http://host:port`` (publish only: the root of a relay tree)."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        from dcr.transport.s3 import S3Store  # here: boto3 loads only when S3 is used

        return S3Store(uri)
    if parsed.scheme in ("relay+http", "relay+https"):
        from dcr.transport.relay.publish import RelayPublisher  # aiohttp loads only here

        return RelayPublisher(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"Store URI {uri!r}: file URIs take no host.")
        return FileStore(Path(unquote(parsed.path)))
    if parsed.scheme == "":
        return FileStore(Path(uri).absolute())
    raise ConfigError(
        f"Store URI {uri!r}: scheme {parsed.scheme!r} is not supported (use file://, s3:// "
        "or relay+http://)."
    )
