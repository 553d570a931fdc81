"""InputProcessor, the one gate: a wire request -> prompt token ids, SamplingParams, priority.

After vLLM v1's `Processor` (v1/engine/processor.py): everything the engine would choke on is
refused here, before the scheduler, with a stable code (docs/reliability.md, decision 4: per-request
errors must never take the engine down; vllm-project/vllm#16529, llama.cpp#12178). The engine
and its scheduler trust what passes: they check nothing again.

- invalid_request    no prompt tokens, a chat template that fails on the messages, a sampling
                     field out of bounds (the protocol decoder checks them first; this re-check
                     covers values only the engine knows, such as min_tokens vs max_tokens), `n`
                     above the engine's `max_num_seqs` (the completions of one prompt run side by
                     side), a `response_format` schema, regex, choice or grammar that cannot
                     compile (compiled here, off the busy loop; the runner finds it in the cache)
- prompt_too_long    prompt + one output token exceed the context (`max_model_len`) or the KV
                     cache (a request running alone must always fit, so preemption makes progress)
- invalid_token_id   a prompt, stop, `logit_bias` or `allowed_token_ids` id outside the vocabulary
- invalid_request    also: a `lora` adapter (or a `model` naming one) that is unknown, corrupt,
                     for another base model or above max_lora_rank (loaded here on first use,
                     so the engine never reads a file), or any `lora` on an engine without an
                     adapter directory

`bad_words` become token ids here (worker/engine/bad_words.py). A `tokenize` or
`detokenize` task needs no room in the context: only its ids are checked.

Special-token text in a prompt or in message content is encoded as text: only the chat
template's own markers become control tokens, so content cannot forge a system turn
(`allow_special_tokens` on the request lets a trusted caller opt out).

- prompt_too_long    also: prompt + `max_tokens` exceed the context, as vLLM and OpenAI refuse
                     it (docs/protocol.md); a request without `max_tokens` gets 256 or what
                     room the context leaves, as vLLM's default; the scheduler still stops a
                     request at the context for the callers that skip this gate
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from llmq.protocol import Request
from llmq.protocol.errors import ErrorCode, RequestRejected
from llmq.worker.engine.bad_words import bad_word_token_ids
from llmq.worker.engine.lora.lora_error import LoraError
from llmq.worker.engine.sampling_params import SamplingParams, StructuredOutputParams
from llmq.worker.engine.structured_output import GrammarError, StructuredOutputManager
from llmq.worker.engine.tool_prompt import chat_for_template

if TYPE_CHECKING:
    from llmq.worker.engine.config import EngineConfig
    from llmq.worker.engine.lora.adapter import LoraAdapter
    from llmq.worker.engine.lora.lora_manager import LoraManager

logger = logging.getLogger(__name__)


class PromptTokenizer(Protocol):
    """What the gate needs of a tokenizer (worker/engine/model/tokenizer.py)."""

    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True, *,
               split_special_tokens: bool = False) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    allow_special_tokens: bool = False, **variables: Any) -> list[int]: ...


class GatedEngine(Protocol):
    """What `InputProcessor.for_engine` reads of an engine: `EngineCore`, or the worker's view
    of one (worker/engine_client.py)."""

    @property
    def tokenizer(self) -> PromptTokenizer: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def structured_output(self) -> StructuredOutputManager: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_cache_tokens(self) -> int: ...

    @property
    def loras(self) -> LoraManager | None: ...


@dataclass
class ProcessedInput:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int


class InputProcessor:
    """`max_model_len` is the context the engine was configured with; `kv_cache_tokens` the
    tokens its KV cache holds (None: unbounded). A prompt must leave room for one output token
    in both. `max_num_seqs` bounds `n` (None: unbounded); `structured_output` is the engine's
    grammar cache, so what compiles here is what its runner uses."""

    def __init__(self, tokenizer: PromptTokenizer | None, *, vocab_size: int, max_model_len: int,
                 kv_cache_tokens: int | None = None, max_num_seqs: int | None = None,
                 structured_output: StructuredOutputManager | None = None,
                 loras: LoraManager | None = None) -> None:
        self.tokenizer = tokenizer
        self.loras = loras
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens
        self.max_num_seqs = max_num_seqs
        self.structured_output = structured_output or StructuredOutputManager(tokenizer,
                                                                              vocab_size)

    @classmethod
    def for_engine(cls, engine: GatedEngine) -> InputProcessor:
        # NOTE: the configured context and the KV capacity, not their minimum
        # (`engine.max_model_len`), so a refusal names the limit that bit.
        return cls(engine.tokenizer, vocab_size=engine.vocab_size,
                   max_model_len=engine.config.max_model_len or engine.max_model_len,
                   kv_cache_tokens=engine.kv_cache_tokens,
                   max_num_seqs=engine.config.max_num_seqs,
                   structured_output=engine.structured_output, loras=engine.loras)

    def process(self, request: Request) -> ProcessedInput:
        """Raises RequestRejected(code, message) for a request the engine must never see."""
        prompt_token_ids = self._prompt(request)
        if request.task in ("tokenize", "detokenize"):  # no forward pass: any length is fine
            if self.tokenizer is None:
                raise RequestRejected(ErrorCode.INVALID_REQUEST, "task detokenize: this engine "
                                      "has no tokenizer")
            self.check_token_ids(prompt_token_ids, ())
            return ProcessedInput(prompt_token_ids, SamplingParams(task=request.task),
                                  request.priority)
        self.check_prompt(prompt_token_ids)
        params = self._sampling_params(request)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words(params))
        if request.max_tokens is None:  # the default: as many as fit, up to DEFAULT_MAX_TOKENS
            room = self.max_model_len - len(prompt_token_ids)
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room),
                                         min_tokens=min(params.min_tokens, room))
        self.check_room(len(prompt_token_ids), params.max_tokens)
        self.check_token_ids(prompt_token_ids, params.stop_token_ids)
        self._check_logits_token_ids(params)
        self.check_sampling_params(params)
        if (lora := self.lora_name(request)) is not None:
            params = dataclasses.replace(params, lora=self.lora(lora))
        return ProcessedInput(prompt_token_ids, params, request.priority)

    def lora_name(self, request: Request) -> str | None:
        """The adapter the request runs under: `lora`, or else a `model` that names an adapter
        of the directory (how vLLM's OpenAI server, and llmq's gateway, name adapters)."""
        if request.lora is not None:
            return request.lora
        if request.model and self.loras is not None and self.loras.exists(request.model):
            return request.model
        return None

    def lora(self, name: str) -> LoraAdapter:
        """The adapter `name`, loaded on first use; RequestRejected(invalid_request) naming it
        and the problem when this engine cannot serve it."""
        if self.loras is None:
            raise RequestRejected(ErrorCode.INVALID_REQUEST,
                                  f"lora {name!r}: this worker serves no LoRA adapters (it has "
                                  "no --lora-dir)")
        try:
            return self.loras.get(name)
        except LoraError as e:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(e)) from None

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """RequestRejected when the prompt is empty or leaves no room for one output token."""
        num_prompt = len(prompt_token_ids)
        if not num_prompt:
            raise RequestRejected(ErrorCode.INVALID_REQUEST,
                                  "the prompt is empty: it has no tokens")
        if num_prompt + 1 > self.max_model_len:
            limit = self.max_model_len
            why = f"max_model_len is {limit}"
        elif self.kv_cache_tokens is not None and num_prompt > self.kv_cache_tokens:
            limit = self.kv_cache_tokens + 1
            why = f"the KV cache holds at most {self.kv_cache_tokens} tokens"
        else:
            return
        raise RequestRejected(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt has {num_prompt} tokens but {why}: at most {limit - 1} prompt tokens leave "
            "room for one output token", {"prompt_tokens": num_prompt, "limit": limit - 1})

    def check_room(self, num_prompt: int, max_tokens: int) -> None:
        """RequestRejected(prompt_too_long) when the prompt and `max_tokens` exceed the context."""
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {num_prompt} tokens and max_tokens is {max_tokens}, together more "
                f"than max_model_len {self.max_model_len}: lower max_tokens to at most "
                f"{self.max_model_len - num_prompt} or shorten the prompt",
                {"prompt_tokens": num_prompt, "limit": self.max_model_len - max_tokens})

    def check_token_ids(self, prompt_token_ids: list[int], stop_token_ids: tuple[int, ...]) -> None:
        """RequestRejected(invalid_token_id) naming the field when an id is outside the vocabulary.

        NOTE: an out-of-vocabulary id reaching the embedding would fail the whole step, and with
        it every request in the batch (vllm-project/vllm#16529).
        """
        for field, ids in (("prompt_token_ids", prompt_token_ids),
                           ("stop_token_ids", stop_token_ids)):
            for bad in (t for t in ids if not 0 <= t < self.vocab_size):
                raise RequestRejected(ErrorCode.INVALID_TOKEN_ID,
                                      f"{field}: token id {bad} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")

    def _check_logits_token_ids(self, params: SamplingParams) -> None:
        for field, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                           ("allowed_token_ids", params.allowed_token_ids or ())):
            for bad in (t for t in ids if not 0 <= t < self.vocab_size):
                raise RequestRejected(ErrorCode.INVALID_TOKEN_ID,
                                      f"{field}: token id {bad} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise RequestRejected(ErrorCode.INVALID_REQUEST,
                                  "bad_words: this engine has no tokenizer")
        return bad_word_token_ids(params.bad_words,
                                  lambda text: tokenizer.encode(text, add_special_tokens=False))

    def check_sampling_params(self, params: SamplingParams) -> None:
        """RequestRejected(invalid_request) when `n` exceeds max_num_seqs, or naming the problem
        when the schema, regex, choices or grammar cannot compile (compiled ones stay cached
        for the model runner)."""
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            raise RequestRejected(ErrorCode.INVALID_REQUEST,
                                  f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}: "
                                  "the completions of one prompt run side by side")
        if params.structured_output is None:
            return
        try:
            self.structured_output.compile(params.structured_output)
        except GrammarError as e:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(e)) from None

    def _prompt(self, request: Request) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if self.tokenizer is None:
            raise RequestRejected(ErrorCode.INVALID_REQUEST,
                                  "this engine takes prompt_token_ids only (no tokenizer)")
        if request.messages is not None:
            chat, tools = chat_for_template(
                self.tokenizer.chat_template, msgspec.to_builtins(request.messages),
                None if request.tools is None else msgspec.to_builtins(request.tools))
            variables = {**(request.chat_template_kwargs or {}),
                         **({} if tools is None else {"tools": tools})}
            if request.continue_final_message:  # NOTE: only then: not every tokenizer takes it
                variables["continue_final_message"] = True
            try:
                return self.tokenizer.encode_chat(
                    chat, request.add_generation_prompt,
                    allow_special_tokens=request.allow_special_tokens, **variables)
            except Exception as e:  # noqa: BLE001 - a template is untrusted code: any failure
                raise RequestRejected(ErrorCode.INVALID_REQUEST,
                                      f"messages: the chat template failed: {e}") from None
        if request.prompt is not None:
            # NOTE: special-token text in a prompt is text (`<|im_start|>` cannot open a turn)
            # unless the caller is trusted with them (`allow_special_tokens`).
            return self.tokenizer.encode(request.prompt, request.add_special_tokens,
                                         split_special_tokens=not request.allow_special_tokens)
        raise RequestRejected(ErrorCode.INVALID_REQUEST,
                              "one of prompt, messages or prompt_token_ids is required")

    @staticmethod
    def _sampling_params(request: Request) -> SamplingParams:
        constraint = request.structured_output()
        structured = StructuredOutputParams(*constraint) if constraint else None
        try:
            return SamplingParams(**request.sampling_kwargs(), structured_output=structured)
        except (ValueError, TypeError) as e:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(e)) from None
