"""Scheduler: batching, chunked prefill, prefix caching, preemption, stops, aborts, policy.

The fake model runner keeps a fake KV cache addressed through the block tables it is sent, and
"samples" each token as a function of the tokens it reads back from that cache. A wrong block,
a block overwritten while in use, or a lost token therefore changes the output, as it would with
a real model.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmq.protocol.errors import RequestRejected
from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.input_processor import InputProcessor
from llmq.worker.engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from llmq.worker.engine.request import Request, RequestStatus
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.scheduler import Scheduler

VOCAB = 1000
EOS = 999


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def context_hash(request_id: str, num_outputs: int, context: list[int]) -> int:
    # NOTE: never EOS, so requests without a script run to their length limit.
    return hash(tuple(context)) % (VOCAB - 1)


@dataclass
class RunnerState:
    tokens: list[int]
    block_ids: list[int]
    num_prompt_tokens: int


@dataclass
class FakeModelRunner:
    num_blocks: int
    block_size: int
    clock: Clock
    next_token: Callable[[str, int, list[int]], int] = context_hash
    errors: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv: list[list[int | None]] = [[None] * self.block_size
                                           for _ in range(self.num_blocks)]
        self.states: dict[str, RunnerState] = {}

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.clock.now += 1.0  # every step takes a second
        for request_id in out.finished_request_ids:
            self.states.pop(request_id, None)
        start: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            assert new.request_id not in self.states, "resumed without being dropped first"
            self.states[new.request_id] = RunnerState(
                new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                len(new.prompt_token_ids))
            start[new.request_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed in zip(
                cached.request_ids, cached.new_block_ids, cached.num_computed_tokens,
                strict=True):
            self.states[request_id].block_ids += new_block_ids
            start[request_id] = num_computed
        assert start.keys() == out.num_scheduled_tokens.keys()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

        # Write every scheduled token's "KV" first, then read contexts back, like a real step.
        for request_id, n in out.num_scheduled_tokens.items():
            state = self.states[request_id]
            assert start[request_id] + n <= len(state.tokens)
            for pos in range(start[request_id], start[request_id] + n):
                block_id = state.block_ids[pos // self.block_size]
                assert block_id != 0, "block 0 is the padding block"
                self.kv[block_id][pos % self.block_size] = state.tokens[pos]
        request_ids, sampled = [], []
        for request_id, n in out.num_scheduled_tokens.items():
            state = self.states[request_id]
            request_ids.append(request_id)
            if start[request_id] + n < len(state.tokens):
                sampled.append([])
                continue
            context = [self.kv[state.block_ids[p // self.block_size]][p % self.block_size]
                       for p in range(len(state.tokens))]
            num_outputs = len(state.tokens) - state.num_prompt_tokens
            token = self.next_token(request_id, num_outputs, context)
            state.tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(request_ids, sampled, [None] * len(request_ids),
                                 dict(self.errors))


class FakeDetokenizer:
    """Each id is a fixed piece of text; ids in `partial` are held until the next token."""

    def __init__(self, pieces: dict[int, str], partial: frozenset[int] = frozenset()) -> None:
        self.pieces = pieces
        self.partial = partial
        self.held = ""

    def update(self, new_token_ids: list[int]) -> str:
        text = self.held + "".join(self.pieces.get(i, f"<{i}>") for i in new_token_ids)
        if new_token_ids[-1] in self.partial:
            self.held = text
            return ""
        self.held = ""
        return text

    def finish(self) -> str:
        text, self.held = self.held, ""
        return text


class Engine:
    """Scheduler + fake runner, stepped like EngineCore; requests pass the gate first, as they
    do in front of EngineCore (worker/engine/input_processor.py)."""

    def __init__(self, num_kv_blocks: int = 64, next_token=context_hash, **config) -> None:
        config.setdefault("block_size", 4)
        self.config = EngineConfig(**config)
        self.clock = Clock()
        self.scheduler = Scheduler(self.config, num_kv_blocks, clock=self.clock)
        self.gate = InputProcessor(None, vocab_size=VOCAB,
                                   max_model_len=self.scheduler.max_model_len
                                   if self.config.max_model_len is None
                                   else self.config.max_model_len,
                                   kv_cache_tokens=self.scheduler.kv_capacity_tokens,
                                   max_num_seqs=self.config.max_num_seqs)
        self.runner = FakeModelRunner(num_kv_blocks, self.config.block_size, self.clock,
                                      next_token)
        self.outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
        self.steps: list[SchedulerOutput] = []
        self.step_outputs: list[list[EngineCoreOutput]] = []
        self.num_added = 0

    def add(self, prompt: list[int], request_id: str | None = None, priority: int = 0,
            detokenizer=None, **params) -> Request:
        self.num_added += 1
        self.gate.check_prompt(prompt)
        sampling_params = SamplingParams(**params)
        self.gate.check_sampling_params(sampling_params)
        request = Request(request_id or f"r{self.num_added}", prompt, sampling_params,
                          eos_token_ids=frozenset({EOS}), arrival_time=self.clock(),
                          priority=priority, detokenizer=detokenizer)
        self.scheduler.add_request(request)
        return request

    def step(self) -> list[EngineCoreOutput]:
        out = self.scheduler.schedule()
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= self.config.max_num_seqs
        self.steps.append(out)
        outputs = self.scheduler.update_from_output(out, self.runner.execute_model(out))
        self.step_outputs.append(outputs)
        self._collect(outputs)
        return outputs

    def run(self, max_steps: int = 5000) -> None:
        while self.scheduler.has_unfinished_requests():
            self.step()
            assert len(self.steps) < max_steps, "no progress"
        self._collect(self.scheduler.take_finished_outputs())

    def _collect(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            assert not (self.outputs[output.request_id]
                        and self.outputs[output.request_id][-1].finished), "output after finish"
            self.outputs[output.request_id].append(output)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]

    def text(self, request_id: str) -> str:
        return "".join(o.new_text for o in self.outputs[request_id])

    def final(self, request_id: str) -> EngineCoreOutput:
        output = self.outputs[request_id][-1]
        assert output.finished
        return output

    def all_blocks_free(self) -> bool:
        kv = self.scheduler.kv_cache_manager
        return kv.num_free_blocks == kv.num_usable_blocks


def run_alone(prompt: list[int], next_token=context_hash, num_kv_blocks: int = 64,
              **params) -> EngineCoreOutput:
    engine = Engine(num_kv_blocks, next_token)
    request = engine.add(prompt, **params)
    engine.run()
    return engine.final(request.request_id), engine.tokens(request.request_id)


def scripted(script: dict[str, list[int]]):
    return lambda request_id, num_outputs, context: script[request_id][num_outputs]


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


# -- stop conditions ----------------------------------------------------------------------------

PIECES = {1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: "!", 6: " and", 7: " more", EOS: "</s>"}


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


def test_invalid_logits_fail_the_request_with_code_numerical():
    engine = Engine()
    request = engine.add([1, 2, 3], max_tokens=5)
    engine.runner.errors[request.request_id] = "NaN in logits"
    engine.run()
    final = engine.final(request.request_id)
    assert (final.finish_reason, final.error_code) == ("error", "numerical")
    assert "NaN" in final.error_message and engine.all_blocks_free()


# -- aborts, policy, admission ------------------------------------------------------------------


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
