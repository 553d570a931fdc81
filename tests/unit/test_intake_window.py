"""How much a worker reads from the stream: what its engine can start soon, not every free seat.

Given the engine's token budget and the prompts seen so far, the window leaves a burst's surplus
in the stream for idle peers (tests/integration/test_work_conservation.py runs it on two workers).
"""

from __future__ import annotations

from llmq.worker.intake_window import ASSUMED_PROMPT_TOKENS, STEPS_AHEAD, IntakeWindow


def _seen(window: IntakeWindow, num_tokens: int, times: int = 200) -> IntakeWindow:
    for _ in range(times):
        window.note_prompt(num_tokens)
    return window


def test_a_burst_of_128_token_prompts_is_read_a_few_steps_at_a_time() -> None:
    # Given an engine of 64 seats and 1,024 tokens a step that has seen 128-token prompts
    window = _seen(IntakeWindow(max_num_seqs=64, max_num_batched_tokens=1024), 128)
    # Then an idle worker reads what two steps can prefill, not 64
    assert window.room(num_held=0, num_not_started=0) == STEPS_AHEAD * 1024 // 128 == 16
    # and reads nothing more while those 16 wait to start, however many seats are free
    assert window.room(num_held=16, num_not_started=16) == 0
    # When 8 of them have started, 8 more may come in
    assert window.room(num_held=16, num_not_started=8) == 8


def test_short_prompts_fill_the_seats_and_never_more() -> None:
    window = _seen(IntakeWindow(max_num_seqs=64, max_num_batched_tokens=1024), 10)
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
    window.note_prompt(64)  # one prompt moves the plan a fifth of the way: the prior counts 4
    assert window.mean_prompt_tokens == (4 * ASSUMED_PROMPT_TOKENS + 64) / 5
    _seen(window, 512)  # then a running mean follows a change of workload
    assert window.window == 4


def test_a_few_short_warm_ups_do_not_open_the_window_to_every_seat() -> None:
    # Given a worker that has seen only a client's four 8-token warm-up prompts (seen: the
    # window became all 64 seats and one worker took 63 of a 64-request burst of 128-token
    # prompts while its peer sat idle)
    window = _seen(IntakeWindow(max_num_seqs=64, max_num_batched_tokens=1024), 8, times=4)
    # Then it still plans with prompts of about the assumed length
    assert window.window == STEPS_AHEAD * 1024 // ((4 * ASSUMED_PROMPT_TOKENS + 4 * 8) // 8) == 15


def test_with_two_live_workers_each_read_takes_half_the_room() -> None:
    # Given a pool of two live workers, and room for 64 short prompts
    window = _seen(IntakeWindow(max_num_seqs=64, max_num_batched_tokens=1024), 10)
    window.num_workers = 2
    # Then one read after a burst woke both takes 32, so the peer's read finds the other 32
    assert window.per_read(window.room(num_held=0, num_not_started=0)) == 32
    # and a last free seat is still read
    assert window.per_read(window.room(num_held=63, num_not_started=0)) == 1
    assert window.per_read(window.room(num_held=64, num_not_started=0)) == 0
    window.num_workers = 3
    assert window.per_read(16) == 6
    window.num_workers = 1  # alone, a read takes all the room
    assert window.per_read(64) == 64


def test_a_long_prefill_step_is_remembered_for_a_few_dozen_steps() -> None:
    # Given an engine that ran a 7 s prefill step, then 0.3 s decode steps
    window = IntakeWindow(max_num_seqs=64, max_num_batched_tokens=1024)
    window.note_step(7.0)
    for _ in range(20):
        window.note_step(0.3)
    # Then its longest recent step is still seconds long (peers' reads are waited for that
    # long: worker/even_share.py), and fades to the decode steps' length later
    assert window.longest_step_s > 2.0
    for _ in range(100):
        window.note_step(0.3)
    assert window.longest_step_s == 0.3
