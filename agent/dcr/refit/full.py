"""The full-checkpoint refit the main job times beside each DCR refit (``full s``).

``full_s`` is the trainer's upload plus the slowest pod's download through its own link
(``FULL_STREAMS`` files at a time, as ``aws s3 cp --recursive``) and dense load.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dcr.refit.launch import AgentProcess
from dcr.transport.store import FileStore

if TYPE_CHECKING:
    from dcr.transport.s3 import S3Store

FULL_STREAMS = 8  # files one transfer moves at once, as aws s3 cp does


@dataclass(frozen=True, kw_only=True)
class FullPath:
    """Where full checkpoints travel: the store as the trainer reaches it (uploads) and as
    each pod does (downloads, through the pod's link)."""

    upload: FileStore | S3Store
    pods: list[FileStore | S3Store]  # by pod index

    def delete(self, prefix: str) -> None:
        """Remove the objects under ``prefix`` (the Store seam has no delete)."""
        if isinstance(self.upload, FileStore):  # its objects are files under its root
            shutil.rmtree(self.upload.root / prefix, ignore_errors=True)
            return
        for key in self.upload.list(prefix):
            self.upload.delete(key)


def full_refit(v: int, ckpt: Path, agents: Sequence[AgentProcess], path: FullPath,
               copies: Sequence[Path]) -> dict[str, float]:
    """Refit every agent's server to version ``v`` from the full checkpoint ``ckpt``
    through ``path``, each into its own directory (``copies``, by agent, on the pod's
    volume); seconds and bytes."""
    prefix = f"full/v{v}/"
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())

    def load(i: int) -> float:
        t = time.perf_counter()
        agent, store = agents[i], path.pods[i]
        home = copies[i] / f"v{v}"

        def fetch(name: str) -> None:
            (home / name).parent.mkdir(parents=True, exist_ok=True)
            (home / name).write_bytes(store.get(prefix + name))

        with ThreadPoolExecutor(FULL_STREAMS, thread_name_prefix=f"full-{i}") as pool:
            list(pool.map(fetch, files))
        agent.client().rejoin(v, str(home))
        return time.perf_counter() - t

    def put(name: str) -> None:
        path.upload.put(prefix + name, (ckpt / name).read_bytes())

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(FULL_STREAMS, thread_name_prefix="full-up") as pool:
            list(pool.map(put, files))
        upload_s = time.perf_counter() - t0
        with ThreadPoolExecutor(len(agents), thread_name_prefix="full") as pool:
            load_s = max(pool.map(load, range(len(agents))))
    finally:
        path.delete(prefix)
        for home in copies:
            shutil.rmtree(home, ignore_errors=True)
    return {"full_s": upload_s + load_s, "full_upload_s": upload_s, "full_load_s": load_s,
            "full_bytes": sum((ckpt / n).stat().st_size for n in files)}
