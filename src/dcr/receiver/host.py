"""A serving runtime as the agent sees it: apply engine, dense load, bit fingerprints.

The dense load goes through the same ``load_weights`` as every refit, so a receiver
restored by a dense refit holds exactly the bits any other receiver reached in place.
It reads and checks the whole checkpoint first (:meth:`RuntimeHost.read_dense`: this
rank's canonical tensors, and the fingerprints a manifest lists for the version where
the caller has them) and only then writes (:meth:`RuntimeHost.load_tensors`), so a
refused checkpoint leaves the weights as they were.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from dcr.apply.engine import ApplyEngine, CanonicalTensor
from dcr.checkpoint import Checkpoint
from dcr.format.profile import ReceiverProfile
from dcr.protocol.agent_api import BadRequest
from dcr.runtimes.base import Runtime
from dcr.runtimes.weights import (  # shared with engine processes; named here for callers
    DenseRefused,
    Tensors,
    checkpoint_tensors,
    runtime_fingerprint,
)

__all__ = ["DenseRefused", "RuntimeHost", "Tensors", "checkpoint_tensors",
           "runtime_fingerprint"]


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
        self.load_tensors(self.read_dense(checkpoint))

    def read_dense(self, checkpoint: Path, *, expect: Mapping[str, str] | None = None,
                   root: Path | None = None) -> Tensors:
        """This rank's canonical tensors from ``checkpoint``, checked, without writing.

        With ``root``, every file the checkpoint is read from must lie under it (links
        resolved). With ``expect``, the fingerprints must match (:func:`checkpoint_tensors`).
        """
        with Checkpoint(checkpoint) as ckpt:
            if root is not None:
                outside = [f for f in ckpt.files if not f.resolve().is_relative_to(root)]
                if outside:
                    raise DenseRefused(f"Checkpoint {checkpoint}: {len(outside)} of its files "
                                       f"lie outside the checkpoint root {root}.")
            want = {(t.name, t.dtype, tuple(t.shape)) for t in self.canonical}
            got = {(i.name, i.dtype.name, tuple(i.shape)) for i in ckpt}
            if want != got:
                raise DenseRefused(
                    f"Checkpoint {checkpoint} does not hold this rank's canonical tensors: "
                    f"missing {sorted(w[0] for w in want - got)[:3]} and "
                    f"{len(got - want)} unexpected."
                )
            return checkpoint_tensors(ckpt, expect)

    def load_tensors(self, tensors: Tensors) -> None:
        self.runtime.load_weights(tensors.items())
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

    def check_prompt(self, input_ids: list[int], *, max_input: int) -> None:
        """Refuse a prompt the model cannot take (:class:`BadRequest` names the value)."""
        model = getattr(self.runtime, "model", None)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if not callable(model) or not isinstance(vocab, int):
            raise BadRequest("generate: this runtime has no forward pass to serve.")
        if len(input_ids) > max_input:
            raise BadRequest(f"generate: {len(input_ids)} input ids; at most {max_input}.")
        bad = next((i for i in input_ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise BadRequest(f"generate: input id {bad} is outside the vocabulary "
                             f"(0..{vocab - 1}).")

    def generate(self, input_ids: list[int], new_tokens: int, timeout_s: float) -> list[int]:
        """Greedy decoding through the model's forward, behind the request gate; the
        caller checks the prompt first (:meth:`check_prompt`)."""
        model = getattr(self.runtime, "model", None)
        if not callable(model):
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
