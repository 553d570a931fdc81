"""InputProcessor: a decoded wire request -> prompt token ids, SamplingParams and priority.

After vLLM v1's `Processor` (v1/engine/processor.py): everything the engine would choke on is
refused here, before the scheduler, with a stable code (RELIABILITY.md decision 4: per-request
errors must never take the engine down; vllm-project/vllm#16529, llama.cpp#12178):

- invalid_request    no prompt tokens, a chat template that fails on the messages, a sampling
                     field out of bounds (the protocol decoder checks them first; this re-check
                     covers values only the engine knows, such as min_tokens vs max_tokens), a
                     `response_format` schema, regex, choice or grammar that cannot compile
                     (compiled here, off the busy loop; the runner finds it in the cache)
- prompt_too_long    prompt + one output token exceed the context (`max_model_len`)
- invalid_token_id   a prompt or stop token id outside the vocabulary

A request whose prompt fits but whose `max_tokens` would run past the context is not refused:
it stops with finish_reason `length` at the context limit, as llama.cpp's server does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from llmq.broker.protocol import Request
from llmq.worker.engine.engine_core import check_structured_output, check_token_ids
from llmq.worker.engine.sampling_params import SamplingParams, StructuredOutputParams
from llmq.worker.engine.scheduler import RequestRejected
from llmq.worker.engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class InputRejected(RequestRejected):
    """RequestRejected plus machine-readable specifics for the error event's `details`."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(code, message)
        self.details = details


@dataclass
class ProcessedInput:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    prompt_texts: list[str]  # the prompt or the messages' contents (fault hooks look at them)


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.structured_output = structured_output or StructuredOutputManager(tokenizer,
                                                                              vocab_size)

    def process(self, request: Request) -> ProcessedInput:
        """Raises RequestRejected(code, message) for a request the engine must never see."""
        prompt_token_ids, texts = self._prompt(request)
        if not prompt_token_ids:
            raise RequestRejected("invalid_request", "the prompt is empty: it has no tokens")
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise InputRejected(
                "prompt_too_long",
                f"prompt has {len(prompt_token_ids)} tokens but the context holds "
                f"{self.max_model_len}: at most {self.max_model_len - 1} prompt tokens",
                {"prompt_tokens": len(prompt_token_ids), "limit": self.max_model_len - 1})
        params = self._sampling_params(request)
        check_token_ids(prompt_token_ids, params.stop_token_ids, self.vocab_size)
        check_structured_output(self.structured_output, params)
        return ProcessedInput(prompt_token_ids, params, request.priority, texts)

    def _prompt(self, request: Request) -> tuple[list[int], list[str]]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids), []
        if request.messages is not None:
            chat = [msgspec.structs.asdict(m) for m in request.messages]
            try:
                ids = self.tokenizer.encode_chat(chat)
            except Exception as e:  # noqa: BLE001 - a template is untrusted code: any failure
                raise RequestRejected("invalid_request",
                                      f"messages: the chat template failed: {e}") from None
            return ids, [str(m.get("content", "")) for m in chat]
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt), [request.prompt]
        raise RequestRejected("invalid_request",
                              "one of prompt, messages or prompt_token_ids is required")

    def _sampling_params(self, request: Request) -> SamplingParams:
        constraint = request.structured_output()
        structured = StructuredOutputParams(*constraint) if constraint else None
        try:
            return SamplingParams(**request.sampling_kwargs(), structured_output=structured)
        except (ValueError, TypeError) as e:
            raise RequestRejected("invalid_request", str(e)) from None

