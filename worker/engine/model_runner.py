"""ModelRunner: turns a SchedulerOutput into one forward pass and one sampling call.

After vLLM v1's GPUModelRunner (persistent per-request state, updated from the scheduler's diff)
and nano-vllm's model_runner.py (flatten every scheduled token of every sequence into one batch,
so each linear layer runs once per step). Tensors live here and in the model; everything that
leaves is lists and ints (`ModelRunnerOutput`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from llmq.worker.engine.model.attention import AttentionMetadata
from llmq.worker.engine.model.llama import LlamaForCausalLM
from llmq.worker.engine.outputs import ModelRunnerOutput, SchedulerOutput
from llmq.worker.engine.sampler import Sampler, SamplingMetadata
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.structured_output import (
    GrammarError,
    GrammarMatcher,
    StructuredOutputManager,
    apply_token_bitmask,
    bitmask_words,
)

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """What the runner remembers of a running request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    grammar: GrammarMatcher | None = None  # with structured output: where the output stands

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_kv_blocks: int, block_size: int,
                 threads: int,
                 eos_token_ids: frozenset[int] = frozenset(),
                 structured_output: StructuredOutputManager | None = None) -> None:
        # NOTE: set explicitly: torch's default (one thread per core) collapses 5-30x on this
        # kind of machine whenever a neighbour is busy; one worker process per core is the plan.
        torch.set_num_threads(threads)
        self.model: LlamaForCausalLM | None = model  # None while asleep at level 2
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = model.arch.vocab_size
        self.kv_caches = model.make_kv_caches(num_kv_blocks, block_size)
        self.sampler = Sampler()
        self.eos_token_ids = sorted(eos_token_ids)
        self.requests: dict[str, CachedRequestState] = {}
        self.structured_output = structured_output
        self.sleep_level = 0
        self._grammar_errors: dict[str, str] = {}  # request_id -> why its matcher failed

    def _update_states(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            state = self.requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.prompt_token_ids), list(new.output_token_ids),
                new.sampling_params, list(new.block_ids), new.num_computed_tokens)
            if new.sampling_params.structured_output is not None:
                self._start_grammar(state)
        cached = so.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed in zip(
                cached.request_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
            state = self.requests[request_id]
            state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.make_empty()

        # NOTE: single-token sequences (decodes) go first: the attention runs them as one batch.
        scheduled = sorted(so.num_scheduled_tokens.items(), key=lambda item: item[1] != 1)
        states = [self.requests[request_id] for request_id, _ in scheduled]
        query_lens = [n for _, n in scheduled]
        input_ids: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []  # index into `states` of each request that samples
        logits_indices: list[int] = []  # its last token's row in the flat batch
        for i, (state, n) in enumerate(zip(states, query_lens, strict=True)):
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start:start + n])
            seq_lens.append(start + n)
            if start + n == len(state.token_ids):  # the prompt is done: a new token is due
                sample_rows.append(i)
                logits_indices.append(len(input_ids) - 1)

        metadata = AttentionMetadata.build(
            query_lens, seq_lens, [s.block_ids for s in states], self.block_size)
        model = self.awake_model
        hidden = model(  # [num_tokens, hidden_size]
            torch.tensor(input_ids, dtype=torch.long), metadata, self.kv_caches)

        sampled: list[list[int]] = [[] for _ in states]
        logprobs: list = [None] * len(states)
        errors: dict[str, str] = {}
        if sample_rows:
            logits = model.compute_logits(hidden[logits_indices])  # [num_samples, vocab]
            sampling_states = [states[i] for i in sample_rows]
            self._suppress_stop_tokens_before_min_tokens(logits, sampling_states)
            self._apply_grammars(logits, sampling_states)
            sampling_metadata = SamplingMetadata.build(
                [s.sampling_params for s in sampling_states],
                [s.prompt_token_ids for s in sampling_states],
                [s.output_token_ids for s in sampling_states],
                self.vocab_size)
            out = self.sampler(logits, sampling_metadata)
            sampled_rows = zip(sample_rows, out.sampled_token_ids, strict=True)
            for row, (i, token_id) in enumerate(sampled_rows):
                state = states[i]
                if row in out.bad_rows:
                    errors[state.request_id] = out.bad_rows[row]
                    continue
                state.output_token_ids.append(token_id)
                state.token_ids.append(token_id)
                sampled[i] = [token_id]
                logprobs[i] = out.logprobs[row]
                if state.grammar is not None and not state.grammar.accept(token_id):
                    self._grammar_errors[state.request_id] = state.grammar.error
        grammar_errors, self._grammar_errors = self._grammar_errors, {}
        return ModelRunnerOutput([s.request_id for s in states], sampled, logprobs, errors,
                                 grammar_errors)

    def sleep(self, level: int) -> int:
        """Drop the KV cache (level 2: the model too); returns the bytes let go."""
        freed = sum(t.numel() * t.element_size() for t in self.kv_caches)
        self.kv_caches = []
        if level == 2:
            model = self.awake_model
            tensors = [*model.parameters(), *model.buffers()]
            freed += sum(t.numel() * t.element_size() for t in tensors)
            self.model = None
        self.requests.clear()
        self.sleep_level = level
        return freed

    def wake_up(self, model: LlamaForCausalLM | None = None) -> None:
        if model is not None:
            self.model = model
        self.kv_caches = self.awake_model.make_kv_caches(self.num_kv_blocks, self.block_size)

    @property
    def awake_model(self) -> LlamaForCausalLM:
        if self.model is None:
            raise RuntimeError("the model was released (sleep level 2): wake_up with a model")
        return self.model
        self.sleep_level = 0

    def _start_grammar(self, state: CachedRequestState) -> None:
        params = state.sampling_params.structured_output
        assert params is not None
        try:
            if self.structured_output is None:
                raise GrammarError("this engine has no structured output support")
            state.grammar = self.structured_output.matcher(params, state.output_token_ids)
        except GrammarError as e:
            # NOTE: the gate compiles every spec first, so this is a request resumed with
            # tokens its grammar refuses; it fails alone, on this step's output.
            self._grammar_errors[state.request_id] = str(e)

    def _apply_grammars(self, logits: torch.Tensor, states: list[CachedRequestState]) -> None:
        """Ban, in each constrained row only, every token its grammar does not allow next."""
        rows = [row for row, state in enumerate(states) if state.grammar is not None]
        if not rows:
            return
        bitmask = torch.empty(len(rows), bitmask_words(logits.shape[1]), dtype=torch.int32)
        for i, row in enumerate(rows):
            grammar = states[row].grammar
            assert grammar is not None
            grammar.fill_bitmask(bitmask, i)  # [num_words] int32 row
        apply_token_bitmask(logits, bitmask, rows)

    def _suppress_stop_tokens_before_min_tokens(
            self, logits: torch.Tensor, states: list[CachedRequestState]) -> None:
        # NOTE: like vLLM's min_tokens logits processor: until min_tokens are out, EOS and the
        # stop token ids cannot be sampled at all (rather than sampled and then ignored).
        for row, state in enumerate(states):
            params = state.sampling_params
            if len(state.output_token_ids) >= params.min_tokens:
                continue
            if state.grammar is not None and state.grammar.is_stopped:
                continue  # the grammar is complete: EOS is all it allows
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += self.eos_token_ids
            if banned:
                logits[row, banned] = float("-inf")  # [vocab] row of [num_samples, vocab]
