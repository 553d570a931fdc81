"""ModelRunner: turns a SchedulerOutput into one forward pass and one sampling call.

After vLLM v1's GPUModelRunner (persistent per-request state, updated from the scheduler's diff)
and nano-vllm's model_runner.py (flatten every scheduled token of every sequence into one batch,
so each linear layer runs once per step). Tensors live here and in the model; everything that
leaves is lists and ints (`ModelRunnerOutput`).
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from llmq.worker.engine.lora.lora_batch import LoraBatch
from llmq.worker.engine.model.attention import AttentionMetadata
from llmq.worker.engine.model.llama import LlamaForCausalLM
from llmq.worker.engine.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from llmq.worker.engine.sampler import Sampler, SamplingMetadata
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.spec_decode.rejection_sampler import (
    as_decode_rows,
    row_histories,
    verify,
)
from llmq.worker.engine.step_interrupt import PauseCheck
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


@dataclass
class _StepRows:
    """What sampling needs of a step's rows, kept while its layers run."""

    states: list[CachedRequestState]
    drafts: list[list[int]]
    sample_rows: list[int]  # index into `states` of each request that samples
    logits_indices: list[int]  # rows of the flat batch whose logits are sampled


@dataclass
class PausedForward:
    """A step stopped between two decoder layers or two slices of its LM head (its pause
    points, `ModelRunner._stages`): `ModelRunner.resume` runs the rest."""

    rows: _StepRows
    layers: Generator[int, None, torch.Tensor | None]  # `_stages`, suspended
    num_layers_done: int  # pause points passed: decoder layers, then LM head slices
    grammar_errors: dict[str, str]  # from starting its requests' grammars, delivered with it

    def drop(self) -> None:
        """Never resumed: its K/V writes so far lie past its requests' computed tokens."""
        self.layers.close()


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_kv_blocks: int, block_size: int, threads: int,
                 eos_token_ids: frozenset[int] = frozenset(),
                 structured_output: StructuredOutputManager | None = None) -> None:
        # NOTE: set explicitly: torch's default (one thread per core) collapses 5-30x on this
        # kind of machine whenever a neighbour is busy; one worker process per core is the plan.
        torch.set_num_threads(threads)
        self._model: LlamaForCausalLM | None = model
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
        for request_id, new_block_ids, num_computed, table_len in zip(
                cached.request_ids, cached.new_block_ids, cached.num_computed_tokens,
                cached.block_table_lens, strict=True):
            state = self.requests[request_id]
            # NOTE: the table may have shrunk since: speculative blocks freed on rejection.
            state.block_ids[table_len - len(new_block_ids):] = new_block_ids
            state.num_computed_tokens = num_computed

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, pause_after: PauseCheck | None = None
                      ) -> ModelRunnerOutput | PausedForward:
        """One step; paused between two decoder layers where `pause_after(layer)` says so
        (then `resume` finishes it, or dropping it leaves nothing to undo: nothing is sampled
        before the last layer, worker/engine/step_interrupt.py)."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.make_empty()

        # NOTE: single-token sequences (decodes) go first: the attention runs them as one batch.
        drafts_of = so.scheduled_spec_decode_tokens
        # NOTE: decodes go first, the attention runs them as one batch; a decode verifying a
        # draft is one too (`spec_decode.rejection_sampler.as_decode_rows`). Within each
        # group, requests of one LoRA adapter sit together: their rows form one segment.
        def order(item: tuple[str, int]) -> tuple[bool, str]:
            lora = self.requests[item[0]].sampling_params.lora
            return item[1] - len(drafts_of.get(item[0], ())) != 1, "" if lora is None else lora.name

        scheduled = sorted(so.num_scheduled_tokens.items(), key=order)
        states = [self.requests[request_id] for request_id, _ in scheduled]
        drafts = [drafts_of.get(s.request_id, []) for s in states]
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []  # index into `states` of each request that samples
        # Its last token's row in the flat batch, and with a draft, the draft's rows after it.
        logits_indices: list[int] = []
        for i, ((_, n), state, draft) in enumerate(zip(scheduled, states, drafts, strict=True)):
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start:start + n - len(draft)])
            input_ids.extend(draft)
            if draft:
                as_decode_rows(start, n, state.block_ids, query_lens, seq_lens, block_tables)
            else:
                query_lens.append(n)
                seq_lens.append(start + n)
                block_tables.append(state.block_ids)
            if start + n - len(draft) == len(state.token_ids):  # a new token is due
                sample_rows.append(i)
                logits_indices.extend(range(len(input_ids) - len(draft) - 1, len(input_ids)))

        metadata = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size)
        lora = LoraBatch.from_rows([(n, state.sampling_params.lora)
                                    for (_, n), state in zip(scheduled, states, strict=True)])
        rows = _StepRows(states, drafts, sample_rows, logits_indices)
        layers = self.model.forward_layers(  # -> [len(logits_indices), hidden_size]
            torch.tensor(input_ids, dtype=torch.long), metadata, self.kv_caches, lora,
            out_rows=logits_indices)
        return self._run_layers(rows, self._stages(rows, layers), pause_after)

    def _stages(self, rows: _StepRows, layers: Generator[int, None, torch.Tensor]
                ) -> Generator[int, None, torch.Tensor | None]:
        """A step's pause points: after each decoder layer, then after each vocabulary slice of
        the LM head (llama.py `logits_parts`), numbered on. Returns the logits of the rows that
        sample [num_rows, vocab] (None: no row does)."""
        hidden = yield from layers  # [len(logits_indices), hidden_size]
        if not rows.sample_rows:
            return None
        num_layers = len(self.model.layers)
        head = self.model.logits_parts(hidden)
        try:
            while True:
                yield num_layers + next(head)
        except StopIteration as done:
            return done.value

    @torch.inference_mode()
    def resume(self, paused: PausedForward, pause_after: PauseCheck | None = None
               ) -> ModelRunnerOutput | PausedForward:
        """Run a paused step's remaining layers and sample it (or pause it again)."""
        self._grammar_errors.update(paused.grammar_errors)
        return self._run_layers(paused.rows, paused.layers, pause_after)

    def _run_layers(self, rows: _StepRows, layers: Generator[int, None, torch.Tensor | None],
                    pause_after: PauseCheck | None) -> ModelRunnerOutput | PausedForward:
        while True:
            try:
                layer = next(layers)
            except StopIteration as done:
                return self._sample(rows, done.value)
            if pause_after is not None and pause_after(layer):
                # NOTE: errors from starting this step's grammars are its own: they go out with
                # its output, not with the steps run while it waits.
                errors, self._grammar_errors = self._grammar_errors, {}
                return PausedForward(rows, layers, layer + 1, errors)

    def _sample(self, rows: _StepRows, logits: torch.Tensor | None) -> ModelRunnerOutput:
        """Sample each row due a token from its logits [num_rows, vocab] (`_stages`)."""
        states, drafts = rows.states, rows.drafts
        sample_rows = rows.sample_rows
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: list[list[TokenLogprob]] = [[] for _ in states]
        errors: dict[str, str] = {}
        if logits is not None:
            # One row per sampled position: a drafting request has one per draft token + 1,
            # conditioned on the draft before it (worker/engine/spec_decode/rejection_sampler.py).
            # NOTE: the scheduler drafts only where min_tokens and grammars do not apply.
            row_states = [states[i] for i in sample_rows for _ in range(len(drafts[i]) + 1)]
            self._suppress_stop_tokens_before_min_tokens(logits, row_states)
            self._apply_grammars(logits, row_states)
            histories = [h for i in sample_rows
                         for h in row_histories(states[i].output_token_ids, drafts[i])]
            sampling_metadata = SamplingMetadata.build(
                [s.sampling_params for s in row_states],
                [s.prompt_token_ids for s in row_states], histories, self.vocab_size)
            out = self.sampler(logits, sampling_metadata)
            first_row = 0
            for i in sample_rows:
                state = states[i]
                kept = verify(out, first_row, drafts[i])
                first_row += len(drafts[i]) + 1
                if kept.error is not None:
                    errors[state.request_id] = kept.error
                    continue
                state.output_token_ids.extend(kept.token_ids)
                state.token_ids.extend(kept.token_ids)
                sampled[i] = kept.token_ids
                logprobs[i] = kept.logprobs
                for token_id in kept.token_ids:
                    if state.grammar is not None and not state.grammar.accept(token_id):
                        self._grammar_errors[state.request_id] = state.grammar.error
        grammar_errors, self._grammar_errors = self._grammar_errors, {}
        return ModelRunnerOutput([s.request_id for s in states], sampled, logprobs, errors,
                                 grammar_errors)

    @property
    def model(self) -> LlamaForCausalLM:
        if self._model is None:
            raise RuntimeError("the model was dropped by a level-2 sleep: wake_up(model) first")
        return self._model

    def sleep(self, level: int) -> int:
        """Drop the KV cache (level 2: the model too); returns the bytes let go."""
        freed = sum(t.numel() * t.element_size() for t in self.kv_caches)
        self.kv_caches = []
        if level == 2:
            model = self.model
            tensors = [*model.parameters(), *model.buffers()]
            freed += sum(t.numel() * t.element_size() for t in tensors)
            self._model = None
        self.requests.clear()
        self.sleep_level = level
        return freed

    def wake_up(self, model: LlamaForCausalLM | None = None) -> None:
        if model is not None:
            self._model = model
        self.kv_caches = self.model.make_kv_caches(self.num_kv_blocks, self.block_size)
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
