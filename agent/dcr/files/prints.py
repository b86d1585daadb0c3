"""A checkpoint's tensor fingerprints of the kind the history lists each by.

A manifest lists a tensor by ``xxh3-128`` of its bits where an owner held it whole, and
by ``sum64``, the additive sum over the whole tensor (``dcr.codec.sums``), where the
owners were trainer ranks that each held part of it (their parts added when the
manifest's parts are merged). Whoever holds a whole copy computes either; this module
computes, per tensor, the one its vouched fingerprint is. FORMAT.md, "Manifest".
"""

from __future__ import annotations

from collections.abc import Mapping

from dcr.checkpoint import Checkpoint, fingerprint
from dcr.codec.sums import fingerprint_as


def held_prints(ckpt: Checkpoint, expect: Mapping[str, str]) -> dict[str, str]:
    """Every tensor's fingerprint in ``ckpt``, of the kind ``expect`` lists it by
    (``xxh3-128`` for a tensor it does not list, so a comparison names it)."""
    return {n: fingerprint_as(expect.get(n, ""), ckpt.bits(n), fingerprint)
            for n in ckpt.names()}
