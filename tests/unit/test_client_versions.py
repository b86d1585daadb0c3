"""``dcr.client``'s sample versions: an answer's spans, from any engine, as per-token versions
and each version as the commit the store's history names."""

from __future__ import annotations

from typing import Any

import pytest

from dcr.client import (
    SampleVersionError,
    history_digest_of,
    read_events,
    sample_commits,
    token_versions,
)
from dcr.format.history import Committed, History, ObjectRef

SPANS = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 5}]
PER_TOKEN = ["1", "1", "2", "2", "2"]


def vllm_answer(spans: Any = SPANS, tokens: int = 5) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [
        {"index": 0, "text": "", "token_ids": list(range(tokens)), "finish_reason": "length",
         "weight_versions": spans}]}


def test_a_vllm_answer_streamed_or_not_and_sglangs_give_the_same_per_token_versions() -> None:
    stream = [b'data: {"choices":[{"index":0,"token_ids":[%d]}]}\n' % t for t in range(5)]
    stream += [b"\n", b'data: {"choices":[{"index":0,"token_ids":[],"finish_reason":"length",'
               b'"weight_versions":' + str(SPANS).replace("'", '"').encode() + b"}]}\n",
               b"data: [DONE]\n", b'data: {"never": "read"}\n']
    sglang_generate = {"output_ids": [0] * 5, "meta_info": {
        "completion_tokens": 5, "weight_version": "2", "weight_versions": SPANS}}
    sglang_openai = {"choices": [{"index": 0, "text": "abc"}],
                     "metadata": {"weight_version": "2", "weight_versions": SPANS}}
    for answer in (vllm_answer(), list(read_events(stream)), sglang_generate, sglang_openai,
                   [{"meta_info": {"completion_tokens": 2}},
                    sglang_generate]):  # SGLang's stream counts every token in each chunk
        assert token_versions(answer) == PER_TOKEN


@pytest.mark.parametrize(("answer", "named"), [
    (vllm_answer(spans=None), "carries no weight_versions"),
    ({"choices": [{"index": 0, "token_ids": [1]}]}, "return_weight_versions: true"),
    (vllm_answer(spans=[{"version": "1", "start": 1, "end": 5}]), "'start': 1"),
    (vllm_answer(spans=[SPANS[1], SPANS[0]]), "does not follow on at token 0"),
    (vllm_answer(spans=[{"version": 1, "start": 0, "end": 5}]), "'version': 1"),
    (vllm_answer(tokens=6), "cover 5 tokens; the answer holds 6"),
])
def test_spans_that_do_not_cover_the_tokens_are_refused_naming_the_span(
        answer: dict[str, Any], named: str) -> None:
    with pytest.raises(SampleVersionError, match=named.replace("[", r"\[")):
        token_versions(answer)


def test_an_error_in_a_stream_is_raised_with_its_message() -> None:
    with pytest.raises(SampleVersionError, match="boom"):
        list(read_events([b'data: {"error": {"message": "boom"}}\n']))


def ref(n: int) -> ObjectRef:
    return ObjectRef(key=f"v{n}/m", size=10, digest=f"{n:032x}")


def test_each_version_is_named_by_its_commit_in_the_history() -> None:
    history = History(versions=(
        Committed(version=1, base_version=0, attempt="a-000000000001", parts=(ref(1),),
                  payload_bytes=5),
        Committed(version=2, base_version=1, attempt="a-000000000002", parts=(ref(2), ref(3)),
                  payload_bytes=7)))
    proof = sample_commits(PER_TOKEN, history)
    assert list(proof) == ["1", "2"]
    assert (proof["2"].attempt, proof["2"].base_version, proof["2"].manifests) == (
        "a-000000000002", 1, (f"{2:032x}", f"{3:032x}"))
    assert proof["1"].history_digest == history_digest_of(history)
    for label, named in (("default", "'default' is not a version DCR committed"),
                         ("0", "no committed version 0"), ("3", "no committed version 3")):
        with pytest.raises(SampleVersionError, match=named):
            sample_commits(["1", label], history)
