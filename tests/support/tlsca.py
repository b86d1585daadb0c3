"""A real certificate authority for the TLS tests, minted with ``cryptography``.

``Authority.mint(dir, "test-ca")`` writes ``ca.crt``; ``authority.leaf(dir, dns=...,
ips=...)`` writes a server's ``tls.crt`` and ``tls.key`` signed by it, named as
cert-manager names a Secret's keys. :meth:`Leaf.env` is what a server process is given;
:func:`plain_get` is a plain-HTTP client that sends a token.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass(frozen=True)
class Leaf:
    """A server's pair, as cert-manager writes a Secret: ``tls.crt``, ``tls.key``, ``ca.crt``."""

    cert: Path
    key: Path
    ca: Path

    def env(self) -> dict[str, str]:
        """A process that serves with this pair and verifies peers against its CA."""
        return {"DCR_TLS_CERT": str(self.cert), "DCR_TLS_KEY": str(self.key),
                "DCR_TLS_CA": str(self.ca)}


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    path: Path  # ca.crt

    @classmethod
    def mint(cls, directory: Path, common: str = "dcr-test-ca") -> Authority:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False),
                    critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False)
                .sign(key, hashes.SHA256()))
        path = directory / "ca.crt"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(key, cert, path)

    def leaf(self, directory: Path, *, dns: tuple[str, ...] = ("localhost",),
             ips: tuple[str, ...] = ("127.0.0.1",)) -> Leaf:
        """A server certificate for ``dns`` names and ``ips``, in ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        cert = (x509.CertificateBuilder().subject_name(_name(dns[0] if dns else ips[0]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    self.key.public_key()), critical=False)
                .sign(self.key, hashes.SHA256()))
        leaf = Leaf(directory / "tls.crt", directory / "tls.key", directory / "ca.crt")
        leaf.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        leaf.key.write_bytes(_key_pem(key))
        leaf.key.chmod(0o600)
        leaf.ca.write_bytes(self.path.read_bytes())
        return leaf


def plain_get(port: int, path: str = "/healthz", token: str = "") -> int:
    """The status a plain-HTTP ``GET`` to 127.0.0.1:``port`` is answered (a TLS server
    answers none: the call raises)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        return conn.getresponse().status
    finally:
        conn.close()
