"""What each step gives each lane (worker/engine/lane_priority.py): an interactive request that
arrives while batch work runs is computed in the very next step with interactive work alone,
batch work resumes once it has its first token, and batch prompts take at most
`max_batch_prefill_tokens` a step. No torch, no Redis: the fake runner of
tests/unit/test_scheduler.py, whose outputs change if a KV block is lost or overwritten."""

from __future__ import annotations

from llmq.worker.engine.request import Request, RequestStatus
from llmq.worker.engine.sampling_params import SamplingParams
from tests.unit.scheduler_harness import EOS, Engine, run_alone
from tests.unit.test_parallel_sampling import ParallelEngine, per_child, solo_tokens


def add(engine: Engine, name: str, prompt: list[int], *, batch: bool, max_tokens: int = 8,
        n: int = 1) -> Request:
    engine.gate.check_prompt(prompt)
    request = Request(name, prompt, SamplingParams(max_tokens=max_tokens, n=n),
                      eos_token_ids=frozenset({EOS}), arrival_time=engine.clock())
    request.batch = batch
    engine.scheduler.add_request(request)
    return request


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 37 + j * 11) % 900 + 1 for j in range(length)]


def scheduled(engine: Engine) -> set[str]:
    """The requests the last step computed."""
    return set(engine.steps[-1].num_scheduled_tokens)


def step_counting_batch_prefill(engine: Engine) -> int:
    """One step; returns the prompt tokens it computed for batch requests (rows that were not
    a single decode token)."""
    remaining = {r.request_id: r.num_tokens_to_compute - r.num_computed_tokens
                 for r in engine.scheduler.requests.values() if r.batch}
    engine.step()
    return sum(n for request_id, n in engine.steps[-1].num_scheduled_tokens.items()
               if remaining.get(request_id, 0) > 1)


def test_an_interactive_request_runs_in_the_next_step_alone_while_batch_work_keeps_its_place():
    # Given batch requests decoding, one halfway through a long prompt, and one waiting
    engine = Engine(max_num_batched_tokens=24, max_batch_prefill_tokens=16)
    decoding = [add(engine, f"b{i}", prompt_of(i, 5), batch=True, max_tokens=12)
                for i in range(2)]
    engine.step()
    long = add(engine, "long", prompt_of(7, 60), batch=True)
    engine.step()
    assert 0 < long.num_computed_tokens < 60
    add(engine, "queued", prompt_of(8, 5), batch=True)
    held = {r.request_id: list(r.block_ids) for r in (*decoding, long)}
    # When an interactive request arrives
    online = add(engine, "online", prompt_of(9, 6), batch=False, max_tokens=4)
    engine.step()
    # Then the next step computes it alone and gives it its first token; the batch requests
    # kept their seats and KV blocks, and none started
    assert scheduled(engine) == {"online"}
    assert len(engine.tokens("online")) == 1
    for request in (*decoding, long):
        assert request.status == RequestStatus.RUNNING and request.num_preemptions == 0
        assert request.block_ids == held[request.request_id]
    # And the step after, batch work runs beside its decode again
    engine.step()
    assert {"online", "b0", "b1", "long"} <= scheduled(engine)
    engine.run()
    for request in (*decoding, long, online):
        assert engine.tokens(request.request_id) == run_alone(
            request.prompt_token_ids, max_tokens=request.sampling_params.max_tokens)[1]
    assert engine.final("queued").finish_reason == "length"


def test_batch_work_sits_out_every_step_of_an_interactive_prompt_until_its_first_token():
    # Given a batch request decoding, and steps of 16 tokens
    engine = Engine(max_num_batched_tokens=16)
    add(engine, "batch", prompt_of(1, 5), batch=True, max_tokens=20)
    engine.step()
    # When an interactive request with a 50-token prompt arrives (four steps of prompt)
    add(engine, "online", prompt_of(2, 50), batch=False, max_tokens=4)
    steps_alone = 0
    while not engine.tokens("online"):
        engine.step()
        assert scheduled(engine) == {"online"}
        steps_alone += 1
    # Then batch work waited exactly those steps, and resumed right after
    assert steps_alone == 4
    engine.step()
    assert scheduled(engine) == {"online", "batch"}


def test_interactive_requests_decoding_do_not_hold_batch_work_back():
    engine = Engine()
    add(engine, "online", prompt_of(1, 5), batch=False, max_tokens=30)
    engine.step()
    add(engine, "batch", prompt_of(2, 5), batch=True)
    engine.step()
    assert scheduled(engine) == {"online", "batch"}


def test_batch_prompts_take_at_most_the_cap_a_step_and_interactive_ones_the_whole_budget():
    # Given 10 batch requests of 30-token prompts, a cap of 10 batch prompt tokens a step, and
    # interactive requests of 40-token prompts arriving now and then
    engine = Engine(num_kv_blocks=256, max_num_batched_tokens=64, max_batch_prefill_tokens=10)
    requests = [add(engine, f"b{i}", prompt_of(i, 30), batch=True) for i in range(10)]
    per_step = []
    while engine.scheduler.has_unfinished_requests():
        if len(engine.steps) % 7 == 3:
            requests.append(add(engine, f"i{len(engine.steps)}", prompt_of(len(engine.steps), 40),
                                batch=False, max_tokens=3))
            per_step.append(step_counting_batch_prefill(engine))
            # (the interactive prompt is computed whole, in one step of its own)
            assert engine.steps[-1].num_scheduled_tokens == {requests[-1].request_id: 40}
        else:
            per_step.append(step_counting_batch_prefill(engine))
    # Then no step computed more than 10 batch prompt tokens, and the cap was used
    assert max(per_step) == 10
    # And every request produced what it produces alone
    for request in requests:
        assert engine.tokens(request.request_id) == run_alone(
            request.prompt_token_ids, max_tokens=request.sampling_params.max_tokens)[1]


def test_a_pure_batch_workload_gives_the_same_tokens_whatever_the_cap():
    prompts = {f"b{i}": prompt_of(i, 9 + 5 * i) for i in range(8)}

    def run(**config) -> tuple[dict[str, list[int]], int]:
        engine = Engine(num_kv_blocks=48, max_num_batched_tokens=32, **config)
        for name, prompt in prompts.items():
            add(engine, name, prompt, batch=True, max_tokens=6)
        engine.run()
        return {name: engine.tokens(name) for name in prompts}, len(engine.steps)

    uncapped, uncapped_steps = run(max_batch_prefill_tokens=32)
    capped, capped_steps = run(max_batch_prefill_tokens=3)
    assert capped == uncapped
    assert capped_steps > uncapped_steps  # the cap did cut the prompts finer


def test_requests_without_a_lane_are_scheduled_whatever_the_batch_cap():
    # Given the same interactive-only workload (a tight cache: preemptions; prompts longer than
    # a step: chunks) on engines whose batch cap differs
    def steps(cap: int) -> list[dict[str, int]]:
        engine = Engine(num_kv_blocks=14, max_num_batched_tokens=12,
                        max_batch_prefill_tokens=cap)
        for i in range(6):
            add(engine, f"r{i}", prompt_of(i, 6 + 4 * i), batch=False, max_tokens=5)
            engine.step()
        engine.run()
        assert engine.scheduler.num_preemptions > 0
        return [dict(out.num_scheduled_tokens) for out in engine.steps]

    # Then every step is the same
    assert steps(1) == steps(1024)


def test_a_batch_request_with_n_completions_under_the_cap_gives_each_its_solo_tokens():
    # Given a batch request asking for 3 completions of a 22-token prompt, under a cap of 4
    engine = ParallelEngine(num_kv_blocks=64, next_token=per_child, max_batch_prefill_tokens=4)
    prompt = list(range(100, 122))
    add(engine, "x", prompt, batch=True, max_tokens=5, n=3)
    engine.step()
    # When an interactive request arrives while its prompt is still being computed
    add(engine, "online", prompt_of(3, 6), batch=False, max_tokens=3)
    engine.step()
    assert scheduled(engine) == {"online"}
    engine.run()
    # Then every completion is what it draws alone
    for index in range(3):
        assert engine.choice_tokens("x", index) == solo_tokens(prompt, index, 5)
    assert engine.blocks_in_use() == 0
