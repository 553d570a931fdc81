"""How much a worker reads from the stream: what its engine can start soon, not every free seat.

Given the engine's token budget and the prompts seen so far, the window leaves a burst's surplus
in the stream for idle peers (tests/integration/test_work_conservation.py runs it on two workers).
"""

from __future__ import annotations

from llmq.worker.intake_window import ASSUMED_PROMPT_TOKENS, STEPS_AHEAD, IntakeWindow


def test_a_burst_of_128_token_prompts_is_read_a_few_steps_at_a_time() -> None:
    # Given an engine of 64 seats and 1,024 tokens a step that has seen 128-token prompts
    window = IntakeWindow(max_num_seqs=64, max_num_batched_tokens=1024)
    for _ in range(5):
        window.note_prompt(128)
    # Then an idle worker reads what two steps can prefill, not 64
    assert window.room(num_held=0, num_not_started=0) == STEPS_AHEAD * 1024 // 128 == 16
    # and reads nothing more while those 16 wait to start, however many seats are free
    assert window.room(num_held=16, num_not_started=16) == 0
    # When 8 of them have started, 8 more may come in
    assert window.room(num_held=16, num_not_started=8) == 8


def test_short_prompts_fill_the_seats_and_never_more() -> None:
    window = IntakeWindow(max_num_seqs=64, max_num_batched_tokens=1024)
    window.note_prompt(10)
    assert window.window == 64
    assert window.room(num_held=60, num_not_started=0) == 4
    assert window.room(num_held=64, num_not_started=0) == 0


def test_a_prompt_longer_than_a_step_is_still_read_one_at_a_time() -> None:
    window = IntakeWindow(max_num_seqs=64, max_num_batched_tokens=512)
    window.note_prompt(8000)
    assert window.room(num_held=0, num_not_started=0) == 1
    assert window.room(num_held=1, num_not_started=1) == 0


def test_before_any_prompt_it_plans_with_an_assumed_length_then_follows_the_prompts() -> None:
    window = IntakeWindow(max_num_seqs=64, max_num_batched_tokens=1024)
    assert window.window == STEPS_AHEAD * 1024 // ASSUMED_PROMPT_TOKENS
    window.note_prompt(64)  # the first real prompt replaces the assumption
    assert window.window == 32
    for _ in range(200):  # then a running mean follows a change of workload
        window.note_prompt(512)
    assert window.window == 4
