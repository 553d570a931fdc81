"""EngineClient: what the worker process needs of the engine, as a typed Protocol.

`EngineCore` (worker/engine/engine_core.py) is the one implementation; tests wrap it (fault
injection) and the worker cannot tell. Only the busy loop calls the methods; the IO threads read
the attributes (the clock, the limits the input processor checks requests against, and the
grammar cache it compiles structured-output specs into), and admission signals `step_interrupt`.
The utility calls of the control stream (worker/utility_calls.py) are vLLM v1 EngineCore's:
reset_prefix_cache, sleep / wake_up, profile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineStats
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.step_interrupt import StepInterrupt
from llmq.worker.engine.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from llmq.worker.engine.lora.lora_manager import LoraManager

__all__ = ["EngineClient"]


class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: Any  # encode / encode_chat / decode (worker/engine/model/tokenizer.py)
    clock: Callable[[], float]  # the engine's monotonic clock; arrival times are on it
    structured_output: StructuredOutputManager  # compiled grammars, shared with the runner
    loras: LoraManager | None  # the LoRA adapters (None: no --lora-dir); the gate loads them
    # admission's `request()` makes a running step with batch work give way to an interactive
    # request; the busy loop's feeder `clear()`s it before draining the inbox
    step_interrupt: StepInterrupt

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_cache_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, *, priority: int = 0,
                    arrival_time: float | None = None, batch: bool = False) -> None: ...

    def abort(self, request_ids: Iterable[str]) -> None: ...

    def step(self) -> list[EngineCoreOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def generate(self, prompts: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams]
                 ) -> list[EngineCoreOutput]: ...

    def reset_prefix_cache(self) -> bool: ...

    def prefix_landmarks(self) -> list[int]: ...

    @property
    def sleep_level(self) -> int: ...

    def sleep(self, level: int = 1) -> int: ...

    def wake_up(self) -> None: ...

    def start_profile(self) -> None: ...

    def stop_profile(self, trace_path: str) -> str: ...
