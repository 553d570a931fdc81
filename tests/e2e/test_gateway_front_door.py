"""The OpenAI front door as a vLLM or OpenAI user meets it: errors that fail fast, every output
constraint over HTTP, tool calls. One valkey-server, one tiny-model `llmq worker` and one real
`llmq serve`; the model is random, so what is checked is what a constraint guarantees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.gateway_harness import KEYS, GatewayProcess, gateway_pool

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}


@pytest.fixture(scope="module")
def pool(valkey_server, tiny_model_path: Path, tmp_path_factory) -> Iterator[GatewayProcess]:
    logs = tmp_path_factory.mktemp("gateway-front-door")
    # NOTE: a context of 2048, so the tool prompt of a template without tool support fits.
    with gateway_pool(valkey_server.url, tiny_model_path, logs, "gw-fd-w1", 2048) as gateway:
        yield gateway


# -- errors that fail fast ------------------------------------------------------------------------


def test_a_too_long_prompt_is_a_400_on_a_stream_too(pool: GatewayProcess, model: str) -> None:
    # Given a prompt longer than the model's context, asked for as a stream
    body = {"model": model, "prompt": "word " * 9000, "max_tokens": 4, "stream": True}
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


# -- tool calls -----------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


def valid_calls(calls) -> list:
    """Every call names an offered tool and its arguments validate against its schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def streamed_calls(stream) -> tuple[str, list, str]:
    """(content, tool calls, finish_reason) of a chat stream, its tool_calls deltas joined."""
    content, calls, finish = "", {}, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    objects = [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for _, c in sorted(calls.items())]
    return content, objects, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_agent_loop_calls_a_tool_reads_its_answer_and_answers(client: openai.OpenAI,
                                                                 model: str,
                                                                 stream: bool) -> None:
    messages: list = list(QUESTION)
    for seed in (1, 2, 3):
        # Given tools with required arguments, and the model required to call one
        kwargs = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 400,
                  "seed": seed, "tool_choice": "required"}
        if stream:
            content, calls, finish = streamed_calls(
                client.chat.completions.create(stream=True, **kwargs))
        else:
            message = (answer := client.chat.completions.create(**kwargs)).choices[0].message
            content, calls, finish = message.content, message.tool_calls, \
                answer.choices[0].finish_reason
        # Then it calls one, with arguments its schema accepts
        assert finish == "tool_calls" and not content
        valid_calls(calls)
    # When the call is answered with a tool message (the assistant turn's content null)
    messages += [{"role": "assistant", "content": None, "tool_calls": [c.model_dump()
                                                                       for c in calls]},
                 *[{"role": "tool", "tool_call_id": c.id, "content": "12 C, clear"}
                   for c in calls]]
    # Then with tool_choice auto the model answers: text, or calls that validate
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           max_tokens=12, tool_choice="auto")
    choice = final.choices[0]
    if choice.finish_reason == "tool_calls":
        valid_calls(choice.message.tool_calls)
    else:
        assert choice.message.content is not None and not choice.message.tool_calls


def test_a_named_tool_choice_calls_that_tool_alone(client: openai.OpenAI, model: str) -> None:
    for name, parallel in (("get_time", True), ("get_weather", False)):
        answer = client.chat.completions.create(
            model=model, messages=QUESTION, tools=TOOLS, max_tokens=400, seed=4,
            parallel_tool_calls=parallel,
            tool_choice={"type": "function", "function": {"name": name}})
        calls = valid_calls(answer.choices[0].message.tool_calls)
        assert [c.function.name for c in calls] == [name]
        assert answer.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_text(client: openai.OpenAI, model: str) -> None:
    answer = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                            max_tokens=6, tool_choice="none")
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")


# -- more endpoints -------------------------------------------------------------------------------


def test_models_retrieve_names_a_served_model_and_404s_others(client: openai.OpenAI,
                                                             model: str) -> None:
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"


def test_version_and_openapi_describe_the_server(pool: GatewayProcess) -> None:
    assert httpx.get(f"{pool.base_url}/version").json()["version"]
    spec = httpx.get(f"{pool.base_url}/openapi.json").json()
    assert spec["openapi"].startswith("3.") and "post" in spec["paths"]["/v1/responses"]
    assert "get" in spec["paths"]["/v1/models/{model_id}"]


def test_a_response_answers_text_and_continues_from_its_id(client: openai.OpenAI,
                                                           model: str) -> None:
    # Given a first response, then one continuing it by id
    first = client.responses.create(model=model, input="Tell me about the sea.",
                                    max_output_tokens=8, temperature=0,
                                    instructions="Be brief.")
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output_text and first.usage.output_tokens == 8
    second = client.responses.create(model=model, input="And the sky?", max_output_tokens=4,
                                     previous_response_id=first.id, temperature=0)
    # Then the second prompt held the first exchange: it is longer by the first's tokens
    assert second.usage.input_tokens > first.usage.input_tokens + 8
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    # And another tenant cannot continue it
    with pytest.raises(openai.NotFoundError):
        client.with_options(api_key=KEYS["bob"]).responses.create(
            model=model, input="Hi", previous_response_id=first.id)


def test_a_streamed_response_sends_typed_events_that_add_up(client: openai.OpenAI,
                                                            model: str) -> None:
    whole = client.responses.create(model=model, input="Go on.", max_output_tokens=8,
                                    temperature=0)
    events = list(client.responses.create(model=model, input="Go on.", max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_a_response_follows_a_json_schema_and_calls_tools(client: openai.OpenAI,
                                                          model: str) -> None:
    # A boolean, not an integer: a random model's integer can run past any max_output_tokens
    # (CI once saw 40 digits), so the answer would be cut, not wrong.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = client.responses.create(model=model, input="Yes or no?", max_output_tokens=40,
                                     text={"format": {"type": "json_schema", "name": "yes_no",
                                                      "schema": schema, "strict": True}})
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)
    tool = {"type": "function", "name": "get_time", "parameters": SCHEMAS["get_time"]}
    called = client.responses.create(model=model, input="Time?", tools=[tool],
                                     tool_choice="required", max_output_tokens=200)
    (call,) = [item for item in called.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_time"])
    # When the call's output is sent back, continuing the response
    after = client.responses.create(model=model, previous_response_id=called.id,
                                    input=[{"type": "function_call_output",
                                            "call_id": call.call_id, "output": "noon"}],
                                    max_output_tokens=4)
    assert after.status in ("completed", "incomplete")


def test_a_too_long_response_stream_is_a_400(pool: GatewayProcess, model: str) -> None:
    body = {"model": model, "input": "word " * 9000, "stream": True, "max_output_tokens": 4}
    response = httpx.post(f"{pool.base_url}/v1/responses", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_several_prompts_answer_as_one_with_choices_by_prompt(client: openai.OpenAI,
                                                              model: str) -> None:
    prompts = ["Once upon", "The sea", "Hello"]
    together = client.completions.create(model=model, prompt=prompts, max_tokens=4, n=2,
                                         temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}) for p in prompts]
    assert [c.index for c in together.choices] == list(range(6))
    assert [together.choices[2 * k].text for k in range(3)] == [a.choices[0].text
                                                                for a in alone]
    assert together.usage.completion_tokens == 24


# -- vLLM's extras --------------------------------------------------------------------------------


def test_continuous_usage_stats_count_tokens_on_every_chunk(client: openai.OpenAI,
                                                            model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, stream=True, temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts)
    assert counts[-1] == 6 and chunks[-1].usage.prompt_tokens == chunks[0].usage.prompt_tokens


def test_a_stop_string_stays_in_the_output_when_asked(client: openai.OpenAI,
                                                      model: str) -> None:
    free = client.completions.create(model=model, prompt="Go", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[3:5]
    assert stop.strip()
    kept = client.completions.create(model=model, prompt="Go", max_tokens=12, temperature=0,
                                     stop=[stop], extra_body={
                                         "ignore_eos": True,
                                         "include_stop_str_in_output": True}).choices[0].text
    assert kept.endswith(stop) and free.startswith(kept)


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(
        client: openai.OpenAI, model: str) -> None:
    opened, closed = (client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=1,
        extra_body={"add_generation_prompt": flag}).usage.prompt_tokens for flag in (True, False))
    assert closed < opened  # `<|im_start|>assistant\n` is not in the prompt


def test_echo_begins_each_completion_with_its_prompt(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "max_tokens": 5, "temperature": 0, "extra_body": {
        "ignore_eos": True}}
    plain = client.completions.create(prompt="Once upon", **kwargs).choices[0].text
    echoed = client.completions.create(prompt="Once upon", echo=True, **kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt="Once upon", echo=True, stream=True, **kwargs) if c.choices)
    assert echoed.choices[0].text == streamed == "Once upon" + plain
    several = client.completions.create(prompt=["A", "B"], echo=True, **kwargs)
    assert [c.text[:1] for c in several.choices] == ["A", "B"]


def test_a_streamed_response_sends_its_tool_calls_as_items(client: openai.OpenAI,
                                                            model: str) -> None:
    tool = {"type": "function", "name": "get_time", "parameters": SCHEMAS["get_time"]}
    events = list(client.responses.create(model=model, input="Time?", tools=[tool],
                                          tool_choice="required", max_output_tokens=200,
                                          stream=True))
    added = [e.item for e in events if e.type == "response.output_item.done"
             and e.item.type == "function_call"]
    final = events[-1].response
    assert added and [i.call_id for i in added] == [
        i.call_id for i in final.output if i.type == "function_call"]
    for item in added:
        jsonschema.validate(json.loads(item.arguments), SCHEMAS["get_time"])


def test_the_sdk_parses_a_response_into_its_model(client: openai.OpenAI, model: str) -> None:
    import pydantic

    class Count(pydantic.BaseModel):
        n: int
        unit: Literal["C", "F"]

    parsed = client.responses.parse(model=model, input="A count?", text_format=Count,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Count)
