"""The scheduler's side of speculative decoding: which requests draft, how many tokens, and the
acceptance counts.

One decode step of a request normally computes one position. With speculation, the scheduler
appends the request's draft tokens (`propose`) to that position, the model runner computes all
of them in one pass (a decode that looks like a small prefill chunk) and keeps the longest
prefix of the draft the target model agrees with, plus one token of its own
(worker/engine/spec_decode/rejection_sampler.py), and the scheduler rolls the KV cache back over
the rejected positions (`roll_back`).

A request drafts only where the draft cannot change what it would sample:
- not when it opted out (`SamplingParams.speculative`), nor under structured output (the grammar
  would have to advance through, and rewind over, the draft);
- not before `min_tokens` are out (the stop-token suppression is per position);
- never past `max_tokens` or the context length (the last position's token is the run's end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmq.worker.engine.spec_decode.draft_length import DraftLength
from llmq.worker.engine.spec_decode.ngram_proposer import NgramIndex

if TYPE_CHECKING:
    from llmq.worker.engine.kv_cache_manager import KVCacheManager
    from llmq.worker.engine.request import Request

SPECULATIVE_METHODS = ("ngram", "draft")  # draft: a smaller model (draft_model.py)


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config` names: method, num_speculative_tokens, prompt_lookup_max/min."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most draft tokens verified per step (k)
    prompt_lookup_max: int = 3  # the longest n-gram matched (n)
    prompt_lookup_min: int = 2  # the shortest: 1 matches single tokens, mostly by chance

    def problem(self) -> str | None:
        if self.method not in SPECULATIVE_METHODS:
            return f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
        if not 1 <= self.num_speculative_tokens <= 32:
            return f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}"
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            return (f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                    f"prompt_lookup_max ({self.prompt_lookup_max}) <= 16")
        return None


@dataclass
class RequestSpecState:
    """A request's own drafting state, kept across preemptions (its tokens do not change)."""

    index: NgramIndex
    draft_length: DraftLength
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class SpecDecodeStats:
    """Totals since the engine started, for heartbeats and metrics."""

    num_drafts: int = 0  # verified drafts (steps that speculated, summed over requests)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        problem = config.problem()
        if problem:
            raise ValueError(problem)
        self.config = config
        self.stats = SpecDecodeStats(
            accepted_per_position=[0] * config.num_speculative_tokens)

    def propose(self, request: Request, budget: int, max_model_len: int) -> list[int]:
        """Draft tokens to verify after the request's last token this step (maybe none), within
        a step budget of `budget` tokens (the decode's own included)."""
        max_drafts = self.draft_room(request, budget, max_model_len)
        if max_drafts <= 0:
            return []
        state = self.state_of(request)
        k = min(state.draft_length.next_k(), max_drafts)
        if k <= 0:
            return []
        return self.draft(request, state, k)

    def draft_room(self, request: Request, budget: int, max_model_len: int) -> int:
        """The most draft tokens the request may verify this step: 0 where it must not draft."""
        params = request.sampling_params
        if (not params.speculative or params.structured_output is not None
                or request.num_output_tokens < params.min_tokens or request.fork_at is not None
                or request.num_computed_tokens != request.num_tokens - 1):
            return 0
        # A draft of d tokens yields up to d + 1: never past max_tokens or the context.
        return min(budget - 1, params.max_tokens - request.num_output_tokens - 1,
                   max_model_len - request.num_tokens - 1)

    def state_of(self, request: Request) -> RequestSpecState:
        """The request's drafting state, made on its first draft."""
        state: RequestSpecState | None = request.spec_state
        if state is None:
            cfg = self.config
            state = request.spec_state = RequestSpecState(
                NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max),
                DraftLength(cfg.num_speculative_tokens))
        return state

    def draft(self, request: Request, state: RequestSpecState, k: int) -> list[int]:
        """Up to k draft tokens: the proposer (tests substitute their own here)."""
        return state.index.propose(request.all_token_ids, k)

    def roll_back(self, request: Request, draft: list[int], sampled: list[int],
                  kv_cache_manager: KVCacheManager) -> None:
        """After a verification: count the accepted draft tokens as computed, and free the
        blocks past them.

        The rejected positions' KV stays in blocks the request keeps, past its computed
        tokens, where the next step overwrites it; it was never offered to the prefix cache
        (only computed tokens are).
        """
        num_accepted = max(len(sampled) - 1, 0)
        request.num_computed_tokens += num_accepted
        self.record(request, len(draft), num_accepted)
        kv_cache_manager.trim(request, request.num_computed_tokens + 1)

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """What verification kept of the request's draft this step."""
        state: RequestSpecState | None = request.spec_state
        if state is None or num_drafts == 0:
            return
        state.draft_length.record(num_drafts, num_accepted)
        state.num_draft_tokens += num_drafts
        state.num_accepted_tokens += num_accepted
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
