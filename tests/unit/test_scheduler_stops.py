"""Scheduler stop conditions: stop strings and their deltas, EOS, min/max tokens, length."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmq.worker.engine.request import Request
from tests.unit.scheduler_harness import EOS, PIECES, Engine, FakeDetokenizer, run_alone, scripted


def run_script(tokens: list[int], detokenizer=None, **params) -> tuple[Engine, Request]:
    engine = Engine(next_token=scripted({"r1": tokens}))
    request = engine.add([10, 11], detokenizer=detokenizer or FakeDetokenizer(PIECES), **params)
    engine.run()
    return engine, request


@pytest.mark.parametrize("include, text", [(False, "Hell"), (True, "Hello wor")])
def test_stop_string_split_across_tokens_stops_there(include, text):
    # Given output "Hel" "lo" " wo" "rld" "!" ... and the stop string "o wor"
    engine, request = run_script([1, 2, 3, 4, 5, 6, 7], stop=["o wor"],
                                 include_stop_str_in_output=include, max_tokens=7)
    # Then generation stops at the token completing it, and the text is cut (or kept) there
    final = engine.final(request.request_id)
    assert engine.tokens(request.request_id) == [1, 2, 3, 4]
    assert (final.finish_reason, final.stop_reason, final.text) == ("stop", "o wor", text)
    # And the deltas, held back while a stop string could still complete, add up to the text
    assert [o.new_text for o in engine.outputs[request.request_id]] == ["", "H", "ell", text[4:]]
    assert engine.text(request.request_id) == text


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(1, 4), min_size=1, max_size=12),
       stop=st.lists(st.text("ab", min_size=1, max_size=4), max_size=3),
       include=st.booleans())
def test_deltas_always_add_up_to_the_final_text(tokens, stop, include):
    # Given any output of "a", "b", "ab", "ba" pieces and any stop strings over "ab"
    pieces = {1: "a", 2: "b", 3: "ab", 4: "ba"}
    engine, request = run_script(tokens, FakeDetokenizer(pieces), stop=stop,
                                 include_stop_str_in_output=include, max_tokens=len(tokens))
    final = engine.final(request.request_id)
    # Then the streamed deltas are exactly the final text
    assert engine.text(request.request_id) == final.text
    # And that text is the full text cut at the first stop string it contains
    text = ""
    for n, token in enumerate(tokens, 1):
        text += pieces[token]
        found = [(text.find(s), s) for s in stop if s in text]
        if found:
            start, s = min(found, key=lambda f: f[0])
            assert final.text == text[:start + len(s) if include else start]
            assert engine.tokens(request.request_id) == tokens[:n]
            assert final.finish_reason == "stop"
            return
    assert (final.text, final.finish_reason) == (text, "length")


def test_eos_stops_without_its_text():
    engine, request = run_script([1, 2, EOS, 5], max_tokens=4)
    final = engine.final(request.request_id)
    assert (final.finish_reason, final.stop_reason, final.text) == ("stop", None, "Hello")
    assert engine.tokens(request.request_id) == [1, 2, EOS]
    assert final.usage.completion_tokens == 3


def test_min_tokens_suppresses_an_early_eos():
    engine, request = run_script([EOS, 1, EOS, 5], min_tokens=2, max_tokens=4)
    assert engine.tokens(request.request_id) == [EOS, 1, EOS]
    assert engine.final(request.request_id).finish_reason == "stop"


def test_min_tokens_suppresses_an_early_stop_string():
    engine, request = run_script([1, 2, 1, 2], stop=["Hello"], min_tokens=3, max_tokens=4)
    assert engine.tokens(request.request_id) == [1, 2, 1, 2]
    assert engine.final(request.request_id).text == "Hello"


def test_ignore_eos_runs_to_max_tokens():
    engine, request = run_script([EOS, EOS, EOS], ignore_eos=True, max_tokens=3)
    final = engine.final(request.request_id)
    assert (final.finish_reason, final.usage.completion_tokens) == ("length", 3)


def test_stop_token_id_stops_and_is_named():
    engine, request = run_script([1, 6, 2], stop_token_ids=[6], max_tokens=3)
    final = engine.final(request.request_id)
    assert (final.finish_reason, final.stop_reason, final.text) == ("stop", 6, "Hel")


def test_max_tokens_and_max_model_len_end_with_length():
    _, tokens = run_alone([1, 2, 3], max_tokens=5)
    assert len(tokens) == 5
    # Given max_model_len 10 and a 7-token prompt asking for 100 tokens
    engine = Engine(max_model_len=10)
    request = engine.add(list(range(7)), max_tokens=100)
    engine.run()
    # Then it stops at 10 tokens in all
    final = engine.final(request.request_id)
    assert (final.finish_reason, final.usage.completion_tokens) == ("length", 3)


def test_text_held_by_the_detokenizer_is_flushed_at_the_end():
    engine, request = run_script([1, 20], FakeDetokenizer({1: "a", 20: "é"}, frozenset({20})),
                                 max_tokens=2)
    assert engine.final(request.request_id).text == engine.text(request.request_id) == "aé"
