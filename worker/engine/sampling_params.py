"""Per-request sampling and stopping parameters, as the engine sees them.

Mirrors vLLM's `SamplingParams` names. The wire request (`llmq.protocol`) is checked
field by field before it becomes one of these; `__post_init__` re-checks so in-process users
(`llmq generate`, tests) get the same clear errors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmq.worker.engine.lora.adapter import LoraAdapter

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
MAX_N = 64  # completions of one prompt; the scheduler also caps it at max_num_seqs
MAX_LOGIT_BIAS_VALUE = 100.0
TASKS = ("generate", "embed", "tokenize", "detokenize")
STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputParams:
    """A constraint on the output text, compiled by worker/engine/structured_output.py.

    `spec` is text for every kind, so the params stay hashable and the compile cache can key on
    it: the JSON schema as JSON, the regex, the choices as a JSON list of strings, or the Lark /
    GBNF grammar. `json_object` needs no spec (any JSON object).
    """

    kind: str
    spec: str = ""

    def problem(self) -> str | None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            return f"structured output kind must be one of {STRUCTURED_OUTPUT_KINDS}, " \
                   f"got {self.kind!r}"
        if self.kind != "json_object" and not self.spec:
            return f"structured output of kind {self.kind} needs a non-empty spec"
        return None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1 disables
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # 0 disables
    seed: int | None = None  # per-request: the same seed gives the same tokens whatever the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 disables
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: plus the top n
    skip_special_tokens: bool = True
    n: int = 1  # completions of the prompt, sampled in parallel over its shared KV blocks
    structured_output: StructuredOutputParams | None = None
    # False opts out of speculative decoding (when the worker runs it): same tokens either way,
    # but a request that must spend no compute on drafts can say so.
    speculative: bool = True
    # vLLM's logits extras (worker/engine/logits_adjustments.py): (token id, bias) pairs; the
    # only ids that may be sampled (None: all); words that may not be generated, and their
    # token ids (filled in by the gate, which has the tokenizer)
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs, plus the top n at each
    task: str = "generate"  # or answered from the prompt alone: embed, tokenize, detokenize
    # The LoRA adapter the request runs under (None: the base model), resolved by the gate
    # (input_processor.py); holding it keeps it alive while the request runs, whatever the LRU.
    lora: LoraAdapter | None = None

    def __post_init__(self) -> None:
        # NOTE: tuples keep the struct hashable and frozen even when callers pass lists.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(
            (int(t), float(b)) for t, b in (self.logit_bias.items() if isinstance(
                self.logit_bias, dict) else self.logit_bias)))
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problem(self) -> str | None:
        """The first invalid field, described for a user; None when every field is in bounds."""
        def finite(name: str, value: float) -> str | None:
            return None if math.isfinite(value) else f"{name} must be a finite number, got {value}"

        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            if msg := finite(name, getattr(self, name)):
                return msg
        if self.max_tokens < 1:
            return f"max_tokens must be >= 1, got {self.max_tokens}"
        if self.temperature < 0:
            return f"temperature must be >= 0, got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be >= 0 (0 disables it), got {self.top_k}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if not -2.0 <= self.presence_penalty <= 2.0:
            return f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
        if not -2.0 <= self.frequency_penalty <= 2.0:
            return f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
        if not 0.0 < self.repetition_penalty <= 2.0:
            return f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            return f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
        if len(self.stop) > MAX_STOP_STRINGS:
            return f"stop has {len(self.stop)} strings, at most {MAX_STOP_STRINGS} allowed"
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_LEN:
                return f"stop strings must be 1..{MAX_STOP_STRING_LEN} characters, got {s!r:.40}"
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            return f"stop_token_ids has {len(self.stop_token_ids)} ids, at most {MAX_STOP_STRINGS}"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return f"seed must be in [0, 2**63), got {self.seed}"
        if not 1 <= self.n <= MAX_N:
            return f"n must be in [1, {MAX_N}], got {self.n}"
        if problem := self._logits_problem():
            return problem
        if self.structured_output is not None:
            if problem := self.structured_output.problem():
                return problem
            if self.ignore_eos:
                # NOTE: a finished grammar allows only EOS; ignoring it would pad the output with
                # EOS tokens up to max_tokens.
                return "ignore_eos cannot be combined with structured output: the grammar ends " \
                       "the output with EOS"
        return None

    def _logits_problem(self) -> str | None:
        for token_id, bias in self.logit_bias:
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS_VALUE):
                return f"logit_bias: the bias of token {token_id} must be in " \
                       f"[-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {bias}"
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            return "allowed_token_ids must not be empty (None allows every token)"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            return f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
        if self.task not in TASKS:
            return f"task must be one of {TASKS}, got {self.task!r}"
        return None

    def for_child(self, index: int) -> SamplingParams:
        """The params of completion `index` of an n > 1 request: one completion each, and a seed
        stream of its own (seed + index, as vLLM derives it), so a child draws exactly what a
        request with that seed would draw alone."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return dataclasses.replace(self, n=1, seed=seed)
