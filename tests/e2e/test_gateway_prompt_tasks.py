"""Embeddings, /tokenize, /detokenize, and vLLM's logits and prompt extras over HTTP, as a vLLM
or OpenAI user meets them: the official SDK where it has the call, vLLM's shapes otherwise. One
valkey-server, one tiny-model `llmq worker` and one real `llmq serve`; the model is random, so
what is checked is what each option guarantees.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from llmq.broker.keys import Keys
from llmq.broker.work_lanes import work_lane
from tests.e2e.gateway_harness import KEYS, GatewayProcess, gateway_pool

pytestmark = [pytest.mark.redis, pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}
TWO_TURNS = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def pool(valkey_server, tiny_model_path: Path, tmp_path_factory) -> Iterator[GatewayProcess]:
    logs = tmp_path_factory.mktemp("gateway-prompt-tasks")
    with gateway_pool(valkey_server.url, tiny_model_path, logs, "gw-pt-w1", 1024) as gateway:
        yield gateway


def post(pool: GatewayProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{pool.base_url}{path}", json=body, headers=AUTH, timeout=60)


def detokenized(pool: GatewayProcess, tokens: list[int]) -> str:
    response = post(pool, "/detokenize", {"tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


# -- embeddings -----------------------------------------------------------------------------------


def test_embeddings_with_the_sdk_are_unit_vectors_one_per_input(client: openai.OpenAI,
                                                                model: str) -> None:
    # Given two different sentences and a repeat of the first (the SDK asks for base64)
    result = client.embeddings.create(model=model, input=["The sea is calm.", "Stocks fell.",
                                                          "The sea is calm."])
    # Then there is one unit vector per input, in order, the repeat equal to the first
    vectors = [item.embedding for item in result.data]
    assert [item.index for item in result.data] == [0, 1, 2]
    assert len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 8
    for vector in vectors:
        assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, rel_tol=1e-4)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-6)
    assert vectors[0] != pytest.approx(vectors[1], abs=1e-3)
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    assert result.model == model


def test_float_and_base64_encodings_carry_the_same_vector(client: openai.OpenAI,
                                                          model: str) -> None:
    as_floats = client.embeddings.create(model=model, input="Waves",
                                         encoding_format="float").data[0].embedding
    as_base64 = client.embeddings.create(model=model, input="Waves").data[0].embedding
    assert as_base64 == pytest.approx(as_floats, abs=1e-6)  # float32 on the wire


def test_token_id_inputs_embed_like_their_text(pool: GatewayProcess, client: openai.OpenAI,
                                               model: str) -> None:
    ids = post(pool, "/tokenize", {"prompt": "Waves"}).json()["tokens"]
    by_ids = client.embeddings.create(model=model, input=ids,
                                      encoding_format="float").data[0].embedding
    by_text = client.embeddings.create(model=model, input="Waves",
                                       encoding_format="float").data[0].embedding
    assert by_ids == pytest.approx(by_text, abs=1e-6)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "Hi", "dimensions": 8}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": ["Hi", ""]}, "input"),
])
def test_bad_embeddings_bodies_are_400s_naming_the_field(pool: GatewayProcess, body: dict,
                                                         param: str) -> None:
    response = post(pool, "/v1/embeddings", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# -- tokenize / detokenize ------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(pool: GatewayProcess) -> None:
    tokenized = post(pool, "/tokenize", {"prompt": "The sea is calm", "add_special_tokens": False,
                                         "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
    assert body["max_model_len"] == 1024
    assert detokenized(pool, body["tokens"]) == "The sea is calm"
    without_strs = post(pool, "/tokenize", {"prompt": "The sea is calm"}).json()
    assert without_strs["token_strs"] is None


def test_tokenize_renders_chat_messages_as_a_completion_would(pool: GatewayProcess,
                                                              client: openai.OpenAI,
                                                              model: str) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    counted = post(pool, "/tokenize", {"messages": messages}).json()["count"]
    usage = client.chat.completions.create(model=model, messages=messages, max_tokens=1).usage
    assert counted == usage.prompt_tokens


def test_detokenize_refuses_ids_outside_the_vocabulary(pool: GatewayProcess) -> None:
    response = post(pool, "/detokenize", {"tokens": [5, 10**6]})
    assert response.status_code == 400
    assert "outside the vocabulary" in response.json()["error"]["message"]


# -- logit_bias, allowed_token_ids, bad_words -----------------------------------------------------


def test_logit_bias_with_the_sdk_forces_a_token(pool: GatewayProcess, client: openai.OpenAI,
                                                model: str) -> None:
    text = client.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=0,
                                     logit_bias={"321": 100}, extra_body={"ignore_eos": True}
                                     ).choices[0].text
    assert text == detokenized(pool, [321] * 4)


def test_allowed_token_ids_and_bad_words_hold_over_http(pool: GatewayProcess,
                                                        client: openai.OpenAI, model: str) -> None:
    # Given two allowed tokens, 481 ("hello") and 100 ("a"), and "hello" a bad word
    text = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=1,
        seed=2, extra_body={"ignore_eos": True, "allowed_token_ids": [481, 100],
                            "bad_words": ["hello"]}).choices[0].message.content
    # Then only the other one is ever written
    assert text == detokenized(pool, [100] * 6)


@pytest.mark.parametrize(("extra", "says"), [
    ({"logit_bias": {"321": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias: token id 1000000"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1000000]}, "allowed_token_ids"),
])
def test_bad_logits_options_are_400s_naming_the_field(client: openai.OpenAI, model: str,
                                                      extra: dict, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body=extra)
    assert says in info.value.body["message"]


# -- prompt_logprobs ------------------------------------------------------------------------------


def test_prompt_logprobs_in_vllms_shape(pool: GatewayProcess) -> None:
    # Given a completion asking for its prompt's logprobs with the top 2
    response = post(pool, "/v1/completions", {"prompt": "The sea is calm", "max_tokens": 2,
                                              "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    found = body["choices"][0]["prompt_logprobs"]
    # Then each prompt token but the first has its own logprob and rank, and the top 2
    assert len(found) == body["usage"]["prompt_tokens"] and found[0] is None
    tokens = post(pool, "/tokenize", {"prompt": "The sea is calm"}).json()["tokens"]
    for position, entry in enumerate(found[1:], 1):
        own = entry[str(tokens[position])]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and own["decoded_token"] is not None
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]
    # And a chat completion carries them at the top level, as vLLM's does
    chat = post(pool, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                               "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_prompt_logprobs_are_refused_on_a_stream(pool: GatewayProcess) -> None:
    response = post(pool, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True,
                                              "prompt_logprobs": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"


# -- echo with logprobs (lm-eval's loglikelihood requests) ---------------------------------------


def test_echo_with_logprobs_puts_the_prompts_tokens_first(pool: GatewayProcess,
                                                          client: openai.OpenAI,
                                                          model: str) -> None:
    prompt = "The sea is calm"
    ids = post(pool, "/tokenize", {"prompt": prompt}).json()["tokens"]
    scored = post(pool, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                            "prompt_logprobs": 2}).json()["choices"][0]
    # When a completion echoes its prompt with logprobs (the SDK's legacy call)
    kwargs: dict[str, Any] = dict(model=model, prompt=prompt, max_tokens=3, temperature=0.0,
                                  logprobs=2)
    echoed = client.completions.create(echo=True, **kwargs)
    plain = client.completions.create(**kwargs).choices[0]
    choice = echoed.choices[0]
    logprobs = choice.logprobs
    # Then the text is the prompt and the completion, and the logprobs cover both, the
    # prompt's first: its first token null, each other the prompt logprob of that token
    assert choice.text == prompt + plain.text
    p = len(ids)
    assert echoed.usage.prompt_tokens == p
    assert len(logprobs.tokens) == p + echoed.usage.completion_tokens
    assert "".join(logprobs.tokens[:p]) == prompt
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, p):
        expected = scored["prompt_logprobs"][position][str(ids[position])]["logprob"]
        assert logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-4)
        top = logprobs.top_logprobs[position]
        assert logprobs.tokens[position] in top and len(top) >= 2
        assert max(top.values()) >= logprobs.token_logprobs[position]
    assert logprobs.text_offset[:p] == [len("".join(logprobs.tokens[:i])) for i in range(p)]
    # And the completion's part is what the same request without echo answers, after the prompt
    assert logprobs.token_logprobs[p:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert logprobs.text_offset[p:] == [len(prompt) + o for o in plain.logprobs.text_offset]
    assert "prompt_logprobs" not in (choice.model_extra or {})


def test_echo_with_max_tokens_0_answers_the_prompt_alone(client: openai.OpenAI,
                                                         model: str) -> None:
    whole = client.completions.create(model=model, prompt="The sea is calm", echo=True,
                                      logprobs=1, max_tokens=0)
    choice = whole.choices[0]
    assert choice.text == "The sea is calm" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == whole.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])


def test_token_id_prompts_echo_as_lm_eval_asks(pool: GatewayProcess, client: openai.OpenAI,
                                               model: str) -> None:
    # Given two token-id prompts, as lm-eval's local-completions sends its loglikelihood batches
    prompts = [post(pool, "/tokenize", {"prompt": text}).json()["tokens"]
               for text in ("The sea is calm", "Stocks fell today")]
    whole = client.completions.create(model=model, prompt=prompts, echo=True, logprobs=1,
                                      max_tokens=1, temperature=0.0)
    # Then each choice's text begins with its prompt's text, and its logprobs give every prompt
    # token's (the first null) then the one generated token's
    for choice, ids in zip(sorted(whole.choices, key=lambda c: c.index), prompts, strict=True):
        text = detokenized(pool, ids)
        assert choice.text.startswith(text)
        assert len(choice.logprobs.tokens) == len(ids) + 1
        assert "".join(choice.logprobs.tokens[:len(ids)]) == text
        assert choice.logprobs.token_logprobs[0] is None
        assert all(v <= 0 for v in choice.logprobs.token_logprobs[1:])


def test_echo_with_logprobs_is_refused_on_a_stream(pool: GatewayProcess) -> None:
    response = post(pool, "/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 1,
                                              "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


def test_chat_takes_vllms_add_special_tokens_false(pool: GatewayProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert post(pool, "/v1/chat/completions", {**body, "add_special_tokens": False}
                ).status_code == 200
    refused = post(pool, "/v1/chat/completions", {**body, "add_special_tokens": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "add_special_tokens"


# -- continue_final_message -----------------------------------------------------------------------


def test_continue_final_message_continues_the_last_turn(pool: GatewayProcess,
                                                        client: openai.OpenAI,
                                                        model: str) -> None:
    # Given a conversation ending in a partial assistant answer
    options = {"add_generation_prompt": False, "continue_final_message": True}
    # Then its prompt ends with the answer's text, and a completion continues from there
    tokens = post(pool, "/tokenize", {"messages": TWO_TURNS, **options}).json()["tokens"]
    assert detokenized(pool, tokens).endswith("The colour is")
    answer = client.chat.completions.create(model=model, messages=TWO_TURNS, max_tokens=3,
                                            extra_body=options)
    assert answer.usage.prompt_tokens == len(tokens)
    # And asking to continue while opening a new turn is refused, as vLLM refuses it
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=TWO_TURNS, max_tokens=3,
                                       extra_body={"continue_final_message": True})
    assert "continue_final_message" in info.value.body["message"]


# -- speculative ----------------------------------------------------------------------------------


def test_the_speculative_opt_out_reaches_the_worker(valkey_server, pool: GatewayProcess) -> None:
    # Given a completion that opts out of speculative decoding
    response = post(pool, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                              "speculative": False})
    assert response.status_code == 200, response.text
    # Then the request the gateway queued (on alice's interactive lane) carries the opt-out
    lane = work_lane(Keys(), "default", "interactive", "alice")
    r = redis.Redis.from_url(valkey_server.url)
    try:
        queued = [json.loads(fields[b"json"]) for _, fields in
                  r.xrevrange(lane.stream, count=50)]
    finally:
        r.close()
    mine = [q for q in queued if q.get("id") == f"alice:{response.headers['x-request-id']}"]
    assert mine and mine[0]["speculative"] is False
    # And a value of the wrong type is a 400 naming it
    bad = post(pool, "/v1/completions", {"prompt": "Hi", "speculative": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"


def test_a_conversation_embeds_like_its_rendered_prompt(pool: GatewayProcess) -> None:
    # Given a conversation, and the ids its chat template renders (no assistant turn opened)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    ids = post(pool, "/tokenize", {"messages": messages,
                                   "add_generation_prompt": False}).json()["tokens"]
    # When it is embedded as messages (vLLM's chat embeddings) and as those ids
    by_messages = post(pool, "/v1/embeddings", {"messages": messages})
    by_ids = post(pool, "/v1/embeddings", {"input": ids})
    # Then the vectors are the same
    assert by_messages.status_code == 200, by_messages.text
    assert by_messages.json()["usage"]["prompt_tokens"] == len(ids)
    assert by_messages.json()["data"][0]["embedding"] == pytest.approx(
        by_ids.json()["data"][0]["embedding"], abs=1e-6)
