"""Scheduler: which requests run each step with how many tokens, and what their tokens mean.

After vLLM v1's `v1/core/sched/scheduler.py` and nano-vllm's `engine/scheduler.py`. One step
is `schedule()` -> model runner -> `update_from_output()`; both ends are plain data
(`SchedulerOutput`, `ModelRunnerOutput`, `EngineCoreOutput`). No torch, no Redis.

- Token budget: each step computes at most `max_num_batched_tokens` tokens over at most
  `max_num_seqs` running requests. Running requests go first (decodes and unfinished prompt
  chunks), then waiting ones, so a long prompt is prefilled in chunks alongside decodes.
- Order: `running` is kept sorted by the policy (fcfs: arrival; priority: lower value, then
  arrival), so the request preempted when blocks run out, the last one, is always the least
  important and never one already scheduled in this step. Batch requests yield to interactive
  ones: waiting, seats, KV blocks, steps, prompt tokens (worker/engine/lane_priority.py).
- Preemption is by recompute: the victim's blocks are freed (full ones stay in the prefix cache)
  and it goes back to the front of the waiting queue, keeping its output tokens and text.
- Requests finished outside `update_from_output` (aborts, the preemption cap) leave a terminal
  output that the next `update_from_output` or `take_finished_outputs` returns.
- `SchedulerOutput.finished_request_ids`: requests finished, aborted or preempted since the
  previous `schedule()`. The runner must drop those before adding new requests, and ignore ids
  it does not hold.
- Speculative decoding (worker/engine/spec_decode/speculator.py): a decode may carry draft
  tokens (`SchedulerOutput.scheduled_spec_decode_tokens`), counted as computed only once
  accepted; a draft is dropped rather than preempt anyone for its KV slots.
- Parallel sampling (n > 1): a parent prefills the prompt's full blocks once, then forks into
  n children holding them by reference (worker/engine/parallel_sampling.py).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterable

from llmq.protocol.errors import ErrorCode, RequestRejected
from llmq.worker.engine import lane_priority, stop_checker
from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.kv_cache_manager import KVCacheManager
from llmq.worker.engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    Timings,
    Usage,
)
from llmq.worker.engine.parallel_sampling import ParallelSampling
from llmq.worker.engine.request import Request, RequestStatus
from llmq.worker.engine.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, config.block_size,
                                               config.enable_prefix_caching)
        self.kv_capacity_tokens = self.kv_cache_manager.num_usable_blocks * config.block_size
        # NOTE: a request never stores its last token's KV, so a cache of C tokens can carry one
        # request to C + 1 tokens. Capping max_model_len there means a request running alone
        # always fits, and preemption always makes progress.
        self.max_model_len = min(config.max_model_len or self.kv_capacity_tokens + 1,
                                 self.kv_capacity_tokens + 1)
        if config.max_model_len and self.max_model_len < config.max_model_len:
            logger.warning("KV cache holds %d tokens: max_model_len capped from %d to %d",
                           self.kv_capacity_tokens, config.max_model_len, self.max_model_len)
        self.by_priority = config.scheduling_policy == "priority"

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # WAITING and PREEMPTED, next to admit first
        self.running: list[Request] = []  # sorted by _order_key
        self._order_keys: dict[str, tuple[int, float, float, int]] = {}
        self._arrivals = itertools.count()
        self._finished_request_ids: set[str] = set()
        self._finished_outputs: list[EngineCoreOutput] = []
        self.parallel = ParallelSampling(config.block_size)  # the families of n > 1 requests
        self.speculator = Speculator(config.speculative_config) \
            if config.speculative_config is not None else None
        self.num_preemptions = 0  # total, for metrics

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. It passed the gate (`InputProcessor`): a prompt that fits the
        context and the KV cache, every token id in the vocabulary, `n` within max_num_seqs."""
        # NOTE: ids are the engine's own bookkeeping (the worker uses stream entry ids, unique by
        # construction); a repeated one would corrupt the request table, so it is refused.
        if request.request_id in self.requests or request.request_id in self.parallel:
            raise RequestRejected(ErrorCode.INVALID_REQUEST,
                                  f"request {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._order_keys[request.request_id] = (
            int(request.batch), request.priority if self.by_priority else 0,
            request.arrival_time, next(self._arrivals))
        if request.sampling_params.n > 1:
            self.parallel.add_parent(request)
            if request.fork_at == 0:  # nothing to share: n plain requests
                for child in self._fork(request):
                    self._enqueue_waiting(child, front=False)
                return
        self._enqueue_waiting(request, front=False)

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish (by default abort) requests wherever they are; unknown ids are ignored.

        Blocks are freed now; each request's terminal output comes from the next
        `update_from_output` or `take_finished_outputs`.
        """
        assert status.is_finished, status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            for member_id in self.parallel.member_ids(request_id):
                request = self.requests.get(member_id)
                if request is not None:
                    self._finish(request, status)
                    self._finished_outputs.extend(self._terminal_outputs(request))

    def take_finished_outputs(self) -> list[EngineCoreOutput]:
        """Terminal outputs of requests finished outside a step (aborts, preemption cap); the
        engine calls this when it has nothing to schedule, so an abort while idle is answered."""
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

    # -- one step -------------------------------------------------------------------------------

    def schedule(self, paused: Collection[str] = ()) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        cached_reqs = CachedRequestData.make_empty()
        new_reqs: list[NewRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        preempted = False

        # Running requests: one decode token each, or the next chunk of their prompt; batch
        # ones as lane_priority allows; none of a paused step's (worker/engine/step_interrupt.py)
        lanes = lane_priority.LaneStep(self.waiting, self.running, self.config, paused)
        for victim in lanes.seat_victims:
            self._preempt(victim)  # a seat for it (nothing is scheduled yet)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = lanes.num_tokens(
                request, request.num_tokens_to_compute - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            draft = self.speculator.propose(request, budget, self.max_model_len) \
                if self.speculator is not None and num_new == 1 else []
            num_new += len(draft)
            while (block_ids := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
                if draft:  # NOTE: a draft never preempts anyone: it is dropped first
                    num_new -= len(draft)
                    draft = []
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if block_ids is None:
                break  # it preempted itself, being the last running request
            if request.new_to_runner:  # a child just forked: the runner gets it whole
                request.new_to_runner = False
                new_reqs.append(self._new_request_data(request, request.num_computed_tokens))
            else:
                cached_reqs.request_ids.append(request.request_id)
                cached_reqs.new_block_ids.append(block_ids)
                cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
                cached_reqs.block_table_lens.append(len(request.block_ids))
            if draft:
                spec_tokens[request.request_id] = draft
            num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            i += 1

        # Waiting requests, in queue order, while they fit.
        # NOTE: not after a preemption: the cache was just found full, and admitting now would
        # only preempt again next step.
        num_seqs = sum(r.num_seqs for r in self.running)
        while (not preempted and self.waiting and budget > 0
               and num_seqs + self.waiting[0].num_seqs <= self.config.max_num_seqs
               and lanes.starts(self.waiting[0])):
            request = self.waiting[0]
            computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            # NOTE: a parent whose prefix is all cached has nothing to compute: it forks now.
            num_hit = min(num_hit, request.num_tokens_to_compute)
            num_new = lanes.num_tokens(request, request.num_tokens_to_compute - num_hit, budget)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None and not request.batch \
                    and (giver := lane_priority.batch_victim(self.running)):
                self._preempt(giver)  # NOTE: batch requests sat this step out: none scheduled
                num_seqs -= giver.num_seqs
                continue
            if block_ids is None:
                break
            self.waiting.pop(0)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            request.status = RequestStatus.RUNNING
            request.new_to_runner = False
            bisect.insort(self.running, request, key=self._order_key)
            num_seqs += request.num_seqs
            if num_new == 0:
                self._fork(request)  # its children run from the next step
                continue
            new_reqs.append(self._new_request_data(request, num_hit))
            num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

        finished_ids, self._finished_request_ids = self._finished_request_ids, set()
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled_tokens,
                               self.config.max_num_batched_tokens - budget, finished_ids,
                               spec_tokens)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance the scheduled requests; one output per request with something new."""
        outputs = self.take_finished_outputs()
        runner = model_runner_output
        sampled = dict(zip(runner.request_ids, runner.sampled_token_ids, strict=True))
        logprobs = dict(zip(runner.request_ids, runner.logprobs, strict=False))
        now = self.clock()
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            draft = scheduler_output.scheduled_spec_decode_tokens.get(request_id, [])
            # NOTE: draft positions count as computed only once accepted, below.
            request.num_computed_tokens += num_tokens - len(draft)
            if request.fork_at is not None and request.num_computed_tokens >= request.fork_at:
                self._fork(request)
                continue
            if request_id in runner.errors:
                self._finish(request, RequestStatus.FINISHED_ERROR, ErrorCode.NUMERICAL,
                             f"the model produced invalid logits: {runner.errors[request_id]}")
                outputs.extend(self._terminal_outputs(request))
                continue
            if request_id in runner.grammar_errors:
                self._finish(request, RequestStatus.FINISHED_ERROR, ErrorCode.ENGINE_ERROR,
                             f"structured output: {runner.grammar_errors[request_id]}")
                outputs.extend(self._terminal_outputs(request))
                continue
            # NOTE: a token is only sampled once every token so far is computed; anything the
            # runner returns in the middle of a prompt is not a real sample.
            if request.num_computed_tokens < request.num_tokens:
                continue
            request_sampled = sampled.get(request_id, [])
            if draft:
                assert self.speculator is not None
                self.speculator.roll_back(request, draft, request_sampled, self.kv_cache_manager)
            new_token_ids: list[int] = []
            status = None
            for token_id in request_sampled:
                new_token_ids.append(token_id)
                if (status := self._append_token(request, token_id)) is not None:
                    break
            if not new_token_ids:
                continue
            if len(new_token_ids) < len(request_sampled):
                # A stop inside an accepted draft: the tokens after it never happened.
                request.num_computed_tokens = min(request.num_computed_tokens,
                                                  request.num_tokens - 1)
            if request.first_token_time is None:
                request.first_token_time = now
            if status is not None:
                self._finish(request, status)
            token_logprobs = logprobs.get(request_id) or []
            outputs.append(self._make_output(
                request, new_token_ids, token_logprobs[:len(new_token_ids)]))
        return outputs

    # -- metrics --------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.kv_cache_manager.prefix_cache_hit_rate

    # -- internals ------------------------------------------------------------------------------

    def _order_key(self, request: Request) -> tuple[int, float, float, int]:
        return self._order_keys[request.request_id]

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        if self.by_priority:
            bisect.insort(self.waiting, request, key=self._order_key)
        else:
            self.waiting.insert(lane_priority.waiting_index(self.waiting, request, front), request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._finished_request_ids.add(request.request_id)
        request.status = RequestStatus.PREEMPTED
        if request.num_preemptions > self.config.max_num_preemptions:
            self._finish(request, RequestStatus.FINISHED_ERROR, ErrorCode.PREEMPTED,
                         f"preempted {request.num_preemptions} times for lack of KV cache "
                         f"(max_num_preemptions={self.config.max_num_preemptions}); retry "
                         f"when the worker is less busy, or with fewer tokens")
            self._finished_outputs.extend(self._terminal_outputs(request))
            return
        logger.debug("preempted %s (%d times)", request.request_id, request.num_preemptions)
        self._enqueue_waiting(request, front=True)

    def _new_request_data(self, request: Request, num_computed_tokens: int) -> NewRequestData:
        return NewRequestData(request.request_id, list(request.prompt_token_ids),
                              list(request.output_token_ids), request.sampling_params,
                              list(request.block_ids), num_computed_tokens)

    def _fork(self, parent: Request) -> list[Request]:
        """Replace a parent that computed its shared blocks by its n children; a running
        parent's children take its place in `running`, each with a reference to its blocks."""
        if parent.status == RequestStatus.RUNNING:
            self.running.remove(parent)
        key = self._order_keys.pop(parent.request_id)
        children = self.parallel.fork(parent)
        for child in children:
            self.requests[child.request_id] = child
            self._order_keys[child.request_id] = key
        if parent.status == RequestStatus.RUNNING:
            for child in children:
                self.kv_cache_manager.fork(parent, child)
                child.status = RequestStatus.RUNNING
                child.new_to_runner = True
                bisect.insort(self.running, child, key=self._order_key)
            self.kv_cache_manager.free(parent)
            self._finished_request_ids.add(parent.request_id)
        del self.requests[parent.request_id]
        return children

    def _terminal_outputs(self, request: Request) -> list[EngineCoreOutput]:
        return self.parallel.terminal_outputs(request, self._make_output(request, [], []))

    def _append_token(self, request: Request, token_id: int) -> RequestStatus | None:
        """Append one sampled token and apply the stop conditions in order."""
        request.append_output_token_ids([token_id])
        params = request.sampling_params
        # NOTE: the text of an EOS / stop token is never added to the output.
        if stop_checker.check_stop_token(request, token_id):
            return RequestStatus.FINISHED_STOPPED
        if request.detokenizer is not None:
            text = request.detokenizer.update([token_id])
            request.output_text += text
            if text and params.stop and request.num_output_tokens >= params.min_tokens:
                match = stop_checker.find_stop_string(request.output_text, len(text),
                                                      params.stop,
                                                      params.include_stop_str_in_output)
                if match is not None:
                    request.stop_reason, cut = match
                    request.output_text = request.output_text[:cut]
                    return RequestStatus.FINISHED_STOPPED
        if (request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus,
                error_code: ErrorCode | None = None,
                error_message: str | None = None) -> None:
        """Take a request out of the engine for good; its blocks are free on return."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.error_code = error_code
        request.error_message = error_message
        request.finished_time = self.clock()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        del self._order_keys[request.request_id]
        self._finished_request_ids.add(request.request_id)
        self.parallel.leave(request)
        # NOTE: after a stop string the held-back text lies past the cut; otherwise flush it.
        if request.detokenizer is not None and not isinstance(request.stop_reason, str):
            request.output_text += request.detokenizer.finish()

    def _make_output(self, request: Request, new_token_ids: list[int],
                     new_logprobs: list) -> EngineCoreOutput:
        """The request's delta since its last output; with the totals when it is finished."""
        text = request.output_text
        if request.is_finished:
            end = len(text)
        else:
            held_back = stop_checker.num_held_back_chars(request.sampling_params)
            end = max(len(text) - held_back, request.num_text_sent)
        output = EngineCoreOutput(request.output_id, new_token_ids,
                                  text[request.num_text_sent:end], new_logprobs,
                                  index=request.index)
        request.num_text_sent = end
        if not request.is_finished:
            return output
        output.finish_reason = request.status.finish_reason
        output.stop_reason = request.stop_reason
        output.error_code = request.error_code
        output.error_message = request.error_message
        output.text = text
        output.usage = Usage(request.num_prompt_tokens, request.num_output_tokens,
                             max(request.num_cached_tokens, 0))
        output.timings = self._timings(request)
        return output

    def _timings(self, request: Request) -> Timings:
        # NOTE: a request that was never scheduled counts its whole life as queue time; one that
        # produced no token has no TTFT, and fewer than two tokens no per-token gap (the wire's
        # `null`s, docs/protocol.md).
        end = request.finished_time
        assert end is not None
        arrival = request.arrival_time
        first_scheduled = end if request.first_scheduled_time is None \
            else request.first_scheduled_time
        first_token = request.first_token_time
        num_gaps = request.num_output_tokens - 1
        return Timings(
            queue=max(0.0, first_scheduled - arrival),
            ttft=None if first_token is None else max(0.0, first_token - arrival),
            e2e=max(0.0, end - arrival),
            per_token=(end - first_token) / num_gaps
            if first_token is not None and num_gaps > 0 else None)
