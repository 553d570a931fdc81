"""`response_format`, `guided` and `n` through a real server and a worker: what a producer sees.

The worker runs on a thread around the tiny random Llama; producers are plain redis-py."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from llmq import protocol
from tests.integration.worker_harness import (
    InProcessWorker,
    num_pending,
    read_events,
    terminal_events,
    wait_terminal,
    xadd_json,
)

pytestmark = pytest.mark.redis

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 10}}}


def test_json_schema_and_guided_requests_answer_in_their_shape(redis_server, redis_client,
                                                               tiny_model) -> None:
    # Given a worker, and requests in OpenAI's response_format shapes and vLLM-style guided ones
    bodies = {
        "schema": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "place", "schema": SCHEMA, "strict": True}}},
        "object": {"response_format": {"type": "json_object"}},
        "regex": {"guided": {"regex": "[A-Z]{3}-[0-9]{2}"}},
        "choice": {"guided": {"choice": ["red", "green", "blue"]}},
    }
    with InProcessWorker(redis_server.url, tiny_model):
        for name, body in bodies.items():
            xadd_json(redis_client, {"id": name, "prompt": "Answer:", "max_tokens": 200,
                                     "temperature": 1.0, "seed": 3, **body})
        done = {name: wait_terminal(redis_client, name) for name in bodies}
    # Then each `done` text has the asked-for shape
    assert all(isinstance(d, protocol.Done) and d.finish_reason == "stop" for d in done.values())
    jsonschema.validate(json.loads(done["schema"].text), SCHEMA)
    assert isinstance(json.loads(done["object"].text), dict)
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", done["regex"].text)
    assert done["choice"].text in ("red", "green", "blue")


@pytest.mark.parametrize(("body", "reason"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "integer", "minimum": 3, "maximum": 2}}}}, "minimum"),
    ({"guided": {"regex": "(unclosed"}}, "regex"),
    ({"guided": {"grammar": "start: missing_rule"}}, "missing_rule"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"n": 0}, "$.n"),
])
def test_a_constraint_that_cannot_compile_is_an_invalid_request_naming_it(
        redis_server, redis_client, tiny_model, body: dict[str, Any], reason: str) -> None:
    with InProcessWorker(redis_server.url, tiny_model):
        xadd_json(redis_client, {"id": "bad", "prompt": "Hi", **body})
        error = wait_terminal(redis_client, "bad")
    assert isinstance(error, protocol.Error) and error.code == "invalid_request"
    assert reason in error.message
    assert num_pending(redis_client) == 0


def test_n_completions_stream_with_their_index_and_one_done_lists_them_all(
        redis_server, redis_client, tiny_model) -> None:
    # Given a worker, and one request for three sampled completions of a 40-token prompt
    prompt = list(range(100, 140))
    with InProcessWorker(redis_server.url, tiny_model):
        xadd_json(redis_client, {"id": "three", "prompt_token_ids": prompt, "n": 3,
                                 "max_tokens": 12, "temperature": 1.0, "seed": 5,
                                 "ignore_eos": True})
        done = wait_terminal(redis_client, "three")
        # And the same request with seed 7, the seed completion 2 draws from
        xadd_json(redis_client, {"id": "alone", "prompt_token_ids": prompt, "max_tokens": 12,
                                 "temperature": 1.0, "seed": 7, "ignore_eos": True})
        alone = wait_terminal(redis_client, "alone")
    # Then exactly one terminal event lists the three choices, each as long as asked
    events = read_events(redis_client, "three")
    assert len(terminal_events(events)) == 1 and isinstance(done, protocol.Done)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.completion_tokens == 12 and c.finish_reason == "length" for c in done.choices)
    assert done.usage.prompt_tokens == 40 and done.usage.completion_tokens == 36
    assert done.text == done.choices[0].text
    # And each choice's deltas, told apart by index, add up to its text
    deltas = [e for e in events if isinstance(e, protocol.Delta)]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    for choice in done.choices:
        assert "".join(d.text for d in deltas if d.index == choice.index) == choice.text
    # And completion 2 is what seed 5 + 2 draws alone
    assert done.choices[2].text == alone.text
    assert num_pending(redis_client) == 0
