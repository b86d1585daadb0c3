"""TLS for every DCR server and client: the one module that builds their ssl contexts.

A process reads four variables (the chart and the examples set them from a Secret mounted
as files, cert-manager's ``tls.crt``, ``tls.key`` and ``ca.crt``):

==========================  ===============================================================
``DCR_TLS_CERT``            PEM certificate chain every server of this process presents
``DCR_TLS_KEY``             its private key (PEM); set both or neither
``DCR_TLS_CA``              PEM bundle this process's clients verify DCR peers against
``DCR_TLS_CA_DATA``         the bundle itself, instead of a file (what an encoder Job gets
                            from the Secret a relay fleet names: ``spec.relay.caSecretRef``)
``DCR_TLS_SERVER_NAME``     the name a peer's certificate must carry, instead of the URL's
                            host (peers reached by pod IP: the kubeconfig's tls-server-name)
==========================  ===============================================================

Choices, and why:

- A process given a certificate serves HTTPS only, on every server it starts
  (:func:`dcr.http.edge.start`): no plain listener is left for a token to cross in clear.
- Clients always verify (hostname included) and never retry in plain: an unverifiable peer
  is an error naming its address (:func:`refusal`). With ``DCR_TLS_CA`` set, an
  ``http://`` URL to a DCR peer is refused (:func:`check_peer_url`) rather than sent a
  token in clear; engines on the pod's loopback keep their own scheme.
- Files are re-read when they change (kubelet swaps a Secret volume's files when
  cert-manager renews): a server picks the new pair at the next handshake, a client the
  new bundle at its next connection; a pair that does not load keeps the old one, logged.
- Stdlib ``ssl``, TLS 1.2 or later (``ssl.create_default_context``'s floor); the same
  context handed to urllib3's pools (:func:`pooled_request`) and aiohttp's requests.

docs/security-wire.md, "TLS".
"""

from __future__ import annotations

import http.client
import logging
import os
import ssl
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3

from dcr.errors import ConfigError

log = logging.getLogger(__name__)

ENV_CERT, ENV_KEY = "DCR_TLS_CERT", "DCR_TLS_KEY"
ENV_CA, ENV_CA_DATA, ENV_SERVER_NAME = "DCR_TLS_CA", "DCR_TLS_CA_DATA", "DCR_TLS_SERVER_NAME"


@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """What a process serves and trusts; every field None: plain HTTP, the system's CAs."""

    cert: Path | None = None  # certificate chain its servers present (PEM); with key
    key: Path | None = None  # the chain's private key (PEM)
    ca: Path | None = None  # CA bundle its clients verify DCR peers against (PEM)
    ca_data: str | None = None  # the bundle inline, instead of ``ca`` (PEM)
    server_name: str | None = None  # the name peers' certificates carry (None: URL's host)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError(f"TLS needs both {ENV_CERT} and {ENV_KEY} (a certificate and "
                              f"its key); got {ENV_CERT}={_shown(self.cert)} and "
                              f"{ENV_KEY}={_shown(self.key)}.")
        if self.ca is not None and self.ca_data is not None:
            raise ConfigError(f"Set one of {ENV_CA} and {ENV_CA_DATA}, not both; got "
                              f"{ENV_CA}={_shown(self.ca)} and a bundle in {ENV_CA_DATA}.")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsSettings:
        e = os.environ if env is None else env

        def path(name: str) -> Path | None:
            return Path(e[name]) if e.get(name, "").strip() else None

        return cls(cert=path(ENV_CERT), key=path(ENV_KEY), ca=path(ENV_CA),
                   ca_data=e.get(ENV_CA_DATA, "").strip() or None,
                   server_name=e.get(ENV_SERVER_NAME, "").strip() or None)

    @property
    def verifies(self) -> bool:
        """Does this process trust a CA of its own (and speak only TLS to DCR peers)?"""
        return self.ca is not None or self.ca_data is not None

    @property
    def scheme(self) -> str:
        """What this process's servers speak: ``https`` when it has a certificate."""
        return "https" if self.cert is not None else "http"


def _shown(p: Path | None) -> str:
    return "(unset)" if p is None else repr(str(p))


def _stamp(*paths: Path) -> tuple[tuple[int, int, int], ...]:
    """What changes when a file is replaced (kubelet swaps a symlink; an editor rewrites)."""
    out = []
    for p in paths:
        st = p.stat()
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _load_server(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


class _Reloading:
    """A server's pair, re-read at a handshake once its files changed."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        try:
            self.stamp = _stamp(cert, key)
            self.current = _load_server(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"The TLS certificate {ENV_CERT}={str(cert)!r} and key "
                              f"{ENV_KEY}={str(key)!r} do not load: {e}.") from e
        self._lock = threading.Lock()

    def fresh(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = _stamp(self.cert, self.key)
                if stamp != self.stamp:
                    self.current, self.stamp = _load_server(self.cert, self.key), stamp
                    log.info("TLS certificate %s reloaded", self.cert)
            except (OSError, ssl.SSLError) as e:  # mid-rotation: keep serving the old pair
                log.warning("TLS certificate %s did not reload (%s); serving the previous "
                            "one", self.cert, e)
            return self.current


def server_context(settings: TlsSettings) -> ssl.SSLContext | None:
    """The context a server listens with (None: plain HTTP); ConfigError names the file
    that does not load. Each handshake swaps in the pair's current context."""
    if settings.cert is None or settings.key is None:
        return None
    pair = _Reloading(settings.cert, settings.key)
    front = _load_server(settings.cert, settings.key)

    def swap(conn: Any, _name: str | None, _ctx: ssl.SSLContext) -> None:
        conn.context = pair.fresh()  # OpenSSL calls this for every hello, with SNI or not

    front.sni_callback = swap
    return front


_clients: dict[tuple[str | None, Any, str | None], ssl.SSLContext] = {}
_clients_lock = threading.Lock()


def client_context(settings: TlsSettings | None = None) -> ssl.SSLContext:
    """The context clients verify peers with: ``DCR_TLS_CA``'s bundle (rebuilt when the
    file changes) or ``DCR_TLS_CA_DATA``'s, else the system's; hostname checked.
    ConfigError names a bundle that does not load."""
    s = settings or TlsSettings.from_env()
    try:
        key = (None if s.ca is None else str(s.ca), None if s.ca is None else _stamp(s.ca),
               s.ca_data)
        with _clients_lock:
            if key not in _clients:
                _clients.clear()  # one bundle per process: drop the replaced one
                _clients[key] = ssl.create_default_context(
                    cafile=None if s.ca is None else str(s.ca), cadata=s.ca_data)
            return _clients[key]
    except (OSError, ssl.SSLError) as e:
        shown = f"{ENV_CA}={str(s.ca)!r}" if s.ca is not None else ENV_CA_DATA
        raise ConfigError(f"The TLS CA bundle {shown} does not load: {e}.") from e


def check_peer_url(url: str, what: str, settings: TlsSettings | None = None) -> str:
    """``url``, unless TLS is configured (``DCR_TLS_CA`` or ``DCR_TLS_CA_DATA``) and it is
    plain ``http://``: a token for a DCR peer is then never sent in clear (ConfigError
    naming ``what``)."""
    s = settings or TlsSettings.from_env()
    if s.verifies and urllib.parse.urlsplit(url).scheme in ("http", "relay+http"):
        which = ENV_CA if s.ca is not None else ENV_CA_DATA
        raise ConfigError(f"{what}: {url!r} is plain HTTP, but {which} is set: this "
                          "process sends its tokens to DCR peers over TLS only; give an "
                          "https:// URL.")
    return url


def server_hostname(host: str, settings: TlsSettings | None = None) -> str:
    """The name a peer at ``host`` must prove: ``DCR_TLS_SERVER_NAME`` or ``host``."""
    return (settings or TlsSettings.from_env()).server_name or host


def aiohttp_options(url: str) -> dict[str, Any]:
    """``ssl`` and ``server_hostname`` for an aiohttp request to ``url`` ({} for http)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https":
        return {}
    s = TlsSettings.from_env()
    return {"ssl": client_context(s), "server_hostname": server_hostname(parts.hostname or "",
                                                                          s)}


def urllib3_options() -> dict[str, Any]:
    """A urllib3 pool's ``ssl_context`` and, when set, ``server_hostname``."""
    s = TlsSettings.from_env()
    return {"ssl_context": client_context(s), "server_hostname": s.server_name}


def pooled_request(manager: urllib3.PoolManager, method: str, url: str, **kw: Any
                   ) -> urllib3.BaseHTTPResponse:
    """``manager.request(method, url, **kw)`` through a pool that verifies HTTPS peers as
    this module says (a pool per address and context, kept alive between calls)."""
    pool = manager.connection_from_url(url, pool_kwargs=urllib3_options())
    return pool.urlopen(method, urllib3.util.parse_url(url).request_uri,
                        assert_same_host=False, **kw)


class VerifiedHTTPSConnection(http.client.HTTPSConnection):
    """http.client's HTTPS with this module's context, checking ``DCR_TLS_SERVER_NAME``
    when set (http.client would check the URL's host)."""

    def __init__(self, host: str, port: int | None = None, **kw: Any) -> None:
        kw["context"] = client_context()
        super().__init__(host, port, **kw)

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        name = server_hostname(self.host)
        self.sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            self.sock, server_hostname=name)


def refusal(e: BaseException) -> str | None:
    """A TLS failure's sentence (None: not one): what a client says for the address."""
    if type(e).__module__ != "ssl":  # a library's subclass wraps the ssl error it carries
        return None
    if isinstance(e, ssl.SSLCertVerificationError):
        return (f"its TLS certificate did not verify ({e.verify_message}); {ENV_CA} names "
                "the CA bundle peers are checked against")
    if isinstance(e, ssl.SSLError):
        return f"the TLS handshake failed ({e.reason or type(e).__name__})"
    return None


__all__ = ["ENV_CA", "ENV_CA_DATA", "ENV_CERT", "ENV_KEY", "ENV_SERVER_NAME", "TlsSettings",
           "VerifiedHTTPSConnection", "aiohttp_options", "check_peer_url", "client_context",
           "pooled_request", "refusal", "server_context", "server_hostname", "urllib3_options"]
