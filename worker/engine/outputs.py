"""The plain data objects the engine's parts meet at (after vLLM v1's sched/output.py, outputs.py).

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler --EngineCoreOutput-->
worker. Lists, ints and strings only: no tensors leave the model runner. Requests the runner has
seen before travel as a diff (`CachedRequestData`); a request that is new, or resumed after a
preemption, travels whole (`NewRequestData`).

A finished request's usage, timings and logprobs are the wire's own structs
(`llmq.protocol`): the engine fills them in once, and the worker writes them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmq.protocol import Timings, TokenLogprob, Usage
from llmq.protocol.errors import ErrorCode
from llmq.protocol.events import Tokens
from llmq.worker.engine.sampling_params import SamplingParams

__all__ = [
    "CachedRequestData",
    "EngineCoreOutput",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
    "Timings",
    "TokenLogprob",
    "Usage",
]


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resumed after a preemption
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table so far
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)


@dataclass
class CachedRequestData:
    """Requests the runner already holds; their sampled tokens it appended itself."""

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to the block table
    num_computed_tokens: list[int] = field(default_factory=list)  # in the KV cache before this step
    # The block table's length after `new_block_ids`: shorter than the runner's plus the new
    # ones when blocks holding only rejected draft tokens were freed (spec_decode/speculator.py).
    block_table_lens: list[int] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls()


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    # Requests finished, aborted or preempted since the last step: the runner drops their state.
    finished_request_ids: set[str]
    # request_id -> draft tokens to verify after its last token; counted in num_scheduled_tokens
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0, set())


@dataclass
class ModelRunnerOutput:
    request_ids: list[str]  # every request scheduled this step, in the runner's order
    # Per request: the sampled ids ([] when the step ended inside its prompt; several when a
    # draft was verified: the accepted draft tokens, then the model's own next token).
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob]]  # per request, one per sampled id when asked for
    errors: dict[str, str] = field(default_factory=dict)  # request_id -> why (NaN/inf logits)
    # request_id -> why its grammar failed (tokens it refused; never expected after the gate)
    grammar_errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def make_empty(cls) -> ModelRunnerOutput:
        return cls([], [], [])


@dataclass
class EngineCoreOutput:
    """What one step produced for one request: only what is new since its previous output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0  # which of the request's n completions this is
    finish_reason: str | None = None  # stop | length | cancelled | error; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    error_code: ErrorCode | None = None  # with finish_reason "error": preempted, numerical...
    error_message: str | None = None
    # Set only on the finished output:
    text: str | None = None  # the whole output text
    usage: Usage | None = None
    timings: Timings | None = None  # on the engine's clock, from the request's arrival_time
    # worker/engine/prompt_tasks.py: the prompt's logprobs (asked for), or a task's answer
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None
    tokens: Tokens | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
