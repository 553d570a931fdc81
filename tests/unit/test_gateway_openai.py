"""The gateway's OpenAI request translation without IO: bodies in, checked, API keys."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from llmq.gateway.api_keys import ApiKeys
from llmq.gateway.openai_request import CHAT, COMPLETIONS, BodyError, decode_body, parse_body

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# -- bodies ---------------------------------------------------------------------------------------


def test_a_chat_body_becomes_an_llmq_request_with_user_and_metadata() -> None:
    parsed = parse_body(CHAT, {
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 5,
        "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1, "seed": 7, "stop": ["\n"],
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.1,
        "logprobs": True, "top_logprobs": 3, "n": 1, "user": "u1", "metadata": {"k": "v"},
        "stream": True, "stream_options": {"include_usage": True},
        "response_format": {"type": "text"}, "store": False})
    assert parsed.request == {
        "model": "m", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
        "min_p": 0.1, "seed": 7, "stop": ["\n"], "presence_penalty": 0.1,
        "frequency_penalty": 0.2, "repetition_penalty": 1.1, "logprobs": 3,
        "metadata": {"user": "u1", "metadata": {"k": "v"}},
        "messages": [{"role": "user", "content": "Hi"}]}
    assert (parsed.stream, parsed.include_usage, parsed.logprobs) == (True, True, 3)


def test_n_and_a_response_format_pass_through_to_the_request() -> None:
    # Given a body asking for three completions in a JSON schema
    fmt = {"type": "json_schema",
           "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True}}
    parsed = parse_body(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "n": 3, "response_format": fmt})
    # Then the llmq request carries both as they are, and the response will have 3 choices
    assert parsed.request["n"] == 3 and parsed.request["response_format"] == fmt
    assert parsed.n == 3


def test_completions_logprobs_are_a_count() -> None:
    parsed = parse_body(COMPLETIONS, {"model": "m", "prompt": "Once", "logprobs": 2})
    assert parsed.request["logprobs"] == 2 and parsed.request["prompt"] == "Once"


@pytest.mark.parametrize("endpoint, body, param, words", [
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n", ">= 1"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9},
     "temperature", "temperature"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function"}]}, "tools[0]", "`function`"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "tools": [{"type": "function"}]}, "tools",
     "only for /v1/chat/completions"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "tool_choice": "required"}, "tool_choice", "needs `tools`"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among `tools`"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
            "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "give one"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": None}]}, "messages[0]",
     "needs `content`"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "logprobs: true"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temprature": 1},
     "temprature", "not supported"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    (CHAT, {"model": "m"}, "messages", "needs `messages`"),
    (COMPLETIONS, {"model": "m", "prompt": ["a", "b"], "stream": True}, "prompt",
     "one request per prompt"),
    (COMPLETIONS, {"model": "m", "prompt": ["a", [5]]}, "prompt", "a list of either"),
    (COMPLETIONS, {"model": "m", "prompt": [5, 6], "echo": True, "stream": True}, "echo",
     "not available when `stream` is true"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "echo": True, "logprobs": 1, "stream": True},
     "echo", "not available when `stream` is true"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "add_special_tokens": True}, "add_special_tokens", "not supported for chat"),
    # API keys are untrusted callers: their special-token text always stays text
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "allow_special_tokens": True}, "allow_special_tokens", "not supported"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    (COMPLETIONS, {"model": "m", "prompt": [5, -1]}, "prompt", ">= 0"),
    (CHAT, {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", "`role`"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "only text content parts"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
     "stream", "`bool"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "<= 20"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "top_logprobs": 2}, "top_logprobs",
     "not supported for /v1/completions"),
    (COMPLETIONS, [{"model": "m", "prompt": "x"}], None, "must be a JSON object"),
])
def test_a_body_llmq_cannot_run_names_the_field(endpoint, body, param, words) -> None:
    # Given a body as a batch line holds it (parsed) and as an HTTP request sends it (bytes)
    for parse in (lambda: parse_body(endpoint, body),
                  lambda: decode_body(endpoint, msgspec.json.encode(body))):
        # Then both are refused the same way, naming the field at fault
        with pytest.raises(BodyError) as info:
            parse()
        assert info.value.param == param and words in str(info.value)


INTEGER_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "response", "schema": {"type": "integer"}}}}


@pytest.mark.parametrize("extra, wire", [
    ({"structured_outputs": {"regex": "a+"}}, {"guided": {"regex": "a+"}}),
    ({"structured_outputs": {"choice": ["x", "y"]}}, {"guided": {"choice": ["x", "y"]}}),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, {"guided": {"grammar": "start: \"a\""}}),
    ({"structured_outputs": {"json": {"type": "integer"}}}, INTEGER_SCHEMA),
    ({"structured_outputs": {"json_object": True}}, {"response_format": {"type": "json_object"}}),
    ({"guided_json": '{"type": "integer"}'}, INTEGER_SCHEMA),
    ({"guided_regex": "a+"}, {"guided": {"regex": "a+"}}),
    ({"guided_choice": ["x"]}, {"guided": {"choice": ["x"]}}),
    ({"guided_grammar": "g"}, {"guided": {"grammar": "g"}}),
    ({"guided": {"regex": "a+"}}, {"guided": {"regex": "a+"}}),
])
def test_every_spelling_of_a_constraint_becomes_the_wire_s(extra, wire) -> None:
    for endpoint, body in ((CHAT, {"messages": [{"role": "user", "content": "x"}]}),
                           (COMPLETIONS, {"prompt": "x"})):
        parsed = parse_body(endpoint, {**body, **extra})
        assert {k: parsed.request[k] for k in wire} == wire


@pytest.mark.parametrize("extra, param, words", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "both constrain"),
    ({"response_format": {"type": "json_object"}, "guided": {"regex": "a"}}, "guided",
     "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown field"),
    ({"guided_json": "{nope"}, "guided_json", "not JSON"),
    ({"guided": {"regex": "a", "choice": ["b"]}}, "guided", "exactly one"),
])
def test_a_constraint_given_twice_or_malformed_is_refused_naming_it(extra, param,
                                                                    words) -> None:
    with pytest.raises(BodyError) as info:
        parse_body(COMPLETIONS, {"prompt": "x", **extra})
    assert info.value.param == param and words in str(info.value)


def test_an_http_body_that_is_not_json_says_so() -> None:
    with pytest.raises(BodyError, match="not valid JSON"):
        decode_body(CHAT, b'{"model": "m", ')


def test_fields_with_no_effect_or_asking_for_nothing_are_accepted() -> None:
    # Given a body from a client that sends OpenAI's harmless fields at their neutral values
    body = {"model": "m", "prompt": ["Once"], "echo": False, "best_of": 1, "suffix": "",
            "store": True, "service_tier": "auto", "tools": [], "logit_bias": {},
            "tool_choice": "none", "stream_options": {"include_usage": False},
            "stream": False, "n": 1, "response_format": {"type": "text"}, "top_k": None}
    # Then it runs as the bare prompt would
    parsed = decode_body(COMPLETIONS, msgspec.json.encode(body))
    assert parsed.request == {"model": "m", "prompt": "Once"}
    assert (parsed.stream, parsed.include_usage, parsed.logprobs, parsed.n) == (
        False, False, None, 1)


@pytest.mark.parametrize("field, value", [("stream", True), ("logprobs", True),
                                          ("stream_options", {}), ("tool_choice", "auto")])
def test_a_batch_line_refuses_the_fields_it_has_no_place_for(field, value) -> None:
    # Given a chat body an HTTP client may send
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
    parse_body(CHAT, body)
    # Then as a batch line it is refused, naming the field
    with pytest.raises(BodyError) as info:
        parse_body(CHAT, body, batch=True)
    assert info.value.param == field


def test_chat_template_kwargs_and_a_tool_history_reach_the_wire() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    parsed = parse_body(CHAT, {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}],
        "tools": [TOOL], "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": False}})
    assert parsed.request["chat_template_kwargs"] == {"enable_thinking": False}
    assert parsed.request["messages"][1] == {"role": "assistant", "content": None,
                                             "tool_calls": [call]}
    assert parsed.request["tools"] == [TOOL] and "guided" not in parsed.request
    assert parsed.tool_calls


def test_several_prompts_are_one_request_each_and_one_answer() -> None:
    parsed = parse_body(COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 3})
    assert parsed.request["prompt"] == "a"
    assert [r["prompt"] for r in parsed.more_prompts] == ["b", "c"]
    assert all(r["n"] == 2 and r["max_tokens"] == 3 for r in parsed.more_prompts)
    with pytest.raises(BodyError, match="one request per prompt"):
        parse_body(COMPLETIONS, {"prompt": ["a", "b"]}, batch=True)


# -- API keys -------------------------------------------------------------------------------------


def test_keys_name_tenants_from_flags_variables_and_files(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\ncarol=sk-carol\ndave sk-dave  # rotated monthly\n")
    keys = ApiKeys.parse(["alice=sk-a1", "alice=sk-a2, bob=sk-b", "sk-plain"], files=[path])
    assert keys.tenant("Bearer sk-a2") == "alice" and keys.tenant("bearer sk-b") == "bob"
    assert keys.tenant("Bearer sk-carol") == "carol" and keys.tenant("Bearer sk-dave") == "dave"
    assert keys.tenant("Bearer sk-plain") == "default"
    assert keys.tenant("Bearer sk-nope") is None and keys.tenant(None) is None
    assert keys.tenant("Basic sk-b") is None


@pytest.mark.parametrize("entries", [[], ["a:b=sk"], ["a=sk", "b=sk"]])
def test_no_keys_or_bad_tenants_are_refused_at_start(entries) -> None:
    with pytest.raises(ValueError):
        ApiKeys.parse(entries)
