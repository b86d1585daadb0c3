"""An image registry for the deploy tier: distribution's ``registry serve`` (a Go module,
built by ``tools/controlplane/build.sh registry``) behind TLS and an htpasswd login.

The project's images are pushed to it with ``tools/image/push.sh`` (``make push``) and the
node's containerd pulls them as a cluster would: by the chart's image values, with a pull
Secret. Its certificate is self-signed for its address; containerd trusts it through the
node's ``hosts.toml`` and podman through ``--cert-dir``. The login's password travels in
files only (an htpasswd hash for the server, an auth file for podman, a Secret for the
kubelet), never in argv.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
from controlplane import REPO_ROOT, built
from s3server import stop_process
from stubs import free_port_on

USER = "dcr-deploy"
PUSH_SCRIPT = REPO_ROOT / "tools" / "image" / "push.sh"


@dataclass(frozen=True, kw_only=True)
class Registry:
    address: str  # HOST:PORT, as image references name it
    ca: Path  # its self-signed certificate: what a client must trust
    cert_dir: Path  # a directory holding it as ca.crt (podman's --cert-dir)
    auth_file: Path  # podman's auth file with the login (REGISTRY_AUTH_FILE)
    log: Path
    password: str

    def docker_config(self) -> str:
        """The login as a ``.dockerconfigjson`` (a kubernetes.io/dockerconfigjson Secret)."""
        return self.auth_file.read_text()

    def pull_secret(self, name: str) -> dict[str, object]:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                "type": "kubernetes.io/dockerconfigjson",
                "data": {".dockerconfigjson": base64.b64encode(
                    self.docker_config().encode()).decode()}}


@dataclass(frozen=True, kw_only=True)
class Pushed:
    """An image pushed to a :class:`Registry`: the reference Pods name, and its digest."""

    ref: str  # <registry>/<path>/<name>:<version>
    digest: str  # sha256:... of its manifest, as pushed
    registry: Registry


def _certificate(d: Path, host: str) -> Path:
    """A self-signed certificate for IP ``host`` (its own CA), and its key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make the registry's certificate")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", "tls.key", "-out", "tls.crt", "-days", "7",
         "-subj", "/CN=dcr-deploy-registry",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,digitalSignature,keyCertSign",
         "-addext", "extendedKeyUsage=serverAuth",
         "-addext", f"subjectAltName=IP:{host}"],
        cwd=d, check=True, capture_output=True, timeout=60)
    return d / "tls.crt"


def _answers(url: str, ca: Path) -> bool:
    """Whether the registry answers its API root (401 without a login counts)."""
    try:
        urllib.request.urlopen(url, context=ssl.create_default_context(cafile=str(ca)),
                               timeout=2)
    except urllib.error.HTTPError as e:
        return e.code == 401
    except OSError:
        return False
    return True


@contextlib.contextmanager
def registry(root: Path, *, host: str, progress: Callable[[str], None] | None = None
             ) -> Iterator[Registry]:
    """``registry serve`` on ``host`` over ``root / "data"``, with one login."""
    binary = built("registry", progress=progress)["registry"]
    root.mkdir(parents=True, exist_ok=True)
    ca = _certificate(root, host)
    cert_dir = root / "certs.d"
    cert_dir.mkdir()
    shutil.copy(ca, cert_dir / "ca.crt")
    password = secrets.token_hex(16)
    (root / "htpasswd").write_bytes(
        USER.encode() + b":" + bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=10)) + b"\n")
    port = free_port_on(host)
    address = f"{host}:{port}"
    auth_file = root / "auth.json"
    login = base64.b64encode(f"{USER}:{password}".encode()).decode()
    auth_file.write_text(json.dumps({"auths": {address: {"auth": login}}}))
    auth_file.chmod(0o600)
    (root / "config.yml").write_text(json.dumps({  # YAML is a superset of JSON
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(root / "data")}},
        "http": {"addr": address, "secret": secrets.token_hex(16),
                 "tls": {"certificate": str(ca), "key": str(root / "tls.key")}},
        "auth": {"htpasswd": {"realm": "dcr-deploy", "path": str(root / "htpasswd")}},
    }))
    log = root / "registry.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(binary), "serve", str(root / "config.yml")],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"https://{address}/v2/", ca):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"registry serve did not answer on {address}:\n"
                                   f"{log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield Registry(address=address, ca=ca, cert_dir=cert_dir, auth_file=auth_file,
                       log=log, password=password)
    finally:
        stop_process(proc)


def push(reg: Registry, path: str, role: str = "dcr") -> Pushed:
    """``make push REGISTRY=<registry>/<path>`` of one image role, with the registry's
    login and CA; what it pushed. Raises ``RuntimeError`` with push.sh's output when it
    fails or reports anything but that one image."""
    done = subprocess.run(
        ["bash", str(PUSH_SCRIPT), f"{reg.address}/{path}", role], capture_output=True,
        text=True, timeout=600, check=False,
        env={**os.environ, "REGISTRY_AUTH_FILE": str(reg.auth_file),
             "DCR_PUSH_CERT_DIR": str(reg.cert_dir)})
    lines = [line.split() for line in done.stdout.splitlines()]
    if done.returncode != 0 or len(lines) != 1 or lines[0][:2] != ["pushed", role]:
        raise RuntimeError(f"{PUSH_SCRIPT} exited with {done.returncode}:\n{done.stdout}\n"
                           f"{done.stderr[-3000:]}")
    ((_, _, ref, digest),) = lines
    return Pushed(ref=ref, digest=digest, registry=reg)
