"""``POST /v1/completions`` of the reference server: tokens from token-id prompts, greedy
or (``temperature`` > 0) sampled with the request's ``seed``, each with its logprob under
the distribution it was drawn from (vLLM's ``logprobs: 0`` with processed logprobs, what
an RL trainer takes as the behaviour policy's).

Only the part of vLLM's request a refit test needs; anything else is a 400 naming the field.
:func:`greedy` passes the pause gate's :meth:`~dcr.serve.gate.PauseGate.step` before each
token and reads the weight-version label under the model lock with the forward that makes
the token, so a label changed between two steps (by a refit, while the gate holds the
completion) switches exactly at the first token of the new weights. Answers are vLLM's
``CompletionResponse``, or with ``stream`` its server-sent ``CompletionStreamResponse``
chunks: one per token, then one carrying ``finish_reason`` and (asked for with
``return_weight_versions``) the spans over the whole output, as vLLM 0.33 sends them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr.errors import Invalid, first_validation_error
from dcr.serve.gate import Aborted, PauseGate


class BadCompletion(Invalid, ValueError):
    """A completion body the server refuses (the message names the field or value)."""


class CompletionBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    prompt: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] = 16
    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None  # 0 or None: greedy
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] | None = None  # the sampler's, per request
    logprobs: Annotated[int, Field(ge=0, le=0)] | None = None  # 0: the chosen token's only
    return_weight_versions: bool = False
    stream: bool = False  # server-sent events, one chunk per token


def parse_completion(raw: bytes, *, vocab: int, max_input: int,
                     max_tokens: int) -> CompletionBody:
    """The checked body, or :class:`BadCompletion` naming what is wrong."""
    try:
        body = CompletionBody.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise BadCompletion(f"completions: {first_validation_error(e, 'body')}") from None
    if len(body.prompt) > max_input:
        raise BadCompletion(f"completions: prompt: {len(body.prompt)} token ids; at most "
                            f"{max_input}.")
    if body.max_tokens > max_tokens:
        raise BadCompletion(f"completions: max_tokens: {body.max_tokens}; at most "
                            f"{max_tokens}.")
    if body.stream and body.logprobs is not None:
        raise BadCompletion("completions: logprobs: answered unstreamed only (stream: false).")
    bad = next((i for i in body.prompt if i >= vocab), None)
    if bad is not None:
        raise BadCompletion(f"completions: prompt: token id {bad} is outside the vocabulary "
                            f"(0..{vocab - 1}).")
    return body


@dataclass(kw_only=True)
class Completion:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    versions: list[str] = field(default_factory=list)  # the label at each token
    logprobs: list[float] = field(default_factory=list)  # each token's, as it was drawn


def pick(logits: torch.Tensor, temperature: float | None,
         gen: torch.Generator) -> tuple[int, float]:
    """The next token and its logprob: the argmax at temperature 0 (or None), else a draw
    from ``softmax(logits / temperature)`` with ``gen``."""
    t = temperature or 1.0
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    token = (int(logp.argmax()) if not temperature
             else int(torch.multinomial(logp.exp(), 1, generator=gen)))
    return token, float(logp[token])


def greedy(model: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], max_tokens: int,
           *, gate: PauseGate, lock: Any, label: Callable[[], str], min_step_s: float = 0.0,
           on_token: Callable[[int], object] | None = None,
           gone: Callable[[], bool] | None = None, temperature: float | None = None,
           seed: int | None = None) -> Completion:
    """Decoding of ``max_tokens`` tokens behind the gate (:class:`~dcr.serve.gate.Paused`
    when it refuses new completions), greedy unless ``temperature`` (:func:`pick`).
    ``on_token`` is called with each token as it is made; ``gone`` (the client left) ends
    the completion at its next step, as an abort."""
    ticket = gate.admit()
    out = Completion()
    gen = torch.Generator()
    gen.manual_seed(seed) if seed is not None else gen.seed()
    try:
        ids = torch.tensor([prompt], dtype=torch.long)
        for _ in range(max_tokens):
            try:
                gate.step(ticket)
            except Aborted:
                out.finish_reason = "abort"
                break
            if gone is not None and gone():
                out.finish_reason = "abort"
                break
            started = time.monotonic()
            with lock, torch.inference_mode():
                token, logprob = pick(model(ids)[0, -1], temperature, gen)
                out.versions.append(label())
            time.sleep(max(0.0, min_step_s - (time.monotonic() - started)))
            out.tokens.append(token)
            out.logprobs.append(logprob)
            if on_token is not None:
                on_token(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    finally:
        gate.leave(ticket)
    return out


def spans(versions: list[str]) -> list[dict[str, Any]]:
    """vLLM's ``weight_versions``: ``[{version, start, end}]`` over output tokens."""
    out: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if out and out[-1]["version"] == v:
            out[-1]["end"] = i + 1
        else:
            out.append({"version": v, "start": i, "end": i + 1})
    return out


def _choice(tokens: list[int], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": "", "token_ids": tokens, "finish_reason": finish_reason,
            "logprobs": None, "stop_reason": None}


def _head(body: CompletionBody, served: str, cid: str, created: int) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created,
            "model": body.model or served}


def response(body: CompletionBody, c: Completion, served: str) -> dict[str, Any]:
    """vLLM's ``CompletionResponse`` for one choice."""
    choice = _choice(c.tokens, c.finish_reason)
    if body.return_weight_versions:
        choice["weight_versions"] = spans(c.versions)
    if body.logprobs is not None:  # vLLM's (OpenAI's) legacy completions shape
        choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in c.tokens],
                              "token_logprobs": c.logprobs,
                              "top_logprobs": [{} for _ in c.tokens],
                              "text_offset": [0 for _ in c.tokens]}
    return {**_head(body, served, f"cmpl-{uuid.uuid4().hex}", int(time.time())),
            "choices": [choice],
            "usage": {"prompt_tokens": len(body.prompt), "completion_tokens": len(c.tokens),
                      "total_tokens": len(body.prompt) + len(c.tokens)}}


@dataclass(frozen=True)
class Stream:
    """The chunks of one streamed completion (vLLM's ``CompletionStreamResponse``), each
    an event ``data: {...}``; the stream ends with ``data: [DONE]``."""

    body: CompletionBody
    served: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def token(self, token: int) -> bytes:
        return self._event([token], None)

    def last(self, c: Completion) -> bytes:
        """The closing chunk: no token, the finish reason, and the spans over the whole
        output where they were asked for."""
        return self._event([], c.finish_reason, spans(c.versions)
                           if self.body.return_weight_versions else None)

    def _event(self, tokens: list[int], finish: str | None,
               versions: list[dict[str, Any]] | None = None) -> bytes:
        choice = _choice(tokens, finish)
        if versions is not None:
            choice["weight_versions"] = versions
        chunk = {**_head(self.body, self.served, self.id, self.created), "choices": [choice]}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"

__all__ = ["DONE", "BadCompletion", "Completion", "CompletionBody", "Stream", "greedy",
           "parse_completion", "pick", "response", "spans"]
