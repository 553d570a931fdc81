"""Scheduler: batching, chunked prefill, prefix caching, preemption, aborts, policy, admission."""

from __future__ import annotations

import random

import pytest

from llmq.protocol.errors import RequestRejected
from llmq.worker.engine.request import Request, RequestStatus
from tests.unit.scheduler_harness import PIECES, VOCAB, Engine, FakeDetokenizer, run_alone

# -- preemption --------------------------------------------------------------------------------


def test_twenty_requests_on_a_tiny_cache_give_their_solo_outputs():
    # Given 20 requests and a cache far too small for them all (19 blocks of 4 tokens)
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB - 1) for _ in range(8)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(VOCAB - 1)
                                                  for _ in range(rng.randint(3, 25))]
               for i in range(20)]
    max_tokens = [rng.randint(5, 20) for _ in range(20)]
    engine = Engine(num_kv_blocks=20, max_num_seqs=20, max_num_batched_tokens=64,
                    max_num_preemptions=1000)
    requests = [engine.add(p, max_tokens=m) for p, m in zip(prompts, max_tokens, strict=True)]

    # When they all run at once
    engine.run()

    # Then each produced exactly what it produces alone
    for request, prompt, m in zip(requests, prompts, max_tokens, strict=True):
        _, solo_tokens = run_alone(prompt, max_tokens=m)
        assert engine.tokens(request.request_id) == solo_tokens
        assert engine.final(request.request_id).finish_reason == "length"
    # And preemption happened, counted per request and in total
    assert engine.scheduler.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == engine.scheduler.num_preemptions
    # And nothing is left: every block free, and the runner told to drop every request
    assert engine.all_blocks_free() and engine.scheduler.kv_cache_usage == 0.0
    engine.runner.execute_model(engine.scheduler.schedule())
    assert engine.runner.states == {}


def preemption_pair(max_num_preemptions: int) -> tuple[Engine, Request, Request]:
    # Two requests of 6 prompt tokens growing to 14, on 4 usable blocks: both cannot fit.
    engine = Engine(num_kv_blocks=5, max_num_preemptions=max_num_preemptions)
    first = engine.add([1, 2, 3, 4, 5, 6], max_tokens=8)
    engine.clock.now += 0.5
    second = engine.add([7, 8, 9, 10, 11, 12], max_tokens=8)
    return engine, first, second


def test_past_the_preemption_cap_a_request_fails_with_code_preempted():
    # Given a cap of 0 preemptions and two requests that cannot both fit
    engine, first, second = preemption_pair(max_num_preemptions=0)
    # When they run
    engine.run()
    # Then the later arrival, the victim, fails with a clear error
    final = engine.final(second.request_id)
    assert (final.finish_reason, final.error_code) == ("error", "preempted")
    assert "max_num_preemptions=0" in final.error_message
    assert final.usage.completion_tokens == len(engine.tokens(second.request_id))
    # And the other one finishes with its solo output
    assert engine.tokens(first.request_id) == run_alone(first.prompt_token_ids, max_tokens=8)[1]
    assert engine.all_blocks_free()


def test_under_the_cap_the_victim_resumes_and_both_finish():
    engine, first, second = preemption_pair(max_num_preemptions=1)
    engine.run()
    assert second.num_preemptions == 1 and first.num_preemptions == 0
    for request in (first, second):
        assert engine.final(request.request_id).finish_reason == "length"
        solo = run_alone(request.prompt_token_ids, max_tokens=8)[1]
        assert engine.tokens(request.request_id) == solo


def test_a_preempted_request_can_be_aborted():
    # Given the second request was preempted and waits to resume
    engine, first, second = preemption_pair(max_num_preemptions=5)
    while second.status != RequestStatus.PREEMPTED:
        engine.step()
    # When it is aborted
    engine.scheduler.finish_requests([second.request_id])
    # Then its terminal output says cancelled, and the other one carries on
    outputs = engine.step()
    assert [o.finish_reason for o in outputs if o.request_id == second.request_id] == ["cancelled"]
    engine.run()
    assert engine.final(first.request_id).finish_reason == "length"


def test_priority_preempts_the_lowest_priority_not_the_latest():
    # Given a low-priority request that arrived first and a high-priority one after it
    engine = Engine(num_kv_blocks=5, scheduling_policy="priority")
    low = engine.add([1, 2, 3, 4, 5, 6], max_tokens=8, priority=10)
    engine.clock.now += 0.5
    high = engine.add([7, 8, 9, 10, 11, 12], max_tokens=8, priority=0)
    # When blocks run out
    engine.run()
    # Then the low-priority one was preempted
    assert (low.num_preemptions, high.num_preemptions) == (1, 0)


# -- prefix caching and chunked prefill ---------------------------------------------------------


def test_a_shared_prefix_is_computed_once():
    # Given a request with a 10-token prefix, already prefilled and decoding
    engine = Engine()
    prefix = list(range(100, 110))
    first = engine.add(prefix + [1, 2], max_tokens=5)
    engine.step()
    # When a second request with the same prefix arrives
    second = engine.add(prefix + [3, 4, 5], max_tokens=5)
    engine.run()
    # Then its two full prefix blocks (8 tokens) came from the cache and were not recomputed
    assert engine.final(second.request_id).usage.cached_prompt_tokens == 8
    new = [n for s in engine.steps for n in s.scheduled_new_reqs if n.request_id == "r2"]
    assert new[0].num_computed_tokens == 8
    assert engine.steps[1].num_scheduled_tokens["r2"] == 13 - 8
    assert engine.final(first.request_id).usage.cached_prompt_tokens == 0
    # And its output is what it is alone
    assert engine.tokens(second.request_id) == run_alone(prefix + [3, 4, 5], max_tokens=5)[1]
    assert engine.scheduler.prefix_cache_hit_rate == 8 / (12 + 13)


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes():
    # Given a decoding request and a budget of 16 tokens a step
    engine = Engine(max_num_batched_tokens=16)
    short = engine.add([1, 2, 3], max_tokens=10)
    engine.step()
    # When a 50-token prompt arrives
    long_prompt = [(7 * i) % 500 for i in range(50)]
    long = engine.add(long_prompt, max_tokens=4)
    engine.run()
    # Then it is prefilled 15 tokens a step while the decode keeps its 1
    chunks = [s.num_scheduled_tokens.get(long.request_id, 0) for s in engine.steps]
    assert chunks[1:5] == [15, 15, 15, 5]
    assert all(s.num_scheduled_tokens.get(short.request_id) == 1 for s in engine.steps[1:5])
    # And it outputs nothing until the whole prompt is in (the 5th step)
    steps_with_output = [i for i, outputs in enumerate(engine.step_outputs)
                         if any(o.request_id == long.request_id for o in outputs)]
    assert steps_with_output[0] == 4
    # And its tokens are those of an unchunked run
    assert engine.tokens(long.request_id) == run_alone(long_prompt, max_tokens=4)[1]


# -- numerical errors, aborts, policy, admission ------------------------------------------------


def test_invalid_logits_fail_the_request_with_code_numerical():
    engine = Engine()
    request = engine.add([1, 2, 3], max_tokens=5)
    engine.runner.errors[request.request_id] = "NaN in logits"
    engine.run()
    final = engine.final(request.request_id)
    assert (final.finish_reason, final.error_code) == ("error", "numerical")
    assert "NaN" in final.error_message and engine.all_blocks_free()


def test_abort_of_a_running_request_frees_its_blocks_at_once():
    # Given a running request holding blocks
    engine = Engine()
    request = engine.add(list(range(20)), max_tokens=50, detokenizer=FakeDetokenizer(PIECES))
    engine.step()
    engine.step()
    assert engine.scheduler.kv_cache_usage > 0
    # When it is aborted
    engine.scheduler.finish_requests(request.request_id)
    # Then its blocks are free before any further step
    assert engine.all_blocks_free() and not engine.scheduler.has_unfinished_requests()
    # And the idle engine still gets its terminal output, with usage and the whole text
    (final,) = engine.scheduler.take_finished_outputs()
    assert (final.finish_reason, final.usage.completion_tokens) == ("cancelled", 2)
    assert engine.text(request.request_id) + final.new_text == final.text
    # And the runner is told to drop it on the next step
    assert request.request_id in engine.scheduler.schedule().finished_request_ids


def test_abort_of_a_waiting_request_answers_on_the_next_step():
    engine = Engine(max_num_seqs=1)
    running = engine.add([1, 2, 3], max_tokens=5)
    waiting = engine.add([4, 5, 6], max_tokens=5)
    engine.step()
    engine.scheduler.finish_requests([waiting.request_id, "no-such-request"])
    assert engine.scheduler.num_waiting == 0
    outputs = engine.step()
    assert [o.finish_reason for o in outputs if o.request_id == waiting.request_id] == [
        "cancelled"]
    engine.run()
    assert engine.final(running.request_id).finish_reason == "length"
    assert engine.final(waiting.request_id).usage.completion_tokens == 0


def test_priority_policy_serves_a_high_priority_late_arrival_first():
    # Given one seat, taken, and two waiting requests: low priority first, high priority later
    engine = Engine(max_num_seqs=1, scheduling_policy="priority")
    engine.add([1, 2], max_tokens=2, request_id="first")
    engine.step()
    engine.clock.now += 1
    engine.add([3, 4], max_tokens=2, request_id="low", priority=5)
    engine.clock.now += 1
    engine.add([5, 6], max_tokens=2, request_id="high", priority=-1)
    # When the engine runs
    engine.run()
    # Then the late high-priority request is served before the early low-priority one
    order = [n.request_id for s in engine.steps for n in s.scheduled_new_reqs]
    assert order == ["first", "high", "low"]


def test_fcfs_serves_in_arrival_order():
    engine = Engine(max_num_seqs=1)
    for request_id, priority in (("a", 5), ("b", -1), ("c", 0)):
        engine.add([1, 2], max_tokens=2, request_id=request_id, priority=priority)
    engine.run()
    assert [n.request_id for s in engine.steps for n in s.scheduled_new_reqs] == ["a", "b", "c"]


def test_a_prompt_that_can_never_fit_is_rejected_naming_the_limit():
    engine = Engine(num_kv_blocks=3, max_model_len=16)  # 2 usable blocks of 4: 8 tokens of KV
    with pytest.raises(RequestRejected) as model_len:
        engine.add(list(range(16)))
    assert model_len.value.code == "prompt_too_long"
    assert "16 tokens" in model_len.value.message
    assert "max_model_len is 16" in model_len.value.message
    with pytest.raises(RequestRejected) as kv:
        engine.add(list(range(9)))
    assert kv.value.code == "prompt_too_long" and "KV cache holds at most 8" in kv.value.message
    # A prompt filling the whole cache still gets its one token
    request = engine.add(list(range(8)), max_tokens=5)
    engine.run()
    assert engine.final(request.request_id).usage.completion_tokens == 1
    assert engine.scheduler.get_num_unfinished_requests() == 0


def test_usage_and_timings_on_the_engine_clock():
    # Given one seat: "b" waits 2 s behind "a"
    engine = Engine(max_num_seqs=1)
    engine.add([1, 2, 3], max_tokens=2, request_id="a")
    engine.add([4, 5, 6, 7, 8], max_tokens=3, request_id="b")
    engine.run()
    final = engine.final("b")
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (5, 3)
    t = final.timings
    assert (t.queue, t.ttft, t.e2e, t.per_token) == (2.0, 3.0, 5.0, 1.0)


def test_counts_for_metrics():
    engine = Engine(max_num_seqs=1)
    engine.add([1, 2, 3], max_tokens=3)
    engine.add([4, 5, 6], max_tokens=3)
    engine.step()
    scheduler = engine.scheduler
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    assert scheduler.get_num_unfinished_requests() == 2 and scheduler.kv_cache_usage > 0


def test_an_empty_prompt_or_a_duplicate_id_is_an_invalid_request():
    engine = Engine()
    engine.add([1, 2], request_id="same")
    for prompt, request_id in (([], "empty"), ([3], "same")):
        with pytest.raises(RequestRejected) as rejected:
            engine.add(prompt, request_id=request_id)
        assert rejected.value.code == "invalid_request"
