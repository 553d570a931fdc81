"""EngineCore: scheduler + KV-cache manager + model runner, one `step()` at a time.

After vLLM v1's `EngineCore` (v1/engine/core.py): step = `Scheduler.schedule()` ->
`ModelRunner.execute_model()` -> `Scheduler.update_from_output()`. It runs in-process with no
Redis, so the engine is tested and benchmarked on its own; the worker process wraps it with IO
threads (worker/worker.py), and `llmq generate` drives it directly.

It trusts what it is given: requests pass the one gate, `InputProcessor`
(worker/engine/input_processor.py), before `add_request`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmq.protocol.token_text import token_text
from llmq.worker.engine import lane_priority
from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.detokenizer import IncrementalDetokenizer
from llmq.worker.engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from llmq.worker.engine.prompt_tasks import PromptTasks
from llmq.worker.engine.request import Request, RequestStatus
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.scheduler import Scheduler
from llmq.worker.engine.step_interrupt import PausedStep, StepInterrupt
from llmq.worker.engine.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from llmq.worker.engine.lora.lora_manager import LoraManager
    from llmq.worker.engine.model.loader import LoadedModel
    from llmq.worker.engine.model_runner import PausedForward
    from llmq.worker.engine.spec_decode.draft_speculator import DraftModelSpeculator

logger = logging.getLogger(__name__)

# NOTE: SmolLM2 and friends advertise 8k+ contexts; capping the default keeps one request from
# claiming the whole KV budget of a CPU worker. `max_model_len` raises it explicitly.
DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    prefix_cache_hit_rate: float
    num_preemptions: int
    # Speculative decoding totals since the engine started (0 when it is off).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Batch steps paused for an interactive arrival, and those of them dropped (a request of
    # theirs preempted or aborted meanwhile) instead of resumed (step_interrupt.py).
    num_steps_paused: int = 0
    num_steps_dropped: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Fraction of draft tokens the target model accepted."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens \
            if self.spec_num_draft_tokens else 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 draft: LoadedModel | None = None) -> None:
        """`loaded` / `draft`: the model and the draft model already loaded (tests share
        them); by default `config.model` and `config.draft_model` are loaded here."""
        # Imported here so `llmq.worker.engine.engine_core` stays cheap to import for type users.
        from llmq.worker.engine.model.default_model import ensure_default_model
        from llmq.worker.engine.model.loader import load_model
        from llmq.worker.engine.model_runner import ModelRunner

        if loaded is None:
            import torch

            # NOTE: the steps' thread count before loading: the kernel forms are measured
            # (model/form_choice.py) on the threads the steps run on
            torch.set_num_threads(config.threads)
            started = time.perf_counter()
            loaded = load_model(config.model or ensure_default_model(), config.dtype,
                                config.weights, config.batch_invariant)
            logger.info("loaded %s in %.1f s", config.model or "default model",
                        time.perf_counter() - started)
        if config.batch_invariant and not loaded.model.batch_invariant:
            loaded.model.make_batch_invariant()  # a model the caller loaded is switched here
        self.tokenizer = loaded.tokenizer
        self.arch = loaded.arch
        max_model_len = config.max_model_len or min(
            loaded.arch.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
        self.config = dataclasses.replace(config, max_model_len=max_model_len)
        # NOTE: at least 2: block 0 is the padding block block tables are filled with.
        num_kv_blocks = config.num_kv_blocks or max(
            2, config.kv_cache_memory_bytes // loaded.model.kv_cache_bytes_per_block(
                config.block_size))
        self.clock = clock
        self.structured_output = StructuredOutputManager(self.tokenizer, loaded.arch.vocab_size)
        self.runner = ModelRunner(loaded.model, num_kv_blocks, config.block_size, config.threads,
                                  eos_token_ids=self.tokenizer.eos_token_ids,
                                  structured_output=self.structured_output)
        # A draft model's speculator (None for prompt lookup or none): it drafts before each
        # step's scheduling (worker/engine/spec_decode/draft_speculator.py).
        self.draft_speculator: DraftModelSpeculator | None = None
        if config.speculative_method == "draft":
            from llmq.worker.engine.spec_decode.draft_speculator import build_draft_speculator

            self.draft_speculator = build_draft_speculator(self.config, loaded, num_kv_blocks,
                                                           draft)
        self.scheduler = Scheduler(self.config, num_kv_blocks, clock=clock)
        if self.draft_speculator is not None:  # in place of the prompt-lookup one it made
            self.scheduler.speculator = self.draft_speculator
        # set from the worker's admission thread when an interactive request arrives: a running
        # step with batch work pauses for it (worker/engine/step_interrupt.py)
        self.step_interrupt = StepInterrupt()
        self._paused: PausedStep | None = None
        # LoRA adapters, loaded by the gate on first use (None: no adapter directory)
        self.loras: LoraManager | None = None
        if config.lora_dir:
            # NOTE: imported only here: its adapter loaders are ~0.1 s of a worker's start
            from llmq.worker.engine.lora.lora_manager import LoraManager

            self.loras = LoraManager(config.lora_dir, loaded.arch, config.max_loras,
                                     config.max_lora_rank)
        # a model whose every layer slides (Mistral) frees the blocks that fall out of its window
        self.scheduler.kv_cache_manager.sliding_window = loaded.arch.cache_window
        self._profiler: Any = None  # torch.profiler.profile while `start_profile` records
        # embed / tokenize / detokenize requests, and prompt logprobs: answered from the prompt
        self.prompt_tasks = PromptTasks(lambda: self.runner.model, self.tokenizer,
                                        max_model_len, clock, loaded.arch.pooling)
        logger.info("engine ready: %d KV blocks of %d tokens, max_model_len %d, %d thread(s)",
                    num_kv_blocks, config.block_size, max_model_len, config.threads)

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + output tokens) this engine runs: the configured context,
        capped by what the KV cache holds."""
        return self.scheduler.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds (a request never stores its last token's KV)."""
        return self.scheduler.kv_capacity_tokens

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, *, priority: int = 0,
                    arrival_time: float | None = None, batch: bool = False) -> None:
        """Queue a request that passed `InputProcessor`; nothing is checked again here."""
        arrival_time = self.clock() if arrival_time is None else arrival_time
        if sampling_params.task != "generate":  # answered from the prompt alone, next step
            self.prompt_tasks.add(request_id, prompt_token_ids, sampling_params, arrival_time)
            return
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids,
            skip_special_tokens=sampling_params.skip_special_tokens)
        request = Request(request_id, prompt_token_ids, sampling_params,
                          eos_token_ids=self.tokenizer.eos_token_ids,
                          arrival_time=arrival_time,
                          priority=priority, detokenizer=detokenizer)
        request.batch = batch
        self.scheduler.add_request(request)
        if sampling_params.prompt_logprobs is not None:  # delivered with its choice 0's end
            self.prompt_tasks.score_prompt(request_id, prompt_token_ids,
                                           sampling_params.prompt_logprobs)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop requests wherever they are; each yields a `cancelled` output on the next step."""
        request_ids = list(request_ids)
        self.prompt_tasks.abort(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        """One step: a new one, or one beside a paused step while an interactive request is
        starting, or the paused step's remaining layers (worker/engine/step_interrupt.py)."""
        if self.draft_speculator is not None:  # a draft model's drafts, batched
            # NOTE: a paused step keeps the drafts it was scheduled with; drafts made now for
            # its requests are the same tokens (`take` hands out only drafts for a request's
            # tokens as they are)
            self.draft_speculator.prepare(self.scheduler.running, self.max_model_len)
        outputs = self._step_beside(self._paused) if self._paused is not None else \
            self._run(self.scheduler.schedule(), pausable=True)
        if self.draft_speculator is not None:  # finished requests' draft KV goes now
            self.draft_speculator.proposer.retain({r.request_id for r in self.scheduler.running})
        outputs += self.prompt_tasks.step()
        self.prompt_tasks.attach(outputs)
        if self.tokenizer is not None:
            _name_tokens(outputs, self.tokenizer.token_bytes)
        return outputs

    def _run(self, scheduler_output: SchedulerOutput, pausable: bool,
             paused: PausedForward | None = None) -> list[EngineCoreOutput]:
        """Run a scheduled step (or resume `paused`, its paused forward pass) and advance the
        scheduler, or keep it paused: an interactive request arrived while it ran."""
        requests = self.scheduler.requests
        check = self.step_interrupt.pause_check(pausable and any(
            requests[request_id].batch for request_id in scheduler_output.num_scheduled_tokens))
        result = self.runner.execute_model(scheduler_output, check) if paused is None \
            else self.runner.resume(paused, check)
        if not isinstance(result, ModelRunnerOutput):  # a PausedForward
            self._paused = PausedStep.of(scheduler_output, result, requests)
            self.step_interrupt.num_paused += 1
            logger.debug("step paused after %d layer(s) for an interactive request",
                         result.num_layers_done)
            return self.scheduler.take_finished_outputs()
        return self.scheduler.update_from_output(scheduler_output, result)

    def _step_beside(self, paused: PausedStep) -> list[EngineCoreOutput]:
        """With a step paused: a step of the interactive requests starting beside it, while
        any is, and then the rest of it; or, if it cannot resume, a new step in its place."""
        self._paused = None
        scheduler = self.scheduler
        outputs: list[EngineCoreOutput] = []
        if paused.intact(scheduler.requests) and lane_priority.interactive_starting(
                scheduler.waiting, scheduler.running, paused.request_ids):
            beside = scheduler.schedule(paused.request_ids)
            self._paused = paused  # kept across this step: none of its requests is in it
            outputs = self._run(beside, pausable=False)
            if beside.total_num_scheduled_tokens:
                return outputs
            self._paused = None  # NOTE: nothing could run beside it (no room yet): it goes on
        if not paused.intact(scheduler.requests):
            # NOTE: a request of it was preempted or aborted meanwhile, its blocks maybe
            # someone else's now: it is dropped, which is exact (step_interrupt.py), and its
            # other requests are scheduled again.
            paused.forward.drop()
            self.step_interrupt.num_dropped += 1
            return outputs + self._run(scheduler.schedule(), pausable=True)
        return outputs + self._run(paused.scheduler_output, pausable=True,
                                   paused=paused.forward)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.prompt_tasks.has_pending

    # -- utility calls (vLLM v1 EngineCore's reset_prefix_cache, sleep, wake_up, profile) ------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing changed) while requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    @property
    def sleep_level(self) -> int:
        """0 when awake; 1 when the KV cache is freed; 2 when the weights are too."""
        return self.runner.sleep_level

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 2: the weights as well); bytes freed. Every request must be
        finished or aborted first: nothing can run until `wake_up`."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.has_unfinished_requests():
            raise RuntimeError("requests are still in the engine: abort them first")
        # NOTE: the cached prefixes point into the KV cache that is about to go.
        self.reset_prefix_cache()
        if self.draft_speculator is not None:
            self.draft_speculator.proposer.sleep()
        return self.runner.sleep(level)

    def wake_up(self) -> None:
        """Reallocate what `sleep` freed (reloading the weights after level 2)."""
        if self.runner.sleep_level == 2:
            from llmq.worker.engine.model.default_model import ensure_default_model
            from llmq.worker.engine.model.loader import load_model

            loaded = load_model(self.config.model or ensure_default_model(), self.config.dtype,
                                self.config.weights, self.config.batch_invariant)
            self.runner.wake_up(loaded.model)
        else:
            self.runner.wake_up()
        if self.draft_speculator is not None:
            self.draft_speculator.proposer.wake_up()

    def start_profile(self) -> None:
        """Record torch operator timings of every step until `stop_profile`."""
        import torch.profiler

        if self._profiler is not None:
            raise RuntimeError("the profiler is already running")
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self._profiler.start()

    def stop_profile(self, trace_path: str) -> str:
        """Stop the profiler and write its Chrome trace (chrome://tracing, Perfetto) there."""
        if self._profiler is None:
            raise RuntimeError("the profiler is not running")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        profiler.export_chrome_trace(trace_path)
        return trace_path

    def stats(self) -> EngineStats:
        s = self.scheduler
        stats = EngineStats(s.num_running, s.num_waiting, s.kv_cache_usage,
                            s.prefix_cache_hit_rate, s.num_preemptions)
        if s.speculator is not None:
            spec = s.speculator.stats
            stats.spec_num_drafts = spec.num_drafts
            stats.spec_num_draft_tokens = spec.num_draft_tokens
            stats.spec_num_accepted_tokens = spec.num_accepted_tokens
        stats.num_steps_paused = self.step_interrupt.num_paused
        stats.num_steps_dropped = self.step_interrupt.num_dropped
        return stats

    def prefix_landmarks(self) -> list[int]:
        """What the prefix cache holds, as landmark hashes (worker/engine/prefix_landmarks.py)."""
        return self.scheduler.kv_cache_manager.cached_landmarks()

    def generate(self, prompts: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams]) -> list[EngineCoreOutput]:
        """Run prompts to completion (offline, like vLLM's LLM.generate); outputs in input order.

        Each returned output is the finished one: `text`, `usage` and `timings` are set and
        `new_token_ids` holds every output token. A prompt with n > 1 gives n outputs in a row,
        by `index`.
        """
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        keys = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            self.add_request(f"generate-{i}", prompt, params)
            keys += [(f"generate-{i}", index) for index in range(params.n)]
        tokens: dict[tuple[str, int], list[int]] = {key: [] for key in keys}
        finished: dict[tuple[str, int], EngineCoreOutput] = {}
        while len(finished) < len(keys):
            for out in self.step():
                key = (out.request_id, out.index)
                tokens[key].extend(out.new_token_ids)
                if out.finished:
                    finished[key] = out
        return [dataclasses.replace(finished[key], new_token_ids=tokens[key]) for key in keys]


def _name_tokens(outputs: list[EngineCoreOutput], vocabulary: list[bytes]) -> None:
    """Each new logprob's tokens named by their text.

    NOTE: here, where the tokenizer is: the gateway has none, and OpenAI's logprobs carry each
    token's text and bytes.
    """
    for output in outputs:
        for lp in output.new_logprobs:
            lp.token = token_text(vocabulary[lp.token_id])
            lp.top_tokens = [token_text(vocabulary[t]) for t in lp.top_token_ids]
