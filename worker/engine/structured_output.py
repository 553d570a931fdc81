"""StructuredOutputManager: grammars compiled once per spec, a matcher per request, and the
token bitmask applied to the rows that asked for one.

The grammar engine is llguidance (guidance-ai/llguidance), picked over xgrammar on this CPU
(docs/performance.md, "Structured output"): compiling a typical schema takes milliseconds instead
of a second, it refuses JSON-schema keywords it cannot enforce (xgrammar ignored `allOf` and let
invalid documents through), and masks cost ~0.1 ms per row per token. References: vLLM v1's
`v1/structured_output/backend_guidance.py` (a matcher per request, the bitmask filled per row
and applied before sampling), llguidance's `python/llguidance/torch.py` (bitmask layout: bit j
of int32 word i allows token 32 * i + j).

- Compile: `StructuredOutputParams` -> an llguidance grammar, checked against the tokenizer,
  cached (LRU) by a SHA-256 of kind and spec together with a ready matcher that new requests
  deep-copy (16 us instead of ~5 ms to build one). A spec that cannot compile raises
  GrammarError naming the problem; the input processor turns it into `invalid_request`.
- Decode: the model runner keeps one `GrammarMatcher` per constrained request. Each step it
  fills one bitmask row per constrained sampling row, bans the rest of the vocabulary in those
  rows only (unconstrained rows pay nothing), samples, and feeds the sampled token back.
- Preemption by recompute drops the runner's state; the resumed request brings its output
  tokens back, and `matcher()` replays them, which costs ~5 us per token.

Only the model runner's half (`fill_bitmask`, `apply_token_bitmask`) touches tensors; torch is
imported there, so the gate that compiles specs stays light.

JSON is generated without free whitespace, with `", "` and `": "` as separators (what
`json.dumps` writes): small models given free whitespace can emit newlines until max_tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmq.worker.engine.sampling_params import StructuredOutputParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled; the message names the problem."""


class GrammarMatcher:
    """One request's position in its grammar; advances with every token the request accepts."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher  # llguidance.LLMatcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and an error state) if the grammar refuses it."""
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 words, 32 tokens each)."""
        target = bitmask[row]  # [num_words] int32, contiguous
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(),
                                              target.numel() * target.element_size())

    def rollback(self, num_tokens: int) -> bool:
        return self._matcher.rollback(num_tokens)

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete, or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every logit of `logits[rows[i]]` whose bit in `bitmask[i]` is 0.

    NOTE: numpy's unpackbits turns the words into one byte per token at memory speed; the bytes
    of the inverted words are 1 exactly where a token is banned, so they are used as a bool mask
    as they are, with no compare pass over [rows, vocab].
    """
    # NOTE: imported here so that the gate (input processor, engine core) loads no torch.
    import numpy as np
    import torch

    vocab_size = logits.shape[1]
    words = bitmask.numpy().view(np.uint8)  # [num_rows, num_words * 4], little-endian bits
    banned = torch.from_numpy(  # [num_rows, vocab] bool
        np.unpackbits(~words, axis=1, count=vocab_size, bitorder="little")).view(torch.bool)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(banned, float("-inf"))  # every row constrained: one pass
        return
    for i, row in enumerate(rows):
        logits[row].masked_fill_(banned[i], float("-inf"))  # [vocab], in place


class StructuredOutputManager:
    """Compiles specs for one tokenizer and hands out matchers; safe to share between the
    admission thread (which compiles at the gate) and the busy loop (which makes matchers)."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer  # worker/engine/model/tokenizer.py's Tokenizer
        self.vocab_size = vocab_size  # the model's: the bitmask must cover every logit
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None  # built on first use: ~0.4 s for a 49k vocabulary
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> a fresh LLMatcher
        self.num_compiled = 0  # cache misses, for tests and metrics

    @staticmethod
    def cache_key(params: StructuredOutputParams) -> str:
        return hashlib.sha256(f"{params.kind}\0{params.spec}".encode()).hexdigest()

    def compile(self, params: StructuredOutputParams) -> None:
        """Compile (or find in the cache) the grammar of `params`; raises GrammarError."""
        self._template(params)

    def matcher(self, params: StructuredOutputParams,
                output_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the start of the grammar, advanced over tokens already generated (a
        request resumed after preemption); raises GrammarError if those tokens do not fit."""
        matcher = GrammarMatcher(self._template(params).deep_copy())
        for token_id in output_token_ids:
            if not matcher.accept(token_id):
                raise GrammarError(f"generated tokens do not fit the grammar: {matcher.error}")
        return matcher

    # -- internals ------------------------------------------------------------------------------

    def _template(self, params: StructuredOutputParams) -> Any:
        key = self.cache_key(params)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        # NOTE: compiled outside the lock: llguidance drops the GIL while it builds a grammar,
        # and two threads compiling the same spec at once only waste a few milliseconds.
        template = self._build(params)
        with self._lock:
            self._cache[key] = template
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return template

    def _build(self, params: StructuredOutputParams) -> Any:
        import llguidance

        if problem := params.problem():
            raise GrammarError(problem)
        grammar = self._grammar(llguidance, params)
        tokenizer = self._lltokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar,
                                                                                 tokenizer)
        if is_error:
            raise GrammarError(f"{params.kind}: {messages[0].strip()}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{params.kind}: {matcher.get_error().strip()}")
        return matcher

    @staticmethod
    def _grammar(llguidance: Any, params: StructuredOutputParams) -> str:
        kind, spec = params.kind, params.spec
        try:
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_OPTIONS)
            if kind == "json_schema":
                schema = json.loads(spec)
                if not isinstance(schema, dict | bool):
                    raise GrammarError("json_schema: a schema is a JSON object (or a boolean), "
                                       f"got {type(schema).__name__}")
                return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec)
            if kind == "choice":
                choices = json.loads(spec)
                if (not isinstance(choices, list) or not choices
                        or not all(isinstance(c, str) and c for c in choices)):
                    raise GrammarError("choice: a non-empty list of non-empty strings is needed")
                # NOTE: JSON string literals are valid Lark string literals (llguidance's own
                # `grammar_from("choice", ...)` writes them the same way).
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in choices))
            return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
        except GrammarError:
            raise
        except ValueError as e:  # json.JSONDecodeError, GBNF conversion errors
            raise GrammarError(f"{kind}: {e}") from None

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_TokenizerSource(self.tokenizer,
                                                                 self.vocab_size)),
                    eos_token=sorted(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer


class _TokenizerSource:
    """What llguidance's TokenizerWrapper reads from a tokenizer: the bytes of every token,
    special ones marked with a leading 0xFF (so the grammar never matches their text), and a
    function that tokenizes text."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        special = tokenizer.special_token_ids
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = [b"\xff" + data if i in special else data
                       for i, data in enumerate(tokenizer.token_bytes)]
        # NOTE: ids the model has beyond the tokenizer's vocabulary (padding) are never allowed.
        self.tokens += [b"\xff<pad_%d>" % i for i in range(len(self.tokens), vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)
