"""Bearer tokens: one strength check, one way to read them, one way to write a token file,
one way to compare an ``Authorization`` header.

The agent's control API and the relay's two credentials (read and publish) are bearer
tokens, read from files or the environment (never from the command line, where ``ps``
shows them). This module sits at the bottom layer and imports nothing heavy, so the
agent, the relay, the main job and the operator (torch-free) use the same rules.

Choices, and why:

* **Strength: at least 16 characters of printable ASCII, not a placeholder.** 16
  random hex characters are 64 bits; an HTTP header carries ASCII, so a token with a
  space, a control byte or a non-ASCII character could never be sent back as it was
  read. The examples in the chart and the docs spell tokens ``change-me-...``; such a
  token is long enough to pass a length check, so anything starting with
  :data:`PLACEHOLDER_PREFIX` is refused: a copied example never becomes a live secret.
* **Errors name the source, never the token.** "The relay read token from
  /etc/dcr/read-token is 9 characters; ..." says where to look without printing the
  secret into a log.
* **Token files are created 0600 and never written through a link.** A file written
  and then ``chmod``-ed is readable by others in between; :func:`write_token_file`
  creates a fresh file with ``mkstemp`` (``O_CREAT | O_EXCL``, mode 0600) beside the
  target and renames it over the target, so the token is never in a file with wider
  permissions and a symlink planted at the target is replaced, not followed.
* **Header comparison in constant time, and total.** :func:`bearer_matches` compares
  bytes with :func:`hmac.compare_digest`; a header that is not ASCII (aiohttp hands
  undecodable bytes over as surrogates) cannot match a checked token and answers
  ``False`` instead of raising, so a hostile header gets the usual 401, not a 500.
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
