"""Bearer tokens: one strength check, one way to read them, one way to write a token file,
one way to compare an ``Authorization`` header.

Bottom layer, so the agent, the relay, the main job and the operator share the rules
(docs/security.md, "Parties and credentials"). Errors name a token's source, never the
token; :func:`bearer_matches` never raises, so a hostile header is a 401, not a 500.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import tempfile
from pathlib import Path

from dcr.errors import ConfigError

MIN_TOKEN_CHARS = 16  # 64 bits as hex; the agent has asked for this much since v0.1
PLACEHOLDER_PREFIX = "change-me"  # what the chart's and the docs' example tokens start with


def check_token(token: str, source: str) -> str:
    """``token`` if it is strong enough, else :class:`ConfigError` naming ``source``.

    ``source`` says where the token came from ("the agent token from $DCR_AGENT_TOKEN");
    the message never contains the token itself.
    """
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"The {source} is {len(token)} characters; a bearer token must be "
                          f"at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`).")
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"The {source} has whitespace, control or non-ASCII characters; a "
                          "bearer token must be printable ASCII without spaces.")
    if token.lower().startswith(PLACEHOLDER_PREFIX):
        raise ConfigError(f"The {source} is the documented placeholder "
                          f"({PLACEHOLDER_PREFIX}-...); replace it with a random secret.")
    return token


def read_token(what: str, path: Path | None, env: str | None = None) -> str:
    """A checked token from ``path`` or, without one, from environment variable ``env``.

    ``what`` names the credential in errors ("agent token", "relay read token").
    """
    if path is None:
        if env is None:
            raise ConfigError(f"No file was given for the {what}.")
        return check_token(os.environ.get(env, "").strip(), f"{what} from ${env}")
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"Cannot read the {what} file {str(path)!r}: "
                          f"{type(e).__name__}.") from e
    return check_token(token, f"{what} from {str(path)!r}")


def write_token_file(path: Path, token: str) -> Path:
    """Write ``token`` to ``path``, created with mode 0600, replacing (never following)
    whatever is there. Returns ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>``, in constant time.

    Any header that is not ASCII is simply not a match.
    """
    try:
        given = (header or "").encode("ascii")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(given, f"Bearer {token}".encode())


__all__ = ["MIN_TOKEN_CHARS", "PLACEHOLDER_PREFIX", "bearer_matches", "check_token",
           "read_token", "write_token_file"]
