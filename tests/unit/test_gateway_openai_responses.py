"""The gateway's OpenAI responses without IO: SSE chunks, resumed streams, n > 1, tool calls."""

from __future__ import annotations

import json

import pytest

from llmq.broker.commands import Followed
from llmq.broker.transcript import Fold
from llmq.gateway.openai_request import CHAT, COMPLETIONS
from llmq.gateway.openai_response import (
    CompletionStream,
    LogprobsBuilder,
    completion_object,
    sse,
)
from llmq.gateway.tool_calls import parse_tool_calls, streamable_length
from llmq.protocol import Choice, Delta, Done, Error, Start, Timings, TokenLogprob, Usage
from llmq.protocol.token_text import token_bytes, token_text

# -- streaming ------------------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=3, completion_tokens=3, cached_prompt_tokens=1)
TIMINGS = Timings(queue=0.0, ttft=0.1, e2e=0.3, per_token=0.1)


def events(attempt: int = 1, texts: tuple[str, ...] = ("Hel", "lo", "!"), first: int = 10
           ) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = [(f"{first}-0", Start(request_id="t:r", attempt=attempt,
                                                          worker="w", prompt_tokens=3,
                                                          model="tiny"))]
    for seq, text in enumerate(texts):
        lp = [TokenLogprob(token_id=seq, logprob=-0.5, top_token_ids=[seq, 9],
                           top_logprobs=[-0.5, -1.5])]
        out.append((f"{first + 1 + seq}-0", Delta(request_id="t:r", attempt=attempt, seq=seq,
                                                  text=text, token_ids=[seq], logprobs=lp)))
    out.append((f"{first + 1 + len(texts)}-0", Done(
        request_id="t:r", attempt=attempt, finish_reason="stop", text="".join(texts),
        usage=USAGE, timings=TIMINGS)))
    return out


def feed(stream: CompletionStream, evs, *, after: str | None = None,
         restarted_at: int | None = None) -> list[bytes]:
    frames = []
    for i, (entry_id, event) in enumerate(evs):
        fold = Fold.RESTARTED if i == restarted_at else Fold.ACCEPTED
        replayed = after is not None and int(entry_id.split("-")[0]) <= int(after.split("-")[0])
        frames += stream.feed(Followed(entry_id, event, fold, replayed))
    return frames


def parsed(frames: list[bytes]) -> list[tuple[str | None, object]]:
    out = []
    for frame in frames:
        lines = frame.decode().strip().split("\n")
        event_id = lines[0][4:] if lines[0].startswith("id: ") else None
        data = lines[-1][6:]
        out.append((event_id, data if data == "[DONE]" else json.loads(data)))
    return out


def text_of(chunks) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for _, c in chunks
                   if isinstance(c, dict) and c.get("choices"))


def test_a_chat_stream_has_the_role_chunk_deltas_finish_usage_and_done_each_with_its_id() -> None:
    stream = CompletionStream(CHAT, "r", include_usage=True, logprobs=True)
    chunks = parsed(feed(stream, events()))
    ids = [event_id for event_id, _ in chunks]
    assert ids == ["10-0", "11-0", "12-0", "13-0", "14-0", None, None]
    assert chunks[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text_of(chunks) == "Hello!"
    assert chunks[1][1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1] == {
        "token": "token_id:9", "logprob": -1.5, "bytes": list(b"token_id:9")}
    assert chunks[4][1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[5][1]["choices"] == [] and chunks[5][1]["usage"]["total_tokens"] == 6
    assert chunks[-1][1] == "[DONE]"
    assert {c["id"] for _, c in chunks[:-1]} == {"chatcmpl-r"}


def test_a_resumed_stream_sends_exactly_what_follows_the_last_event_id() -> None:
    whole = parsed(feed(CompletionStream(CHAT, "r"), events()))
    for cut in range(len(whole) - 1):
        after = whole[cut][0] or whole[cut - 1][0]
        head = whole[:cut + 1]
        resumed = parsed(feed(CompletionStream(CHAT, "r"), events(), after=after))
        assert text_of(head) + text_of(resumed) == "Hello!"
        assert resumed[-1][1] == "[DONE]"


def test_a_rerun_that_repeats_the_sent_text_continues_it_without_repeating() -> None:
    # Given attempt 1 sent "Hel" before its worker died, and attempt 2 reruns greedily
    stream = CompletionStream(COMPLETIONS, "r")
    first = feed(stream, events(texts=("Hel",))[:2])
    rerun = feed(stream, events(attempt=2, first=20), restarted_at=0)
    texts = [c["choices"][0]["text"] for _, c in parsed(first + rerun)
             if isinstance(c, dict) and c["choices"]]
    # Then the client sees "Hello!" once
    assert "".join(texts) == "Hello!"


def test_a_rerun_that_diverges_ends_the_stream_with_an_error() -> None:
    stream = CompletionStream(CHAT, "r")
    feed(stream, events(texts=("Hel",))[:2])
    frames = parsed(feed(stream, events(attempt=2, texts=("Bye",), first=20), restarted_at=0))
    assert frames[-2][1]["error"]["code"] == "restart_diverged" and frames[-1][1] == "[DONE]"


def test_errors_and_cancellations_end_the_stream_in_openai_error_shape() -> None:
    stream = CompletionStream(CHAT, "r")
    error = Error(request_id="t:r", attempt=1, code="prompt_too_long", message="too long")
    frames = parsed(stream.feed(Followed("5-0", error, Fold.ACCEPTED, False)))
    assert frames[0] == ("5-0", {"error": {"message": "too long",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "prompt_too_long"}})
    cancelled = Done(request_id="t:r", attempt=1, finish_reason="cancelled", text="",
                     usage=USAGE, timings=TIMINGS)
    frames = parsed(CompletionStream(CHAT, "r").feed(Followed("6-0", cancelled, Fold.ACCEPTED,
                                                              False)))
    assert frames[0][1]["error"]["code"] == "cancelled"


def test_line_separators_in_text_cannot_cut_an_event() -> None:
    # Given an answer holding U+2028, U+2029 and U+0085 (a random model writes anything)
    frame = sse({"text": "a\u2028b\u2029c\x85d"}, "1-0")
    # Then the event is still one line for readers that split like str.splitlines()
    assert len(frame.decode().strip("\n").splitlines()) == 2
    assert json.loads(frame.decode().split("data: ", 1)[1])["text"] == "a\u2028b\u2029c\x85d"


# -- several completions (n > 1) ------------------------------------------------------------------


def choice_events(texts: dict[int, tuple[str, ...]], first: int = 10) -> list[tuple[str, object]]:
    """A request with n = len(texts): its choices' deltas interleaved, then one `done`."""
    out: list[tuple[str, object]] = [(f"{first}-0", Start(request_id="t:r", attempt=1,
                                                          worker="w", prompt_tokens=3))]
    entry = first + 1
    for seq in range(max(len(t) for t in texts.values())):
        for index, parts in texts.items():
            if seq < len(parts):
                out.append((f"{entry}-0", Delta(request_id="t:r", attempt=1, seq=entry - first - 1,
                                                text=parts[seq], token_ids=[seq], index=index)))
                entry += 1
    choices = [Choice(index, "".join(parts), "stop", len(parts)) for index, parts in texts.items()]
    out.append((f"{entry}-0", Done(request_id="t:r", attempt=1, finish_reason="stop",
                                   text=choices[0].text, usage=USAGE, timings=TIMINGS,
                                   choices=choices)))
    return out


def texts_by_index(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for _, chunk in chunks:
        for choice in chunk["choices"] if isinstance(chunk, dict) else []:
            texts[choice["index"]] = (texts.get(choice["index"], "")
                                      + (choice["delta"].get("content") or ""))
    return texts


def test_a_stream_of_several_completions_sends_each_choice_by_its_index() -> None:
    # Given a chat stream asked for n=2 whose completions interleave
    stream = CompletionStream(CHAT, "r", n=2)
    chunks = parsed(feed(stream, choice_events({0: ("Hel", "lo"), 1: ("Bon", "jo", "ur")})))
    # Then the role chunk opens both choices, each text arrives under its index
    assert [c["index"] for c in chunks[0][1]["choices"]] == [0, 1]
    assert texts_by_index(chunks) == {0: "Hello", 1: "Bonjour"}
    # And one last chunk finishes both, before [DONE]
    assert [(c["index"], c["finish_reason"]) for c in chunks[-2][1]["choices"]] == [
        (0, "stop"), (1, "stop")]
    assert chunks[-1][1] == "[DONE]"


def test_a_resumed_stream_of_several_completions_misses_nothing_and_repeats_nothing() -> None:
    evs = choice_events({0: ("a", "b", "c"), 1: ("x", "y")})
    whole = parsed(feed(CompletionStream(CHAT, "r", n=2), evs))
    for cut in range(len(whole) - 1):
        after = whole[cut][0] or whole[cut - 1][0]
        resumed = parsed(feed(CompletionStream(CHAT, "r", n=2), evs, after=after))
        head = texts_by_index(whole[:cut + 1])
        tail = texts_by_index(resumed)
        assert {i: head.get(i, "") + tail.get(i, "") for i in (0, 1)} == {0: "abc", 1: "xy"}
        assert resumed[-1][1] == "[DONE]"


def test_a_whole_answer_lists_every_choice_with_its_own_logprobs() -> None:
    done = choice_events({0: ("A",), 1: ("B",)})[-1][1]
    body = completion_object(CHAT, "chatcmpl-r", "m", 0, done, {1: {"content": []}})
    assert [(c["index"], c["message"]["content"], c["logprobs"]) for c in body["choices"]] == [
        (0, "A", None), (1, "B", {"content": []})]


# -- tool calls -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", '{"a": 1}')]),
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "g", "arguments": {"b": "x"}}\n</tool_call>', "Sure.",
     [("f", "{}"), ("g", '{"b": "x"}')]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', None,
     [("f", '{"a": 1}'), ("g", "{}")]),
    ('{"name": "f", "parameters": {"a": {"b": 1}}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"a": {"b": 1}}'), ("g", "{}")]),
    ('<|python_tag|>{"name": "f", "parameters": {"q": "x"}}', None, [("f", '{"q": "x"}')]),
])
def test_each_family_s_tool_calls_are_read(text, content, calls) -> None:
    assert parse_tool_calls(text) == (content, calls)


@pytest.mark.parametrize("text", ["Hello there", '{"not": "a call"}', "<tool_call>\n{oops",
                                  "[TOOL_CALLS] nothing"])
def test_text_that_is_no_call_stays_content(text) -> None:
    assert parse_tool_calls(text) is None


def test_streamed_content_stops_where_a_call_may_begin() -> None:
    assert streamable_length("Hello <b>") == len("Hello <b>")
    assert streamable_length("Hello <tool") == len("Hello ")
    assert streamable_length("Hi [TOOL_CALLS][") == len("Hi ")
    assert streamable_length('  {"name"') == 0


def test_a_streamed_tool_call_comes_as_tool_calls_deltas_and_finish_reason() -> None:
    # Given a chat stream whose output is a call, in three deltas
    stream = CompletionStream(CHAT, "t1", "m", tool_calls=True)
    text = 'Ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    chunks = [data for _, data in parsed(feed(stream, events(texts=(
        text[:5], text[5:20], text[20:])))) if data != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    # Then the content before the call streams, the call comes whole with its id and index
    assert "".join(d.get("content") or "" for d in deltas) == "Ok "
    (call,) = [d["tool_calls"] for d in deltas if "tool_calls" in d][0]
    assert call["index"] == 0 and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # And the whole answer names the same call
    done = Done(request_id="r", attempt=1, text=text, finish_reason="stop", usage=USAGE,
                timings=TIMINGS)
    whole = completion_object(CHAT, "chatcmpl-t1", "m", 0, done, tool_calls=True)
    message = whole["choices"][0]["message"]
    assert message["tool_calls"][0]["id"] == call["id"] and message["content"] == "Ok"


@pytest.mark.parametrize("raw", [b"hello", b" \xe2\x80", b"\xa6", b"bytes:x", "é".encode()])
def test_a_token_s_text_gives_back_its_bytes(raw: bytes) -> None:
    assert token_bytes(token_text(raw)) == raw


def test_named_tokens_carry_their_own_text_and_bytes_in_logprobs() -> None:
    # Given a delta of two tokens, the first half of a character and the rest
    lps = [TokenLogprob(token_id=1, logprob=-0.1, top_token_ids=[1], top_logprobs=[-0.1],
                        token=token_text(b"\xc3"), top_tokens=[token_text(b"\xc3")]),
           TokenLogprob(token_id=2, logprob=-0.2, top_token_ids=[2, 3], top_logprobs=[-0.2, -3],
                        token=token_text(b"\xa9!"), top_tokens=[token_text(b"\xa9!"), "x"])]
    builder = LogprobsBuilder(CHAT)
    builder.add("é!", lps)
    content = builder.result()["content"]
    # Then each token has its own bytes, which add up to the text
    assert b"".join(bytes(t["bytes"]) for t in content).decode() == "é!"
    assert content[1]["top_logprobs"][1] == {"token": "x", "logprob": -3, "bytes": [120]}
