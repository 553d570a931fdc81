"""EngineCore: scheduler + KV-cache manager + model runner, one `step()` at a time.

After vLLM v1's `EngineCore` (v1/engine/core.py): step = `Scheduler.schedule()` ->
`ModelRunner.execute_model()` -> `Scheduler.update_from_output()`. It runs in-process with no
Redis, so the engine is tested and benchmarked on its own; the worker process wraps it with IO
threads (worker/engine_proc.py), and `llmq generate` drives it directly.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.detokenizer import IncrementalDetokenizer
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.engine.request import Request, RequestStatus
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.scheduler import RequestRejected, Scheduler

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


def check_token_ids(prompt_token_ids: list[int], stop_token_ids: tuple[int, ...],
                    vocab_size: int) -> None:
    """RequestRejected(invalid_token_id) naming the field when an id is outside the vocabulary.

    NOTE: checked before the scheduler: an out-of-vocabulary id reaching the embedding would
    fail the whole step, and with it every request in the batch (vllm-project/vllm#16529).
    """
    for field, ids in (("prompt_token_ids", prompt_token_ids), ("stop_token_ids", stop_token_ids)):
        for bad in (t for t in ids if not 0 <= t < vocab_size):
            raise RequestRejected("invalid_token_id", f"{field}: token id {bad} is outside "
                                  f"the vocabulary [0, {vocab_size})")


class EngineCore:
    def __init__(self, config: EngineConfig, loaded=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # Imported here so `llmq.worker.engine.engine_core` stays cheap to import for type users.
        from llmq.worker.engine.model.default_model import ensure_default_model
        from llmq.worker.engine.model.loader import load_model
        from llmq.worker.engine.model_runner import ModelRunner

        if loaded is None:
            started = time.perf_counter()
            loaded = load_model(config.model or ensure_default_model(), config.dtype,
                                config.weights)
            logger.info("loaded %s in %.1f s", config.model or "default model",
                        time.perf_counter() - started)
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
        self.runner = ModelRunner(loaded.model, num_kv_blocks, config.block_size, config.threads,
                                  eos_token_ids=self.tokenizer.eos_token_ids)
        self.scheduler = Scheduler(self.config, num_kv_blocks, clock=clock)
        logger.info("engine ready: %d KV blocks of %d tokens, max_model_len %d, %d thread(s)",
                    num_kv_blocks, config.block_size, max_model_len, config.threads)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, *, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Queue a request; raises RequestRejected (with a code) when it can never run."""
        # NOTE: empty prompts, duplicate ids and over-long prompts are the scheduler's to refuse.
        check_token_ids(prompt_token_ids, sampling_params.stop_token_ids, self.arch.vocab_size)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids,
            skip_special_tokens=sampling_params.skip_special_tokens)
        request = Request(request_id, prompt_token_ids, sampling_params,
                          eos_token_ids=self.tokenizer.eos_token_ids,
                          arrival_time=self.clock() if arrival_time is None else arrival_time,
                          priority=priority, detokenizer=detokenizer)
        self.scheduler.add_request(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop requests wherever they are; each yields a `cancelled` output on the next step."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(s.num_running, s.num_waiting, s.kv_cache_usage,
                           s.prefix_cache_hit_rate, s.num_preemptions)

    def generate(self, prompts: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams]) -> list[EngineCoreOutput]:
        """Run prompts to completion (offline, like vLLM's LLM.generate); outputs in input order.

        Each returned output is the finished one: `text`, `usage` and `timings` are set and
        `new_token_ids` holds every output token.
        """
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        ids = [f"generate-{i}" for i in range(len(prompts))]
        for request_id, prompt, params in zip(ids, prompts, sampling_params, strict=True):
            self.add_request(request_id, prompt, params)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        finished: dict[str, EngineCoreOutput] = {}
        while len(finished) < len(ids):
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    finished[out.request_id] = out
        results = []
        for request_id in ids:
            out = finished[request_id]
            results.append(dataclasses.replace(out, new_token_ids=tokens[request_id]))
        return results
