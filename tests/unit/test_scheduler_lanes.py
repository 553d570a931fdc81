"""Scheduler and lanes (worker/engine/scheduler.py): batch requests wait behind interactive ones,
sit steps out while one waits to start, and are the ones preempted for it. No torch, no Redis:
the fake runner of tests/unit/scheduler_harness.py."""

from __future__ import annotations

from llmq.worker.engine.request import Request, RequestStatus
from llmq.worker.engine.sampling_params import SamplingParams
from tests.unit.scheduler_harness import EOS, Engine


def add(engine: Engine, name: str, prompt: list[int], *, batch: bool, max_tokens: int = 8
        ) -> Request:
    request = Request(name, prompt, SamplingParams(max_tokens=max_tokens),
                      eos_token_ids=frozenset({EOS}), arrival_time=engine.clock())
    request.batch = batch
    engine.scheduler.add_request(request)
    engine.clock.now += 0.1
    return request


def test_an_interactive_request_starts_in_a_step_of_its_own_beside_running_batch_work() -> None:
    # Given two batch requests decoding
    engine = Engine()
    batch = [add(engine, f"b{i}", [1, 2, 3, 4, 5 + i], batch=True) for i in range(2)]
    engine.step()
    engine.step()
    # When an interactive request arrives
    online = add(engine, "i", [9, 8, 7], batch=False)
    engine.step()
    # Then the next step is its prefill alone, and then batch work resumes beside it
    assert list(engine.steps[-1].num_scheduled_tokens) == ["i"]
    engine.step()
    assert set(engine.steps[-1].num_scheduled_tokens) == {"i", "b0", "b1"}
    engine.run()
    for request in (*batch, online):
        assert engine.final(request.request_id).finish_reason == "length"


def test_interactive_requests_wait_ahead_of_batch_ones_queued_earlier() -> None:
    engine = Engine(max_num_seqs=1)
    add(engine, "b", [1, 2, 3], batch=True)
    add(engine, "i", [4, 5, 6], batch=False)
    engine.step()
    assert list(engine.steps[-1].num_scheduled_tokens) == ["i"]


def test_a_batch_request_is_preempted_for_an_interactive_one_short_of_kv() -> None:
    # Given a batch request holding most of a tiny cache (4 usable blocks of 4 tokens)
    engine = Engine(num_kv_blocks=5)
    batch = add(engine, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], batch=True)
    engine.step()
    # When an interactive request needs more blocks than are free
    online = add(engine, "i", [11, 12, 13, 14, 15, 16], batch=False)
    engine.step()
    # Then the batch request gave way, and both still finish
    assert batch.num_preemptions == 1 and online.num_preemptions == 0
    assert batch.status == RequestStatus.PREEMPTED
    engine.run()
    assert engine.final("b").finish_reason == engine.final("i").finish_reason == "length"


def test_a_batch_request_gives_its_seat_to_an_interactive_one() -> None:
    engine = Engine(max_num_seqs=1)
    batch = add(engine, "b", [1, 2, 3], batch=True)
    engine.step()
    add(engine, "i", [4, 5, 6], batch=False)
    engine.step()
    assert list(engine.steps[-1].num_scheduled_tokens) == ["i"] and batch.num_preemptions == 1
    engine.run()
    assert engine.final("b").finish_reason == "length"
