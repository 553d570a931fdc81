"""LogitsAdjustments: vLLM's `allowed_token_ids`, `bad_words` and `logit_bias` on a step's logits.

References: vLLM v1 `v1/sample/sampler.py` (the order: allowed token ids, then bad words, then
logit bias, all before penalties and temperature), `v1/sample/ops/bad_words.py` (a bad word's
last token is banned when the output so far ends with the rest of the word; a one-token word is
banned always), `v1/sample/logits_processor` (`LogitBiasLogitsProcessor`: the bias is added to
the logit). Like `SamplingMetadata`, everything is decided on the host from the rows' params and
output histories, so a verification row of speculative decoding, whose history includes the
draft tokens before it, is adjusted exactly as the same token sampled alone would be.

Log-probabilities are taken after these adjustments (as after penalties, see
worker/engine/sampler.py): a token banned here reports -inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmq.worker.engine.sampling_params import SamplingParams

__all__ = ["LogitsAdjustments", "bad_word_token_ids"]


@dataclass
class LogitsAdjustments:
    """One step's adjustments; `build` returns None when no row has any."""

    allowed_rows: torch.Tensor | None  # [num_allowed_rows] int64
    disallowed: torch.Tensor | None  # [num_allowed_rows, vocab] bool: True where banned
    banned_rows: torch.Tensor | None  # [num_banned] int64 (bad words' next tokens)
    banned_ids: torch.Tensor | None  # [num_banned] int64
    bias_rows: torch.Tensor | None  # [num_biases] int64
    bias_ids: torch.Tensor | None  # [num_biases] int64
    bias_values: torch.Tensor | None  # [num_biases] float32

    @classmethod
    def build(cls, params: list[SamplingParams], output_token_ids: list[list[int]],
              vocab_size: int) -> LogitsAdjustments | None:
        """From each row's params and output so far (the ids were checked against the vocabulary
        by the gate, worker/engine/input_processor.py)."""
        allowed = [(row, p.allowed_token_ids) for row, p in enumerate(params)
                   if p.allowed_token_ids is not None]
        banned = [(row, token_id) for row, (p, history) in enumerate(
            zip(params, output_token_ids, strict=True)) if p.bad_words_token_ids
            for token_id in _banned_next(p.bad_words_token_ids, history)]
        biases = [(row, token_id, bias) for row, p in enumerate(params)
                  for token_id, bias in p.logit_bias if bias != 0.0]
        if not (allowed or banned or biases):
            return None
        adjustments = cls(None, None, None, None, None, None, None)
        if allowed:
            disallowed = torch.ones(len(allowed), vocab_size, dtype=torch.bool)
            for i, (_, ids) in enumerate(allowed):
                disallowed[i, list(ids or ())] = False
            adjustments.allowed_rows = torch.tensor([row for row, _ in allowed])
            adjustments.disallowed = disallowed
        if banned:
            adjustments.banned_rows = torch.tensor([row for row, _ in banned])
            adjustments.banned_ids = torch.tensor([token_id for _, token_id in banned])
        if biases:
            adjustments.bias_rows = torch.tensor([row for row, _, _ in biases])
            adjustments.bias_ids = torch.tensor([token_id for _, token_id, _ in biases])
            adjustments.bias_values = torch.tensor([bias for _, _, bias in biases],
                                                   dtype=torch.float32)
        return adjustments

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_rows, vocab] -> a new adjusted tensor (the input is kept)."""
        logits = logits.clone()
        if self.allowed_rows is not None and self.disallowed is not None:
            rows = logits[self.allowed_rows]  # [num_allowed_rows, vocab]
            logits[self.allowed_rows] = rows.masked_fill(self.disallowed, -math.inf)
        if self.banned_rows is not None and self.banned_ids is not None:
            logits[self.banned_rows, self.banned_ids] = -math.inf
        if self.bias_rows is not None and self.bias_ids is not None \
                and self.bias_values is not None:
            logits.index_put_((self.bias_rows, self.bias_ids), self.bias_values, accumulate=True)
        return logits


def _banned_next(words: tuple[tuple[int, ...], ...], history: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or (len(history) >= len(prefix)
                          and tuple(history[len(history) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def bad_word_token_ids(words: tuple[str, ...], encode: Callable[[str], list[int]]
                       ) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as vLLM derives them (`SamplingParams.update_from_tokenizer`):
    the word as written, and with one leading space when that tokenizes differently with the
    same number of tokens (a word mid-sentence). `encode(text)` gives ids without specials."""
    found: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if bare:
            found.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            found.append(spaced)
    return tuple(found)
