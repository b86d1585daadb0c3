"""The wire vocabulary every reader and writer shares: ids, modes, entry kinds, digests.

``FORMAT.md`` defines these once; this module is their one spelling in code, so a change
to the format is a change here. Keys (where objects live in a store) are in
:mod:`dcr.format.layout`.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Literal

Mode = Literal["mixed", "overwrite"]  # an attempt's mode: XOR where allowed, or absolute
EntryKind = Literal["xor", "overwrite"]  # how one item's records travel

# An attempt id: in payload headers, manifests, store keys, relay ids and URLs.
ATTEMPT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DIGEST_PATTERN = r"^[0-9a-f]{32}$"  # an object_digest
ATTEMPT_RE = re.compile(ATTEMPT_PATTERN)  # anchored: use fullmatch (``$`` allows a final newline)
ATTEMPT_BODY = ATTEMPT_PATTERN[1:-1]  # unanchored, for embedding in larger patterns (keys)

OBJECT_DIGEST_BYTES = 16  # BLAKE2b-128 of a stored object's bytes, as in manifests


def new_attempt_id() -> str:
    """A fresh attempt id (``a-`` and 12 hex digits), valid wherever :data:`ATTEMPT_RE` is."""
    return f"a-{secrets.token_hex(6)}"


def object_digest(data: bytes | bytearray | memoryview) -> str:
    """The hex BLAKE2b-128 of an object's bytes: what manifests list and stores check."""
    return hashlib.blake2b(data, digest_size=OBJECT_DIGEST_BYTES).hexdigest()


def object_hasher() -> hashlib.blake2b:
    """An incremental :func:`object_digest`, for objects that arrive in pieces."""
    return hashlib.blake2b(digest_size=OBJECT_DIGEST_BYTES)
