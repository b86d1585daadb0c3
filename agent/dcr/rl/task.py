"""The RL main job's task: byte completions rewarded for digits.

The main job's Llama reads bytes (256 token ids), so the task needs no tokenizer download:
:func:`byte_tokenizer` maps each byte to its id. The reward is the share of a completion's
bytes that are ASCII digits. Why it fits a CPU and a few minutes: a near-uniform byte model
already draws digits at 10/256 per token, so every group of completions differs in reward
from the first step (GRPO learns only from differences within a group); the reward is
dense (every token counts); and what it must learn, raising ten output logits whatever the
prompt, is within a few dozen steps of a tiny model. docs/trainer.md, "With TRL".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DIGITS = frozenset(b"0123456789")
PAD = 0  # byte 0: padding and end of text (never in a prompt)
PROMPTS = ("def ", "x = ", "id: ", "# ", "return ", "n=", "port ", "key ", "at ", "v",
           "line ", "row ", "year ", "(", "[", "total ")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer whose token ids are the bytes of the text (latin-1 characters)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(256)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, pad_token=chr(PAD), eos_token=chr(PAD))


def digit_share(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The reward: the share of each completion's bytes that are digits."""
    return [sum(t in DIGITS for t in ids) / max(len(ids), 1) for ids in completion_ids]


def prompts(n: int) -> list[str]:
    """``n`` prompts, the fixed ones in turn."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


__all__ = ["DIGITS", "PROMPTS", "byte_tokenizer", "digit_share", "prompts"]
