"""Tensors over a checkpoint's stored bits, and the bit fingerprint of a runtime.

:func:`checkpoint_tensors` hands a loader exactly a checkpoint's stored bits, optionally
checked first against a manifest's fingerprints; :func:`runtime_fingerprint` hashes every
parameter's and buffer's integer view, never comparing floats. Below the receiver, so an
engine process uses them without importing the agent.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dcr.apply import xxh3
from dcr.apply.applier import BITS, TORCH_DTYPES, Loader
from dcr.checkpoint import Checkpoint, fingerprint
from dcr.codec.sums import fingerprint_as
from dcr.errors import CheckpointError

Tensors = dict[str, torch.Tensor]


class DenseRefused(CheckpointError):
    """A checkpoint is not this rank's model at the version asked for; nothing was
    written. The message names tensors of this rank, never bytes of the file."""


def checkpoint_tensors(ckpt: Checkpoint, expect: Mapping[str, str] | None = None) -> Tensors:
    """Every tensor of a checkpoint as torch tensors over copies of its stored bits.

    With ``expect`` (name -> fingerprint of the version's canonical bits: xxh3-128, or
    the whole tensor's sum where the owners were ranks), each listed tensor's copy must
    have that fingerprint: the bits checked are the bits loaded.
    """
    out = {}
    for info in ckpt:
        size = info.dtype.itemsize
        bits = np.array(ckpt.bits(info.name))  # a copy: the loader may keep a reference
        want = None if expect is None else expect.get(info.name)
        if want is not None and fingerprint_as(want, bits, fingerprint) != want:
            raise DenseRefused(f"Tensor {info.name!r} of checkpoint {ckpt.root} is not the "
                               f"version's: its fingerprint differs from {want}.")
        t = torch.from_numpy(bits.view(f"<i{size}" if size > 1 else "u1"))
        out[info.name] = t.view(BITS[size]).view(TORCH_DTYPES[info.dtype.name]).reshape(
            info.shape)
    return out


def tensor_fingerprint(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's integer view (row-major): on the host for a CPU tensor, else
    on its device with 1/16 of its bytes reaching the host (``dcr.apply.xxh3``)."""
    if t.device.type != "cpu":
        return xxh3.fingerprint(t.detach())
    flat = t.detach().contiguous().reshape(-1)
    return fingerprint(flat.view(BITS[flat.element_size()]).numpy())


def runtime_fingerprint(runtime: Loader) -> dict[str, str]:
    """xxh3-128 of the integer view of every parameter and buffer the runtime names."""
    return {name: tensor_fingerprint(t) for name, t in runtime.named_tensors()}
