"""Tensors over a checkpoint's stored bits, and the bit fingerprint of a runtime.

Two torch-side helpers that every host of a model needs, whether DCR's agent hosts it
or a serving engine does (the vLLM worker extension, :mod:`dcr.runtimes.vllm`):

* a dense load hands the runtime's own loader exactly the stored bits of a checkpoint
  (:func:`checkpoint_tensors`), optionally checked against the fingerprints a manifest
  lists for that version first, so the bits checked are the bits loaded;
* a bit-exact check compares, per parameter and buffer, the xxh3-128 of its integer
  view (:func:`runtime_fingerprint`): floats are never compared as floats, so ``-0.0``
  against ``+0.0`` and NaN payloads count.

They live here, below the receiver, because an engine process must not import the
agent to use them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dcr.apply.applier import BITS, TORCH_DTYPES, Loader
from dcr.checkpoint import Checkpoint, fingerprint
from dcr.errors import CheckpointError

Tensors = dict[str, torch.Tensor]


class DenseRefused(CheckpointError):
    """A checkpoint is not this rank's model at the version asked for; nothing was
    written. The message names tensors of this rank, never bytes of the file."""


def checkpoint_tensors(ckpt: Checkpoint, expect: Mapping[str, str] | None = None) -> Tensors:
    """Every tensor of a checkpoint as torch tensors over copies of its stored bits.

    With ``expect`` (name -> fingerprint of the version's canonical bits), each listed
    tensor's copy must have that fingerprint: the bits checked are the bits loaded.
    """
    out = {}
    for info in ckpt:
        size = info.dtype.itemsize
        bits = np.array(ckpt.bits(info.name))  # a copy: the loader may keep a reference
        want = None if expect is None else expect.get(info.name)
        if want is not None and fingerprint(bits) != want:
            raise DenseRefused(f"Tensor {info.name!r} of checkpoint {ckpt.root} is not the "
                               f"version's: its fingerprint differs from {want}.")
        t = torch.from_numpy(bits.view(f"<i{size}" if size > 1 else "u1"))
        out[info.name] = t.view(BITS[size]).view(TORCH_DTYPES[info.dtype.name]).reshape(
            info.shape)
    return out


def tensor_fingerprint(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's integer view (row-major, on the host)."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    return fingerprint(flat.view(BITS[flat.element_size()]).numpy())


def runtime_fingerprint(runtime: Loader) -> dict[str, str]:
    """xxh3-128 of the integer view of every parameter and buffer the runtime names."""
    return {name: tensor_fingerprint(t) for name, t in runtime.named_tensors()}
