"""The scheduler tests' engine: the Scheduler stepped like EngineCore over a fake model runner.

The fake model runner keeps a fake KV cache addressed through the block tables it is sent, and
"samples" each token as a function of the tokens it reads back from that cache. A wrong block,
a block overwritten while in use, or a lost token therefore changes the output, as it would with
a real model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.input_processor import InputProcessor
from llmq.worker.engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from llmq.worker.engine.request import Request
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


# Token id -> text for FakeDetokenizer.
PIECES = {1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: "!", 6: " and", 7: " more", EOS: "</s>"}
