"""`llmq serve` through the official `openai` SDK (sync and async): what an OpenAI user sees.

One valkey-server, one tiny-model `llmq worker` and one real `llmq serve` process serve the
module; the model is random, so answers are compared with each other, never with fixed text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pydantic
import pytest
import redis

from llmq.broker.keys import Keys
from tests.e2e.cli_harness import serve
from tests.e2e.gateway_harness import KEYS, GatewayProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def pool(valkey_server, tiny_model_path: Path, tmp_path_factory) -> Iterator[GatewayProcess]:
    logs = tmp_path_factory.mktemp("gateway-api")
    worker = serve(valkey_server.url, tiny_model_path, logs, "gw-api-w1")
    gateway = GatewayProcess(valkey_server.url, logs, extra=["--max-queue", "3"])
    try:
        yield gateway.start()
    finally:
        gateway.stop()
        worker.stop()


def test_models_lists_what_live_workers_serve(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama.gguf"]
    assert models[0].owned_by == "llmq" and models[0].created > 0


def test_a_chat_answer_has_openai_usage_finish_reason_and_the_request_id(
        client: openai.OpenAI, model: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0,
        extra_headers={"X-Request-Id": "chat-1"})
    answer = raw.parse()
    assert raw.headers["x-request-id"] == "chat-1" and answer.id == "chatcmpl-chat-1"
    assert answer.object == "chat.completion" and answer.model == model
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = answer.usage
    assert usage.completion_tokens <= 6 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_a_streamed_chat_equals_the_whole_answer_and_ends_with_usage(
        client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_stream_and_not(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 5
    streamed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_a_stop_string_ends_the_answer_before_it(client: openai.OpenAI, model: str) -> None:
    # Given the greedy answer without a stop string
    text = client.completions.create(model=model, prompt="The sea", max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True}
                                     ).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    # When a piece of it is a stop string
    stopped = client.completions.create(model=model, prompt="The sea", max_tokens=16,
                                        temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    # Then the answer ends just before its first occurrence, finish_reason stop
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]


def test_the_same_seed_samples_the_same_answer(client: openai.OpenAI, model: str) -> None:
    answers = {client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=1234,
        extra_body={"ignore_eos": True}).choices[0].message.content for _ in range(2)}
    assert len(answers) == 1


def test_logprobs_come_per_token_with_alternatives(client: openai.OpenAI, model: str) -> None:
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 5
    # Each token has its own text and bytes, which add up to the answer (a random model's
    # bytes need not be UTF-8: decoded as the worker decodes them)
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == \
        answer.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    # And the alternatives are named too: greedy, the first is the token itself
    assert all(t.top_logprobs[0].token == t.token and t.top_logprobs[0].bytes == t.bytes
               for t in content)
    assert not any(a.token.startswith("token_id:") for t in content for a in t.top_logprobs)
    streamed = client.completions.create(model=model, prompt="Hi", max_tokens=3, logprobs=1,
                                         stream=True, temperature=0,
                                         extra_body={"ignore_eos": True})
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens
                                            if c.choices[0].logprobs else [])]
    assert len(tokens) == 3


def test_the_async_sdk_streams_and_answers(pool: GatewayProcess, model: str) -> None:
    async def scenario() -> tuple[str, str]:
        async with pool.async_openai() as client:
            whole = await client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
            stream = await client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            text = "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
            return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(scenario())
    assert whole == streamed and whole


def test_a_retried_post_with_the_same_request_id_runs_once(
        client: openai.OpenAI, model: str, valkey_server) -> None:
    answers = [client.completions.create(
        model=model, prompt="Retry me", max_tokens=4, temperature=1.0,
        extra_headers={"X-Request-Id": "retried-1"}).choices[0].text for _ in range(2)]
    r = redis.Redis.from_url(valkey_server.url)
    starts = [f for _, f in r.xrange(Keys().result("alice:retried-1")) if b'"start"' in f[b"json"]]
    r.close()
    assert answers[0] == answers[1] and len(starts) == 1


# -- several completions, structured output ----------------------------------------------------


def test_n_completions_are_choices_each_sampled_with_its_own_seed(
        client: openai.OpenAI, model: str) -> None:
    # Given one chat request for three sampled completions, seed 40
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                            temperature=1.0, seed=40, n=3,
                                            extra_body={"ignore_eos": True})
    # Then it has choices 0..2, choice i being what seed 40 + i samples alone
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        alone = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                               temperature=1.0, seed=40 + choice.index,
                                               extra_body={"ignore_eos": True})
        assert choice.message.content == alone.choices[0].message.content
        assert choice.finish_reason == "length"
    assert len({c.message.content for c in answer.choices}) > 1
    # And the usage counts the prompt once and every completion's tokens
    assert answer.usage.completion_tokens == 3 * 8
    assert answer.usage.prompt_tokens == alone.usage.prompt_tokens


def test_a_stream_of_n_completions_carries_each_choice_by_index(
        client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6,
                                      temperature=1.0, seed=9, n=2,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=9, n=2,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 2 * 6


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=99_999)
    coastal: bool


def test_a_json_schema_response_format_is_followed_and_parses(client: openai.OpenAI,
                                                              model: str) -> None:
    # Given the SDK's structured-output helper with a pydantic model (a strict json_schema)
    answers = [client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=City, max_tokens=80, temperature=1.0,
        seed=seed, n=2) for seed in (1, 2)]
    # Then every choice parsed into the model: its JSON validated against the schema
    parsed = [c.message.parsed for a in answers for c in a.choices]
    assert len(parsed) == 4 and all(isinstance(p, City) for p in parsed)
    assert all(c.finish_reason == "stop" for a in answers for c in a.choices)


def test_a_json_object_response_format_answers_json_objects(client: openai.OpenAI,
                                                            model: str) -> None:
    # Given four sampled completions constrained to a JSON object (the random tiny model writes
    # long keys, so some run into max_tokens: those are cut prefixes, reported as `length`)
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=160,
                                            temperature=1.0, seed=1, n=4,
                                            response_format={"type": "json_object"})
    # Then every completion that ended by itself is a JSON object
    stopped = [c for c in answer.choices if c.finish_reason == "stop"]
    assert stopped and all(c.finish_reason in ("stop", "length") for c in answer.choices)
    assert all(isinstance(json.loads(c.message.content), dict) for c in stopped)


def test_a_schema_that_cannot_compile_is_a_400_saying_why(client: openai.OpenAI,
                                                          model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}
    with pytest.raises(openai.BadRequestError, match="minimum") as info:
        client.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt)
    assert info.value.body["code"] == "invalid_request"


# -- errors ---------------------------------------------------------------------------------------


def test_an_invalid_body_is_a_400_naming_the_field(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=5)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == "temperature"
    assert error["type"] == "invalid_request_error" and "2.0" in error["message"]
    with pytest.raises(openai.BadRequestError, match=">= 1") as bad_n:
        client.chat.completions.create(model=model, messages=MESSAGES, n=0)
    assert bad_n.value.body["param"] == "n"


def test_a_field_llmq_does_not_know_or_cannot_honour_is_a_400_naming_it(
        client: openai.OpenAI, model: str) -> None:
    # Given a misspelt vLLM field, deprecated functions, and a message without a role
    bodies = [({"messages": MESSAGES, "extra_body": {"top_kk": 4}}, "top_kk", "not supported"),
              ({"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions",
               "not supported"),
              ({"messages": [{"content": "Hi"}]}, "messages[0].role", "`role`")]
    for kwargs, param, words in bodies:
        # Then each is refused before it is queued, naming the field
        with pytest.raises(openai.BadRequestError, match=words) as info:
            client.chat.completions.create(model=model, max_tokens=4, **kwargs)
        assert info.value.body["param"] == param
        assert info.value.body["type"] == "invalid_request_error"


def test_text_content_parts_are_one_message(client: openai.OpenAI, model: str) -> None:
    # Given the question as two text parts, as multimodal clients send it
    parts = [{"type": "text", "text": "Tell me about "}, {"type": "text", "text": "the sea."}]
    answers = [client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].message.content
        for messages in ([{"role": "user", "content": parts}], MESSAGES)]
    # Then the answer is the one to the question as one string
    assert answers[0] == answers[1] and answers[0]


def test_a_body_that_is_not_json_is_a_400(pool: GatewayProcess) -> None:
    response = httpx.post(f"{pool.base_url}/v1/completions", content=b"{nope",
                          headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.headers["x-request-id"]


def test_a_missing_or_wrong_key_is_a_401_on_every_route_but_health_and_metrics(pool: GatewayProcess,
                                                                   model: str) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        pool.openai().with_options(api_key="sk-wrong").models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/batches"), ("GET", "/v1/files"),
                         ("GET", "/v1/chat/completions/x/stream")):
        assert httpx.request(method, pool.base_url + path, json={}).status_code == 401, path
    assert httpx.get(pool.base_url + "/health").status_code == 200
    # Prometheus scrapes without a key unless the gateway is told to ask for one
    assert httpx.get(pool.base_url + "/metrics").status_code == 200


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found" and "tiny-llama.gguf" in str(
        info.value)
    # the same rule on every endpoint: completions and responses refuse it too, naming it
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "`gpt-9`" in str(info.value)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="gpt-9", input="Hi", max_output_tokens=2)
    assert info.value.body["param"] == "model" and "`gpt-9`" in str(info.value)
    # and what /v1/models lists is found whatever its case, there and on every endpoint
    assert client.models.retrieve("TINY-LLAMA.GGUF").id == "tiny-llama.gguf"
    assert client.completions.create(model="TINY-LLAMA.GGUF", prompt="Hi",
                                     max_tokens=2).choices


def test_a_full_queue_is_a_429_with_retry_after(client: openai.OpenAI,
                                                valkey_server) -> None:
    # Given a queue whose (stand-in) worker reads nothing, holding more than --max-queue (3)
    r = redis.Redis.from_url(valkey_server.url)
    keys = Keys()
    r.hset(keys.worker("idle-w"), mapping={"worker_id": "idle-w", "queue": "stuck",
                                           "model": "idle-model",
                                           "heartbeat_ms": int(time.time() * 1000)})
    r.expire(keys.worker("idle-w"), 30)
    r.zadd(keys.workers(), {"idle-w": int(time.time() * 1000)})
    for i in range(5):
        r.xadd(keys.queue("stuck"), {"json": json.dumps({"prompt": f"p{i}"})})
    try:
        time.sleep(1.1)  # the gateway's view of the workers is at most a second old
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="idle-model", prompt="x", max_tokens=2)
        assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
        assert int(info.value.response.headers["retry-after"]) > 0
    finally:
        r.delete(keys.worker("idle-w"), keys.queue("stuck"))
        r.zrem(keys.workers(), "idle-w")
        r.close()


def test_no_live_worker_is_a_503(valkey_server, tmp_path: Path) -> None:
    # Given a gateway on a prefix no worker serves
    gateway = GatewayProcess(valkey_server.url, tmp_path, extra=["--prefix", "empty"]).start()
    try:
        with pytest.raises(openai.InternalServerError) as info:
            gateway.openai().chat.completions.create(model="tiny-llama.gguf",
                                                     messages=MESSAGES)
        assert info.value.status_code == 503 and info.value.body["code"] == "no_workers"
        assert gateway.openai().models.list().data == []
    finally:
        gateway.stop()


def test_metrics_count_requests_by_route_and_status(pool: GatewayProcess) -> None:
    text = httpx.get(f"{pool.base_url}/metrics").text
    assert 'llmq_gateway_requests_total{method="POST",route="/v1/chat/completions",status="200"}' \
        in text
    assert 'status="400"' in text and "llmq_gateway_open_streams" in text
    assert "process_cpu_seconds_total" in text
    assert float(sample(text, "llmq_gateway_errors_total", status_class="4xx")) >= 1


def sample(text: str, name: str, **labels: str) -> str:
    """The value of the one series `name{labels...}` of a scrape (labels in any order)."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0] != name:
            continue
        found = dict(p.split("=", 1) for p in series.partition("{")[2].rstrip("}").split(",")
                     if "=" in p)
        if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            return value
    raise AssertionError(f"no {name}{labels} in the scrape")


def test_metrics_hold_every_workers_engine_figures_and_the_queues(pool: GatewayProcess,
                                                                  client: openai.OpenAI,
                                                                  model: str) -> None:
    # Given a request the worker finished (its heartbeat carries it within a renewal)
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(f"{pool.base_url}/metrics").text
        worker = {"worker": "gw-api-w1", "queue": "default", "model": model}
        try:
            if float(sample(text, "llmq_time_to_first_token_seconds_count", **worker)) > 0:
                break
        except AssertionError:
            pass
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.5)
    # Then the pool's series carry vLLM's meanings, labelled by queue, worker and model
    assert float(sample(text, "llmq_generation_tokens_total", **worker)) >= 8
    assert float(sample(text, "llmq_prompt_tokens_total", **worker)) > 0
    assert float(sample(text, "llmq_inter_token_latency_seconds_count", **worker)) > 0
    assert float(sample(text, "llmq_request_queue_time_seconds_sum", **worker)) >= 0
    assert float(sample(text, "llmq_e2e_request_latency_seconds_bucket", le="+Inf",
                        **worker)) > 0
    assert 0 <= float(sample(text, "llmq_kv_cache_usage_ratio", **worker)) <= 1
    assert float(sample(text, "llmq_requests_total", finish_reason="length", **worker)) >= 1
    assert sample(text, "llmq_num_requests_running", **worker)
    # And every queue's depth, lag, pending entries and dead letters
    for name in ("llmq_queue_length", "llmq_queue_lag", "llmq_queue_pending",
                 "llmq_queue_dead_letters"):
        assert float(sample(text, name, queue="default")) >= 0
    assert float(sample(text, "llmq_queue_workers", queue="default")) == 1


def test_metrics_can_require_a_key(valkey_server, tmp_path: Path) -> None:
    gateway = GatewayProcess(valkey_server.url, tmp_path, extra=["--metrics-require-key"]).start()
    try:
        assert httpx.get(gateway.base_url + "/metrics").status_code == 401
        assert httpx.get(gateway.base_url + "/metrics", headers={
            "Authorization": f"Bearer {KEYS['alice']}"}).status_code == 200
    finally:
        gateway.stop()


def test_the_readme_snippet_streams_an_answer(pool: GatewayProcess, capsys) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## The OpenAI API", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    snippet = snippet.replace("http://127.0.0.1:8000/v1", f"{pool.base_url}/v1")
    exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 - the README's own code
    assert capsys.readouterr().out.strip()
