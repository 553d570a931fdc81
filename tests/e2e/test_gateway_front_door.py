"""The OpenAI front door as a vLLM or OpenAI user meets it: errors that fail fast, every output
constraint over HTTP, tool calls. One valkey-server, one tiny-model `llmq worker` and one real
`llmq serve`; the model is random, so what is checked is what a constraint guarantees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cli_harness import serve
from tests.e2e.gateway_harness import KEYS, GatewayProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}


@pytest.fixture(scope="module")
def pool(valkey_server, tiny_model_path: Path, tmp_path_factory) -> Iterator[GatewayProcess]:
    logs = tmp_path_factory.mktemp("gateway-front-door")
    worker = serve(valkey_server.url, tiny_model_path, logs, "gw-fd-w1")
    gateway = GatewayProcess(valkey_server.url, logs)
    try:
        yield gateway.start()
    finally:
        gateway.stop()
        worker.stop()


@pytest.fixture(scope="module")
def client(pool: GatewayProcess) -> openai.OpenAI:
    return pool.openai()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# -- errors that fail fast ------------------------------------------------------------------------


def test_a_too_long_prompt_is_a_400_on_a_stream_too(pool: GatewayProcess, model: str) -> None:
    # Given a prompt longer than the model's context, asked for as a stream
    body = {"model": model, "prompt": "word " * 3000, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{pool.base_url}/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        response.read()
    # Then the HTTP status itself says so, before any event
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "prompt has" in error["message"]


def test_max_tokens_beyond_the_context_is_refused(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=30_000)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "max_tokens is 30000" in info.value.body["message"]


def test_a_stream_that_runs_answers_200_and_streams(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                                 stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_the_same_request_id_with_another_body_is_a_409(client: openai.OpenAI,
                                                        model: str) -> None:
    headers = {"X-Request-Id": "fd-conflict-1"}
    first = client.completions.create(model=model, prompt="One", max_tokens=3,
                                      extra_headers=headers)
    again = client.completions.create(model=model, prompt="One", max_tokens=3,
                                      extra_headers=headers)
    assert first.choices[0].text == again.choices[0].text
    with pytest.raises(openai.ConflictError) as info:
        client.completions.create(model=model, prompt="Two", max_tokens=3,
                                  extra_headers=headers)
    assert info.value.body["code"] == "request_id_conflict"
    assert info.value.body["param"] == "X-Request-Id"


# -- every constraint over HTTP -------------------------------------------------------------------

CONSTRAINED = {"max_tokens": 24, "temperature": 1.0}
REGEX = r"(yes|no), [0-9]{2,3}"
GRAMMAR = 'start: "say " WORD "!"\nWORD: /[a-z]{1,6}/'


@pytest.mark.parametrize(("extra", "matches"), [
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
     lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"grammar": GRAMMAR}},
     lambda t: re.fullmatch(r"say [a-z]{1,6}!", t)),
    ({"structured_outputs": {"json": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}},
     lambda t: isinstance(json.loads(t)["n"], int)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"say [a-z]{1,6}!", t)),
    ({"guided_json": '{"type": "array", "items": {"type": "boolean"}, "maxItems": 3}'},
     lambda t: all(isinstance(x, bool) for x in json.loads(t))),
    ({"guided": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"guided": {"regex": "[A-Z]{3}"}}, lambda t: re.fullmatch("[A-Z]{3}", t)),
], ids=["so-regex", "so-choice", "so-grammar", "so-json", "guided_regex", "guided_choice",
        "guided_grammar", "guided_json", "guided-choice", "guided-regex"])
def test_every_constraint_holds_over_http(client: openai.OpenAI, model: str,
                                          extra: dict, matches) -> None:
    # Given a constraint in each of the spellings vLLM and llmq accept, on both endpoints
    for seed in (1, 2, 3):
        chat = client.chat.completions.create(model=model, messages=MESSAGES, seed=seed,
                                              extra_body=extra, **CONSTRAINED)
        text = client.completions.create(model=model, prompt="Answer:", seed=seed,
                                         extra_body=extra, **CONSTRAINED)
        # Then every output matches it
        for output in (chat.choices[0].message.content, text.choices[0].text):
            assert matches(output), (extra, output)


def test_a_streamed_constrained_answer_matches_too(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, stream=True, extra_body={
            "structured_outputs": {"regex": REGEX}}, **CONSTRAINED)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(REGEX, text)


def test_two_constraints_at_once_are_a_400_naming_them(client: openai.OpenAI,
                                                       model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="both constrain") as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                       response_format={"type": "json_object"},
                                       extra_body={"guided_regex": "a+"})
    assert info.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError, match="cannot|regex|invalid") as bad:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                       extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert bad.value.status_code == 400
