"""The OpenAI front door as a vLLM or OpenAI user meets it: errors that fail fast, every output
constraint over HTTP, tool calls. One valkey-server, one tiny-model `llmq worker` and one real
`llmq serve`; the model is random, so what is checked is what a constraint guarantees.
"""

from __future__ import annotations

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
