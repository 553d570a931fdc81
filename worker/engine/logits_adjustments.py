"""LogitsAdjustments: vLLM's `allowed_token_ids`, `bad_words` and `logit_bias` on a step's logits.

References: vLLM v1 `v1/sample/sampler.py` (the order: allowed token ids, then bad words, then
logit bias, all before penalties and temperature), `v1/sample/ops/bad_words.py` (a bad word's
last token is banned when the output so far ends with the rest of the word; a one-token word is
banned always: worker/engine/bad_words.py), `v1/sample/logits_processor`
(`LogitBiasLogitsProcessor`: the bias is added to the logit). Like `SamplingMetadata`,
everything is decided on the host from the rows' params and output histories, so a
verification row of speculative decoding, whose history includes the draft tokens before it, is
adjusted exactly as the same token sampled alone would be.

Log-probabilities are taken after these adjustments (as after penalties, see
worker/engine/sampler.py): a token banned here reports -inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmq.worker.engine.bad_words import banned_next
from llmq.worker.engine.sampling_params import SamplingParams

__all__ = ["LogitsAdjustments"]


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
            for token_id in banned_next(p.bad_words_token_ids, history)]
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
