"""Which files a checkpoint built from the store holds, and where each comes from.

The history vouches for tensors only: every tensor's fingerprint at every version it
names. So a built checkpoint takes its **tensor files** (the safetensors shards a
:class:`~dcr.checkpoint.Checkpoint` reads, and their index) from a snapshot or a seed,
and every tensor in them is checked against those fingerprints. Every **other file** a
pod reads (``config.json``, the tokenizer, ``modeling_*.py`` for ``trust_remote_code``)
comes only from the pod's seed, the checkpoint it was deployed with, and only if its name
is on :data:`CARRIED` and it fits the bounds below: nothing a store writer writes reaches
them, and a seed cannot smuggle a blob along.

Choices, and why: the refit changes weights, never a config or a tokenizer (a manifest
names tensors only), so the seed a pod already trusts holds the right ones for every
version, and no new field in the history or the manifest is needed to vouch for them.
docs/catch-up.md, "Files besides the tensors".
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from dcr.checkpoint import INDEX_NAME, Checkpoint
from dcr.errors import CheckpointError

log = logging.getLogger(__name__)

# Non-tensor files a pod may take from its seed (fullmatch): configs, tokenizers, chat
# templates, and the Python a model with trust_remote_code imports.
CARRIED = re.compile(
    r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens"
    r"|preprocessor_config|processor_config|chat_template)\.json"
    r"|tokenizer\.model|vocab\.(json|txt)|merges\.txt|chat_template\.jinja"
    r"|(modeling|configuration|tokenization)_[A-Za-z0-9_]{1,100}\.py")
MAX_CARRIED_FILES = 32  # more than any model's configs, tokenizer and remote code
MAX_CARRIED_FILE_BYTES = 64 << 20  # the largest tokenizer.json is a few tens of MiB
MAX_CARRIED_BYTES = 128 << 20  # all carried files together


def is_tensor_file(name: str) -> bool:
    """A file a snapshot carries: a safetensors shard or the shards' index."""
    return name.endswith(".safetensors") or name == INDEX_NAME


def tensor_files(root: Path) -> list[Path]:
    """The files of ``root`` its tensors are read from (and the shards' index)."""
    with Checkpoint(root) as ckpt:
        files = list(ckpt.files)
    index = root / INDEX_NAME
    return [*files, index] if root.is_dir() and index.is_file() else files


def carried_files(root: Path) -> list[Path]:
    """The files of ``root`` besides its tensors that a built checkpoint carries: those on
    :data:`CARRIED`, refused by name past :data:`MAX_CARRIED_FILES` files,
    :data:`MAX_CARRIED_FILE_BYTES` each or :data:`MAX_CARRIED_BYTES` in all."""
    found, total, left = [], 0, []
    for p in sorted(root.iterdir()):
        if not p.is_file() or p.is_symlink() or is_tensor_file(p.name):
            continue
        if CARRIED.fullmatch(p.name) is None:
            left.append(p.name)
            continue
        size = p.stat().st_size
        total += size
        if size > MAX_CARRIED_FILE_BYTES:
            raise CheckpointError(f"{p} is {size} bytes; a carried file may have at most "
                                  f"{MAX_CARRIED_FILE_BYTES}.")
        if total > MAX_CARRIED_BYTES:
            raise CheckpointError(f"{root}: the carried files up to {p.name} are {total} "
                                  f"bytes; at most {MAX_CARRIED_BYTES} are carried.")
        found.append(p)
        if len(found) > MAX_CARRIED_FILES:
            raise CheckpointError(f"{root}: {p.name} is carried file {len(found)}; at most "
                                  f"{MAX_CARRIED_FILES} are carried.")
    if left:
        log.info("%s: not carried (neither tensors nor on the allow-list): %s", root,
                 left[:16])
    return found


def copy_vouched(src: Path, dst: Path, *, tensors: bool = True,
                 copy: Callable[[str, str], object] = shutil.copy2) -> None:
    """Put ``src``'s tensor files (with ``tensors``) and its carried files into the
    directory ``dst``; nothing else of ``src`` is read."""
    dst.mkdir(parents=True, exist_ok=True)
    files = (tensor_files(src) if tensors else []) + carried_files(src)
    for p in files:
        target = dst / p.name
        if target.exists() or target.is_symlink():
            os.unlink(target)
        copy(str(p), str(target))
