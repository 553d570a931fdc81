"""OpenAI batch lines -> llmq requests, and llmq results -> OpenAI batch output lines (no Redis)."""

from __future__ import annotations

import json

import pytest

from llmq.gateway.openai_batch import (
    BatchLineError,
    error_record,
    failed_record,
    output_record,
    parse_line,
)
from llmq.protocol import Choice, Done, Error, Timings, Usage


def batch_line(url: str = "/v1/chat/completions", **body) -> str:
    return json.dumps({"custom_id": "r1", "method": "POST", "url": url, "body": body})


def test_a_chat_line_becomes_a_messages_request() -> None:
    line = parse_line(batch_line(model="m", messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "there"}]}],
        max_completion_tokens=5, temperature=0, top_p=0.9, stop=["\n"], seed=3, user="u1",
        n=1, stream=False), 1)
    assert line.custom_id == "r1" and line.model == "m"
    assert line.request == {
        "model": "m", "max_tokens": 5, "temperature": 0, "top_p": 0.9, "stop": ["\n"],
        "seed": 3, "messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi there"}]}


def test_n_and_response_format_pass_through_and_every_choice_is_returned() -> None:
    # Given a chat line asking for two JSON completions
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    line = parse_line(batch_line(messages=[{"role": "user", "content": "x"}], n=2,
                                 response_format=fmt), 1)
    assert line.request["n"] == 2 and line.request["response_format"] == fmt
    # When the worker's done event lists both choices
    done = Done(request_id="q", attempt=1, finish_reason="stop", text='{"a": 1}',
                usage=Usage(3, 9), timings=Timings(0.0, 0.1, 0.2, 0.05), choices=[
                    Choice(0, '{"a": 1}', "stop", 4), Choice(1, '{"b": 22}', "length", 5)])
    body = output_record(line, "q", done, "m")["response"]["body"]
    # Then the output body has both, by index
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] \
        == [(0, '{"a": 1}', "stop"), (1, '{"b": 22}', "length")]


@pytest.mark.parametrize("prompt, expected", [
    ("Once", {"prompt": "Once"}),
    (["Once"], {"prompt": "Once"}),
    ([1, 2, 3], {"prompt_token_ids": [1, 2, 3]}),
    ([[1, 2]], {"prompt_token_ids": [1, 2]}),
])
def test_a_completion_prompt_may_be_text_or_token_ids(prompt, expected) -> None:
    line = parse_line(batch_line("/v1/completions", prompt=prompt, max_tokens=4), 2)
    assert line.request == {"max_tokens": 4, **expected}


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
     "custom_id"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions",
                 "body": {"prompt": "x"}}), "POST"),
    (batch_line("/v1/embeddings", input="x"), "/v1/embeddings"),
    (batch_line("/v1/completions", messages=[]), "`messages` is not supported"),
    (batch_line("/v1/completions", max_tokens=3), "needs `prompt`"),
    (batch_line(messages=[{"role": "user", "content": "x"}], n=0), "$.n"),
    (batch_line(messages=[{"role": "user", "content": "x"}],
                response_format={"type": "yaml"}), "response_format"),
    (batch_line(messages=[{"role": "user", "content": "x"}], logprobs=True), "`logprobs`"),
    (batch_line(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "only text content"),
    (batch_line(messages=[{"role": "wizard", "content": "x"}]), "role"),
    (batch_line("/v1/completions", prompt="x", temperature=3), "temperature"),
    (batch_line("/v1/completions", prompt=["a", "b"]), "one prompt per line"),
])
def test_a_bad_line_says_why(text: str, reason: str) -> None:
    with pytest.raises(BatchLineError, match=None) as info:
        parse_line(text, 7)
    assert reason in str(info.value)
    # a line that is not a JSON object makes the file not JSONL: the batch fails on it
    not_an_object = reason in ("not JSON", "JSON object")
    assert info.value.code == ("invalid_json_line" if not_an_object else "invalid_request")


def test_the_custom_id_is_kept_when_the_rest_of_the_line_is_bad() -> None:
    with pytest.raises(BatchLineError) as info:
        parse_line(batch_line("/v1/completions", prompt="x", temperature=3), 1)
    assert info.value.custom_id == "r1"


DONE = Done(request_id="batch_ab.1", attempt=1, finish_reason="stop", text="Hello!",
            usage=Usage(prompt_tokens=5, completion_tokens=2, cached_prompt_tokens=4),
            timings=Timings(queue=0.0, ttft=0.1, e2e=0.2, per_token=0.1))


def test_a_chat_answer_is_a_chat_completion_object() -> None:
    line = parse_line(batch_line(messages=[{"role": "user", "content": "Hi"}]), 1)
    record = output_record(line, "batch_ab.1", DONE, "worker-model")
    assert record["id"] == "batch_req_ab.1" and record["custom_id"] == "r1"
    assert record["error"] is None
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"] == "batch_ab.1"
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "worker-model"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                                "finish_reason": "stop", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_a_completion_answer_is_a_text_completion_object() -> None:
    line = parse_line(batch_line("/v1/completions", model="m", prompt="Hi"), 1)
    body = output_record(line, "batch_ab.1", DONE, "worker-model")["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert body["choices"][0]["text"] == "Hello!"


def test_errors_have_openai_shapes() -> None:
    line = parse_line(batch_line(messages=[{"role": "user", "content": "Hi"}]), 1)
    too_long = Error(request_id="batch_ab.1", attempt=1, code="prompt_too_long", message="long")
    failed = failed_record(line, "batch_ab.1", too_long)
    assert failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["type"] == "invalid_request_error"
    crash = Error(request_id="batch_ab.1", attempt=1, code="engine_error", message="boom")
    assert failed_record(line, "batch_ab.1", crash)["response"]["status_code"] == 500
    invalid = error_record("batch_ab.3", 3, "r3", "invalid_request", "line 3: bad")
    assert invalid == {"id": "batch_req_ab.3", "custom_id": "r3", "response": None,
                       "error": {"code": "invalid_request", "message": "line 3: bad", "line": 3}}
