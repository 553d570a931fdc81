"""Verification of draft tokens: which of them the target model's own sampling keeps.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling") accepts a draft token x drawn from the draft distribution q with probability
min(1, p(x) / q(x)), p being the target's distribution at that position (after temperature,
top-k / top-p / min-p and penalties), and on rejection samples from max(0, p - q) renormalised;
the tokens that come out are distributed exactly as if the target had sampled them one by one.

A prompt-lookup draft is deterministic: q puts all its mass on x. The rule becomes: accept x
with probability p(x); on rejection sample from p with x removed, renormalised. Drawing y from
p and accepting x exactly when y == x realises that rule: P(accept) = P(y = x) = p(x), and given
y != x, y is distributed as p restricted to the other tokens, renormalised. So verification
samples every position with the ordinary `Sampler` (row j conditioned on the draft's first j
tokens, which are the real history whenever row j is reached) and keeps the draft up to the
first position where the sample differs, plus that position's sample: the correction token, or
the bonus token after a wholly accepted draft.

Because each row draws exactly what the ordinary sampler would draw there (for a seeded
request, the same uniform: it depends on the number of output tokens only), the outputs are
not only equal in distribution: greedy and seeded requests produce the same tokens with and
without speculation, as far as the model computes a position's logits the same whatever rows
share its step. How far that holds:
- `--weights native` (the default model's path), steps of up to `QUANT_MAX_ROWS` (8) rows:
  the quantized kernels sum every row in one order whatever the row count
  (model/kernels/layer_kernels.cpp `quant_tile`), decode attention and the norms are per row,
  so a verification row is bit for bit the decode it stands for (the single stream with
  k <= 7; tests/engine/test_spec_decode.py).
- Not across that bound: above 8 rows the decoder's projections run the int8 form (each row
  quantized to int8 first, linear.py) and the LM head oneDNN's float32 GEMM, another
  rounding than the quantized kernels'. A step of several drafting requests (or k >= 8) can
  cross it where the same requests decoding without drafts would not, and a near tie can then
  go the other way; without speculation, a request decoded beside 8 others moves the same way.
- float32 weights (`fp32`): oneDNN's GEMMs agree across row counts to float32 rounding
  (~1e-5 on the logits), not to the bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmq.worker.engine.outputs import TokenLogprob
from llmq.worker.engine.sampler import SamplerOutput


def as_decode_rows(num_computed: int, num_tokens: int, block_ids: list[int],
                   query_lens: list[int], seq_lens: list[int],
                   block_tables: list[list[int]]) -> None:
    """Append a verification of `num_tokens` positions to a step's attention inputs as that
    many one-token decodes over the same block table, decode j seeing `num_computed + j + 1`
    keys.

    The step stores every new position's K/V in the cache before any attention reads it, so
    this is the causal attention of a `num_tokens`-long chunk; but it runs on the decode
    kernel, which reads K/V in place, and a single stream's step stays one kernel call
    (llama.py `_run_fused`), instead of gathering the whole context once per layer as the
    prefill path does (measured: a 2-token verification cost 2x a decode that way, ~1.05x so).
    """
    for j in range(num_tokens):
        query_lens.append(1)
        seq_lens.append(num_computed + j + 1)
        block_tables.append(block_ids)


def row_histories(output_token_ids: list[int], draft: Sequence[int]) -> list[list[int]]:
    """The output tokens each verification row is conditioned on (for penalties and seeds)."""
    return [output_token_ids + list(draft[:j]) for j in range(len(draft) + 1)]


@dataclass
class Verified:
    """What one request keeps of a verification: at least one token unless `error` is set."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token when asked for, else empty
    error: str | None = None  # why a row the run reached could not be sampled (NaN logits...)


def verify(out: SamplerOutput, first_row: int, draft: Sequence[int]) -> Verified:
    """Walk the rows `first_row .. first_row + len(draft)` of a sampler output: keep samples
    while they equal the draft, and the first one that does not (or the bonus after the last)."""
    kept = Verified([], [])
    for j in range(len(draft) + 1):
        row = first_row + j
        if row in out.bad_rows:
            return Verified([], [], out.bad_rows[row])
        token_id = out.sampled_token_ids[row]
        kept.token_ids.append(token_id)
        logprob = out.logprobs[row]
        if logprob is not None:
            kept.logprobs.append(logprob)
        if j == len(draft) or token_id != draft[j]:
            break
    return kept
