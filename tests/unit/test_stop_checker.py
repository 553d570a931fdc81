"""Stop tokens and stop strings, as the scheduler applies them after each token."""

from llmq.worker.engine.request import Request
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.stop_checker import check_stop_token, find_stop_string, num_held_back_chars

EOS = 2


def request_with_outputs(params: SamplingParams, outputs: list[int]) -> Request:
    request = Request("r", [1, 1], params, eos_token_ids=frozenset({EOS}), arrival_time=0.0)
    request.append_output_token_ids(outputs)
    return request


def test_stop_string_split_across_tokens_is_found_and_cut():
    # Given "Hello wo" already seen and "rld" just added, with stop string "o wor"
    # When it is checked
    match = find_stop_string("Hello world", 3, ["o wor"], include_stop_str_in_output=False)
    # Then the match is found, and the text is cut where it starts
    assert match == ("o wor", 4)
    assert find_stop_string("Hello world", 3, ["o wor"], True) == ("o wor", 9)


def test_a_match_entirely_in_older_text_is_not_reported_again():
    assert find_stop_string("world, and", 5, ["world"], False) is None


def test_the_earliest_of_several_stop_strings_wins():
    # Given two stop strings completed by the same new text
    match = find_stop_string("xxabcdef", 6, ["de", "bc"], False)
    # Then the text is cut at the one that starts first
    assert match == ("bc", 3)


def test_text_held_back_is_one_less_than_the_longest_stop_string():
    assert num_held_back_chars(SamplingParams(stop=("a", "abcd"))) == 3
    assert num_held_back_chars(SamplingParams()) == 0


def test_eos_stops_unless_ignored_and_not_before_min_tokens():
    assert check_stop_token(request_with_outputs(SamplingParams(), [EOS]), EOS)
    assert not check_stop_token(request_with_outputs(SamplingParams(ignore_eos=True), [EOS]), EOS)
    early = request_with_outputs(SamplingParams(min_tokens=2), [EOS])
    assert not check_stop_token(early, EOS)
    assert check_stop_token(request_with_outputs(SamplingParams(min_tokens=2), [5, EOS]), EOS)


def test_stop_token_ids_stop_even_with_ignore_eos_and_name_the_token():
    request = request_with_outputs(SamplingParams(stop_token_ids=(7,), ignore_eos=True), [7])
    assert check_stop_token(request, 7)
    assert request.stop_reason == 7
