"""A serving runtime as the agent sees it: apply engine, dense load, bit fingerprints.

The dense load goes through the same ``load_weights`` as every refit, so a receiver
restored by a dense refit holds exactly the bits any other receiver reached in place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from dcr.apply.engine import BITS, TORCH_DTYPES, ApplyEngine, CanonicalTensor
from dcr.checkpoint import Checkpoint, fingerprint
from dcr.errors import CheckpointError
from dcr.format.profile import ReceiverProfile
from dcr.runtimes.base import Runtime


def checkpoint_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as torch tensors over copies of its stored bits."""
    out = {}
    for info in ckpt:
        size = info.dtype.itemsize
        bits = np.array(ckpt.bits(info.name))  # a copy: the loader may keep a reference
        t = torch.from_numpy(bits.view(f"<i{size}" if size > 1 else "u1"))
        out[info.name] = t.view(BITS[size]).view(TORCH_DTYPES[info.dtype.name]).reshape(
            info.shape)
    return out


def runtime_fingerprint(runtime: Runtime) -> dict[str, str]:
    """xxh3-128 of the integer view of every parameter and buffer the runtime names."""
    out = {}
    for name, t in runtime.named_tensors():
        flat = t.detach().contiguous().reshape(-1).cpu()
        out[name] = fingerprint(flat.view(BITS[flat.element_size()]).numpy())
    return out


class RuntimeHost:
    """One rank's runtime, its apply engine, and in-flight generation accounting."""

    def __init__(self, runtime: Runtime, canonical: list[CanonicalTensor],
                 *, device: str = "cpu") -> None:
        self.runtime = runtime
        self.canonical = canonical
        self.engine = ApplyEngine(runtime, device=device)
        self.profile: ReceiverProfile = self.engine.prewarm(canonical)
        self._inflight = 0
        self._idle = threading.Condition()

    def load_dense(self, checkpoint: Path) -> None:
        with Checkpoint(checkpoint) as ckpt:
            want = {(t.name, t.dtype, tuple(t.shape)) for t in self.canonical}
            got = {(i.name, i.dtype.name, tuple(i.shape)) for i in ckpt}
            if want != got:
                raise CheckpointError(
                    f"Checkpoint {checkpoint} does not hold this rank's canonical tensors: "
                    f"missing {sorted(w[0] for w in want - got)[:3]}, unexpected "
                    f"{sorted(g[0] for g in got - want)[:3]}."
                )
            self.runtime.load_weights(checkpoint_tensors(ckpt).items())
        self.sync()

    def sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def fingerprint(self) -> dict[str, str]:
        return runtime_fingerprint(self.runtime)

    @contextmanager
    def request(self, timeout_s: float) -> Iterator[None]:
        """Hold a generation request in flight while the gate is open.

        The request counts itself before it looks at the gate, so a gate that closes
        meanwhile waits for it (``drain``) instead of changing weights under it.
        """
        gate = getattr(self.runtime, "gate", None)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._idle:
                self._inflight += 1
            if gate is None or gate.is_open:
                break
            self._leave()
            if not gate.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"The request gate stayed closed for {timeout_s} s.")
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def generate(self, input_ids: list[int], new_tokens: int, timeout_s: float) -> list[int]:
        """Greedy decoding through the model's forward, behind the request gate."""
        model = getattr(self.runtime, "model", None)
        if not callable(model) or not hasattr(model, "config"):
            raise NotImplementedError("This runtime has no forward pass to serve.")
        with self.request(timeout_s), torch.inference_mode():
            ids = torch.tensor([input_ids], dtype=torch.long)
            for _ in range(new_tokens):
                logits = model(input_ids=ids).logits
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
            return [int(x) for x in ids[0, len(input_ids):]]

    def drain(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout_s)
