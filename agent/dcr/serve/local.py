"""An engine in process: ``dcr serve``'s workers called directly, for tests and benchmarks.

:class:`LocalDriver` drives the same workers, pause gate and version label as ``dcr serve``,
and checks their answers as a remote engine's; :meth:`restart` draws a new instance id, as a
restarted server would.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from dcr.apply.applier import Loader
from dcr.drivers.base import PauseMode
from dcr.drivers.errors import EngineError
from dcr.drivers.plugin import EngineTimeouts, PluginDriver, encode_arg
from dcr.runtimes.rank import EngineRank
from dcr.runtimes.vllm import DcrWorkerExtension
from dcr.serve.gate import PauseGate
from dcr.serve.workers import Workers, make_worker


class LocalDriver(PluginDriver):
    """``models`` (loaded or not; rank ``i`` of ``len(models)`` each) served in process.

    ``staging_dir`` and ``checkpoint_root`` are what a server's ``$DCR_STAGING_DIR`` and
    ``$DCR_CHECKPOINT_ROOT`` would be.
    """

    def __init__(self, models: Sequence[torch.nn.Module], *, staging_dir: Path,
                 checkpoint_root: Path, weight_version: str = "default") -> None:
        self.staging_dir = staging_dir.resolve()
        self.checkpoint_root = checkpoint_root.resolve()
        self.models = list(models)
        self.timeouts = EngineTimeouts()
        self.gate = PauseGate()
        self.label = weight_version
        self.up = True  # False: every call fails as an unreachable server's would
        self.restart()

    def __repr__(self) -> str:
        return f"LocalDriver({self.instance_id[:8]}, {len(self.models)} ranks)"

    def restart(self) -> None:
        """A new instance id and fresh workers over the same models (no prewarm)."""
        self.instance_id = secrets.token_hex(16)
        self.what = f"local engine {self.instance_id[:8]}"
        options = {"instance": self.instance_id, "staging_dir": self.staging_dir,
                   "checkpoint_root": self.checkpoint_root}
        world = len(self.models)
        self.workers = Workers([make_worker(m, rank=i, world=world, rank_options=options)
                                for i, m in enumerate(self.models)], threading.Lock())

    @property
    def ranks(self) -> list[EngineRank]:
        """Each rank as the plugin holds it (its loader, and its applier once
        prewarmed): for tests that look inside."""
        return [cast(DcrWorkerExtension, w)._dcr_rank() for w in self.workers.workers]

    @property
    def runtimes(self) -> list[Loader]:
        """Each rank's loader: what the plugin applies through and fingerprints."""
        return [r.runtime for r in self.ranks]

    def _plugin(self, method: str, arg: Mapping[str, Any] | None, *, call: str,
                timeout_s: float) -> list[Any]:
        self._reachable(call)
        try:
            results = self.workers.call(method, encode_arg(arg), {})
        except Exception as e:  # a server answers a worker's failure with an error status
            raise EngineError(f"{self.what}: {call} ({method}) failed: "
                              f"{type(e).__name__}: {e}", 400, call=call) from e
        return cast(list[Any], json.loads(json.dumps(results)))  # what would cross the wire

    def _reachable(self, call: str) -> None:
        if not self.up:
            raise EngineError(f"{self.what}: {call}: the engine does not answer.", None,
                              call=call)

    def pause(self, mode: PauseMode = "wait") -> None:
        self._reachable("pause")
        self.gate.pause(mode)

    def resume(self) -> None:
        self._reachable("resume")
        self.gate.resume()

    def set_version(self, label: str) -> None:
        self._reachable("set_version")
        self.label = label

    def version(self) -> str | None:
        self._reachable("version")
        return self.label

    def health(self) -> bool:
        return self.up


__all__ = ["LocalDriver"]
