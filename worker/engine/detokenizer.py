"""IncrementalDetokenizer: streamed text of a request's output tokens, a few bytes at a time.

Reference: vLLM's incremental detokenizer (`v1/engine/detokenizer.py`,
`transformers_utils/detokenizer_utils.py`), which re-decodes a sliding window of tokens with the
tokenizer and holds text back while it ends in U+FFFD. Here each token id maps to its bytes once,
at tokenizer load (`Tokenizer.token_bytes`, as llama.cpp's `token_to_piece` cache does), so a step
costs a list lookup per token and a decode of the new bytes only (~0.6 us per token here,
against ~20 us to re-decode a window with the tokenizers library). The bytes of a character that
byte-level BPE split across tokens (emoji, CJK) are held back until the character is complete.

Invariant: the deltas of `update` followed by `finish()` concatenate to exactly
`tokenizer.decode(output_token_ids, skip_special_tokens)`, U+FFFD replacements included.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmq.worker.engine.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _complete_length(data: bytes) -> int:
    """How many leading bytes of `data` decode the same whatever bytes come next.

    Only a trailing incomplete-but-valid UTF-8 sequence (a lead byte and at most two fitting
    continuation bytes) can still change; everything else, invalid bytes included, is final:
    the decoder replaces them with U+FFFD whatever follows.
    """
    n = len(data)
    if n == 0 or data[-1] < 0x80:
        return n
    # An incomplete sequence is at most 3 bytes: look back that far for its lead byte.
    start = n - 1
    while start > max(n - 3, 0) and 0x80 <= data[start] < 0xC0:
        start -= 1
    lead = data[start]
    if 0xC2 <= lead <= 0xDF:
        needed = 2
    elif 0xE0 <= lead <= 0xEF:
        needed = 3
    elif 0xF0 <= lead <= 0xF4:
        needed = 4
    else:
        return n  # a stray continuation byte or an impossible lead: already an error
    have = n - start
    if have >= needed:
        return n
    if have >= 2:
        # The second byte's range is narrower after these leads (RFC 3629; no overlongs or
        # surrogates): outside it the sequence is already invalid.
        second = data[start + 1]
        low = 0xA0 if lead == 0xE0 else 0x90 if lead == 0xF0 else 0x80
        high = 0x9F if lead == 0xED else 0x8F if lead == 0xF4 else 0xBF
        if not low <= second <= high:
            return n
    return start


class IncrementalDetokenizer:
    """Implements worker.request.Detokenizer for one request.

    `prompt_token_ids` is accepted for the protocol's sake and ignored: a token's bytes do not
    depend on its neighbours, and the streamed text is defined as the decode of the output ids
    alone (so a SentencePiece model's first output token loses its leading space, as in
    `Tokenizer.decode`).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._token_bytes = tokenizer.token_bytes
        self._vocab_size = len(tokenizer.token_bytes)
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._strip_leading_space = tokenizer.strip_leading_space
        self._pending = b""  # bytes of a character not yet complete
        self._no_text_yet = True

    def update(self, new_token_ids: list[int]) -> str:
        """Text the new tokens complete; never half a UTF-8 character."""
        table, size, skipped = self._token_bytes, self._vocab_size, self._skipped_ids
        parts = [self._pending]
        for token_id in new_token_ids:
            if token_id not in skipped and 0 <= token_id < size:
                parts.append(table[token_id])
        data = b"".join(parts)
        cut = _complete_length(data)
        self._pending = data[cut:]
        return self._emit(data[:cut])

    def finish(self) -> str:
        """Whatever is still held back; an unfinished character becomes U+FFFD, as in decode."""
        data, self._pending = self._pending, b""
        return self._emit(data)

    def _emit(self, data: bytes) -> str:
        if not data:
            return ""
        text = data.decode("utf-8", errors="replace")
        if self._no_text_yet:
            self._no_text_yet = False
            if self._strip_leading_space and text.startswith(" "):
                text = text[1:]
        return text
