"""Sampler: one batched draw per step for every request that samples this step.

References:
- vLLM v1 `v1/sample/sampler.py` (the order: penalties, then greedy argmax or temperature ->
  top-k / top-p -> sample; per-step `SamplingMetadata` with fast paths when every row is greedy
  or no row uses a feature), `v1/sample/ops/topk_topp_sampler.py` (top-k and top-p as masks to
  -inf; here by thresholds from `topk` rather than a full sort of the vocab, which costs ~20x
  more on CPU), `model_executor/layers/utils.py::apply_penalties`.
- gpt-fast `generate.py`: sampling with no host sync. Every decision about which rows use which
  feature is made on the host from the params in `SamplingMetadata.build`; the sampler itself
  only runs tensor ops and ends with one `.tolist()` (top-p adds a host check when some row's
  nucleus lies beyond its 256 most likely tokens, see `_top_p_threshold`).
- Penalties: repetition as in HF `RepetitionPenaltyLogitsProcessor` / vLLM (over prompt and
  output tokens: positive logits divided, negative ones multiplied); presence and frequency as
  in OpenAI's API (over output tokens only: `logit - count * frequency - (count > 0) * presence`).
- min-p: HF `MinPLogitsWarper` (keep tokens with prob >= min_p * the top prob), applied here in
  log space after temperature, top-k and top-p.

Randomness. A row is sampled by inverse CDF with ONE uniform number u in (0, 1]: the first
token whose cumulative probability reaches u * total. For a seeded row, u is a hash of
(seed, number of output tokens so far) computed on the host, so a seeded request draws the same
tokens alone or in any batch, and again after a preemption recomputes it. Unseeded rows take u
from the sampler's shared `torch.Generator`. Every tensor op works row by row, so a row's result
never depends on the other rows.

Logprobs are `log_softmax` of the adjusted (worker/engine/logits_adjustments.py) and penalised
logits, before temperature and top-k / top-p / min-p (the contract of `TokenLogprob`): vLLM v1's
"raw_logprobs" takes them before both, so the two agree unless a request sets either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from llmq.worker.engine.logits_adjustments import LogitsAdjustments
from llmq.worker.engine.outputs import TokenLogprob
from llmq.worker.engine.sampling_params import SamplingParams

# NOTE: below this temperature, logits / temperature overflows float32; vLLM treats it as greedy.
SAMPLING_EPS = 1e-5
# NOTE: top-p looks for its nucleus among the 256 most likely tokens, then 4096, then the whole
# vocab: a full sort of 64 x 49k floats costs ~200 ms on this CPU, a top-256 ~10 ms, and a
# language model's nucleus is almost always inside the first.
_TOP_P_CANDIDATES = (256, 4096)
_MASK64 = (1 << 64) - 1

BAD_ROW_REASONS = {1: "logits contain NaN", 2: "logits contain +inf", 3: "every logit is -inf"}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, num_output_tokens: int) -> float:
    """The uniform in (0, 1] a seeded request draws its next token with; a function of the two
    arguments alone, so it survives batching and preemption."""
    x = _splitmix64(_splitmix64(seed) ^ num_output_tokens)
    return ((x >> 11) + 1) * 2.0**-53  # 53 random bits, never 0


@dataclass
class SamplingMetadata:
    """Per-step sampling state as tensors; a field is None when no row needs it."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy: torch.Tensor | None  # [num_rows] bool; only in a batch mixing greedy and random rows
    # Random rows only (greedy rows carry neutral values):
    temperature: torch.Tensor | None  # [num_rows, 1] float32
    top_k: torch.Tensor | None  # [num_rows, 1] int64 in [1, vocab]; vocab disables
    max_top_k: int  # the largest enabled top_k; 0 when top_k is None
    top_p: torch.Tensor | None  # [num_rows, 1] float32; 1 disables
    log_min_p: torch.Tensor | None  # [num_rows, 1] float32; -inf disables
    seeded_uniforms: torch.Tensor | None  # [num_rows] float64 in (0, 1]; 0 for unseeded rows
    unseeded: torch.Tensor | None  # [num_rows] bool: random rows drawing from the shared generator
    # Penalties, for the rows in `penalty_rows` only (None: every row):
    has_penalties: bool
    penalty_rows: torch.Tensor | None  # [num_penalty_rows] int64
    presence_penalties: torch.Tensor | None  # [num_penalty_rows, 1] float32
    frequency_penalties: torch.Tensor | None  # [num_penalty_rows, 1] float32
    repetition_penalties: torch.Tensor | None  # [num_penalty_rows, 1] float32
    output_token_counts: torch.Tensor | None  # [num_penalty_rows, vocab] float32
    seen_token_mask: torch.Tensor | None  # [num_penalty_rows, vocab] bool: in prompt or output
    # Logprobs:
    logprob_rows: list[int]  # rows whose params.logprobs is not None
    logprob_row_index: torch.Tensor | None  # [num_logprob_rows] int64, the same rows
    num_logprobs: list[int]  # top-n per logprob row
    max_num_logprobs: int
    adjustments: LogitsAdjustments | None = None  # allowed_token_ids, bad_words, logit_bias

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
    ) -> SamplingMetadata:
        num_rows = len(params)
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        # Random rows only; greedy rows get the neutral value of each field.
        rand = [p for p, g in zip(params, greedy, strict=True) if not g]
        both = list(zip(params, greedy, strict=True))

        temperature = top_k = top_p = log_min_p = seeded_u = unseeded = None
        max_top_k = 0
        if rand:
            if any(p.temperature != 1.0 for p in rand):
                temperature = torch.tensor(
                    [1.0 if g else p.temperature for p, g in both],
                    dtype=torch.float32).unsqueeze(1)
            ks = [vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size)
                  for p, g in both]
            enabled_ks = [k for k in ks if k < vocab_size]
            if enabled_ks:
                top_k = torch.tensor(ks, dtype=torch.long).unsqueeze(1)
                max_top_k = max(enabled_ks)
            if any(p.top_p < 1.0 for p in rand):
                top_p = torch.tensor([1.0 if g else p.top_p for p, g in both],
                                     dtype=torch.float32).unsqueeze(1)
            if any(p.min_p > 0.0 for p in rand):
                log_min_p = torch.tensor(
                    [math.log(p.min_p) if not g and p.min_p > 0.0 else -math.inf
                     for p, g in both], dtype=torch.float32).unsqueeze(1)
            if any(p.seed is not None for p in rand):
                seeded_u = torch.tensor(
                    [seeded_uniform(p.seed, len(out)) if not g and p.seed is not None else 0.0
                     for p, g, out in zip(params, greedy, output_token_ids, strict=True)],
                    dtype=torch.float64)
            if any(p.seed is None for p in rand):
                unseeded = torch.tensor([not g and p.seed is None for p, g in both])

        penalty_fields = cls._build_penalties(params, prompt_token_ids, output_token_ids,
                                              vocab_size)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        num_logprobs = [min(params[i].logprobs or 0, vocab_size) for i in logprob_rows]

        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy=None if all_greedy or all_random else torch.tensor(greedy),
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            log_min_p=log_min_p,
            seeded_uniforms=seeded_u,
            unseeded=unseeded,
            **penalty_fields,
            logprob_rows=logprob_rows,
            logprob_row_index=torch.tensor(logprob_rows, dtype=torch.long) if logprob_rows
            else None,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(num_logprobs, default=0),
            adjustments=LogitsAdjustments.build(params, output_token_ids, vocab_size),
        )

    @staticmethod
    def _build_penalties(
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
    ) -> dict:
        rows = [i for i, p in enumerate(params)
                if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or p.repetition_penalty != 1.0]
        none: dict = dict(has_penalties=False, penalty_rows=None, presence_penalties=None,
                          frequency_penalties=None, repetition_penalties=None,
                          output_token_counts=None, seen_token_mask=None)
        if not rows:
            return none
        pen = [params[i] for i in rows]
        num_cells = len(rows) * vocab_size
        output_cells = _cell_ids([output_token_ids[i] for i in rows], vocab_size)

        fields = dict(none, has_penalties=True)
        if len(rows) < len(params):
            fields["penalty_rows"] = torch.tensor(rows, dtype=torch.long)
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in pen):
            counts = np.bincount(output_cells, minlength=num_cells).astype(np.float32)
            fields["output_token_counts"] = torch.from_numpy(  # [num_penalty_rows, vocab]
                counts.reshape(len(rows), vocab_size))
            fields["presence_penalties"] = torch.tensor(
                [p.presence_penalty for p in pen], dtype=torch.float32).unsqueeze(1)
            fields["frequency_penalties"] = torch.tensor(
                [p.frequency_penalty for p in pen], dtype=torch.float32).unsqueeze(1)
        if any(p.repetition_penalty != 1.0 for p in pen):
            seen = np.zeros(num_cells, dtype=np.bool_)
            seen[_cell_ids([prompt_token_ids[i] for i in rows], vocab_size)] = True
            seen[output_cells] = True
            fields["seen_token_mask"] = torch.from_numpy(  # [num_penalty_rows, vocab]
                seen.reshape(len(rows), vocab_size))
            fields["repetition_penalties"] = torch.tensor(
                [p.repetition_penalty for p in pen], dtype=torch.float32).unsqueeze(1)
        return fields


def _cell_ids(token_ids: list[list[int]], vocab_size: int) -> np.ndarray:
    """`row * vocab_size + token_id` for every token of every row, as one flat int64 array.

    NOTE: numpy, not torch, because `np.fromiter` reads a long Python list ~4x faster than
    `torch.tensor`, and a flat index fills a dense [rows, vocab] array in one pass: with 64
    prompts of 8k tokens this is ~10 ms instead of ~70 ms."""
    lengths = [len(ids) for ids in token_ids]
    cells = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=sum(lengths))
    if cells.size and (cells.min() < 0 or cells.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}) for penalties, got "
                         f"{int(cells.min())}..{int(cells.max())}")
    cells += np.repeat(np.arange(len(token_ids), dtype=np.int64) * vocab_size, lengths)
    return cells


def _nucleus_threshold(sorted_probs: torch.Tensor,
                       top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest probability top-p keeps, from each row's most likely tokens in descending
    order, and whether their mass reached top_p at all."""
    cum = sorted_probs.cumsum(dim=-1)  # [num_rows, n]
    hit = cum >= top_p  # [num_rows, n]; monotone, so it hits at all iff its last entry does
    first = hit.to(torch.uint8).argmax(dim=-1, keepdim=True)  # [num_rows, 1]: first True
    return sorted_probs.gather(1, first), hit[:, -1:]  # [num_rows, 1] each


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Per row, the smallest probability top-p keeps (0 keeps everything): the probability of
    the most likely token at which the descending cumulative mass reaches top_p. Candidates
    grow only for rows whose nucleus lies beyond them; a row's cumulative sums over its first
    n candidates are the same whichever n, so its threshold never depends on other rows."""
    vocab_size = probs.shape[-1]
    sizes = sorted({min(vocab_size, max(n, max_top_k)) for n in _TOP_P_CANDIDATES} | {vocab_size})
    # With top-k set, a row's whole mass lies in its top max_top_k: the first size suffices.
    disabled = top_p >= 1.0  # [num_rows, 1]
    top = probs.topk(sizes[0], dim=-1).values  # [num_rows, sizes[0]], descending
    threshold, reached = _nucleus_threshold(top, top_p)  # [num_rows, 1] each
    threshold = torch.where(disabled, 0.0, threshold)  # [num_rows, 1]
    short = ~(reached | disabled)  # [num_rows, 1]
    for size in sizes[1:]:
        # NOTE: a host check, only on the top-p path; on CPU it waits for nothing.
        if not bool(short.any()):
            break
        rows = short.squeeze(1).nonzero().squeeze(1)  # [num_short]
        if size < vocab_size:
            top = probs[rows].topk(size, dim=-1).values  # [num_short, size]
        else:
            top = probs[rows].sort(dim=-1, descending=True).values  # [num_short, vocab]
        row_threshold, row_reached = _nucleus_threshold(top, top_p[rows])  # [num_short, 1]
        if size == vocab_size:
            # Mass short of top_p even over the whole vocab (it rounds below): keep everything.
            row_threshold = torch.where(row_reached, row_threshold, 0.0)
            row_reached = torch.ones_like(row_reached)
        threshold[rows] = row_threshold
        short[rows] = ~row_reached
    return threshold


_ARGMAX_CHUNK = 128


def _argmax_and_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first index of the largest logit and that logit (NaN if any is NaN).

    NOTE: torch's CPU argmax over a 49k vocab is not vectorised: ~7 ms for 64 rows, 10x an
    amax. Maxima of 128-wide chunks (a vectorised amax), then argmax over the few chunk maxima
    and inside the winning chunk give the same first index in ~1/5 of the time."""
    num_rows, vocab_size = logits.shape
    if vocab_size % _ARGMAX_CHUNK:
        return logits.argmax(dim=-1), logits.amax(dim=-1)
    chunks = logits.view(num_rows, -1, _ARGMAX_CHUNK)  # [num_rows, num_chunks, 128]
    chunk_max = chunks.amax(dim=-1)  # [num_rows, num_chunks]
    best_chunk = chunk_max.argmax(dim=-1)  # [num_rows]: the first chunk holding the max
    rows = torch.arange(num_rows)
    within = chunks[rows, best_chunk].argmax(dim=-1)  # [num_rows]
    return best_chunk * _ARGMAX_CHUNK + within, chunk_max.amax(dim=-1)


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # per row; -1 for a bad row
    logprobs: list[TokenLogprob | None]  # per row; None when not asked for or the row is bad
    bad_rows: dict[int, str]  # row -> why it failed (NaN / +inf / all -inf logits)


class Sampler:
    """Samples one token per row. Never changes the logits tensor it is given."""

    def __init__(self, seed: int | None = None) -> None:
        # The shared generator of unseeded rows; a seed makes a whole run reproducible (tests).
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        num_rows, vocab_size = logits.shape  # [num_rows, vocab]
        if (num_rows, vocab_size) != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match the metadata "
                             f"({metadata.num_rows} rows, vocab {metadata.vocab_size})")
        if num_rows == 0:
            return SamplerOutput([], [], {})
        logits = logits.float()  # bfloat16 models: sample in float32, as vLLM does

        # NaN anywhere makes amax NaN, +inf makes it +inf, and only an all -inf row gives -inf:
        # one reduction classifies every row. Every op below works row by row, so a bad row's
        # values never reach another row; its result is replaced by -1 at the end.
        argmax, row_max = _argmax_and_max(logits)  # [num_rows] each
        bad_code = (row_max.isnan().long()  # [num_rows] int64: a key of BAD_ROW_REASONS or 0
                    + (row_max == math.inf).long() * 2 + (row_max == -math.inf).long() * 3)

        if metadata.adjustments is not None:  # before penalties, as vLLM orders them
            logits = metadata.adjustments.apply(logits)  # [num_rows, vocab]
            argmax, row_max = _argmax_and_max(logits)  # every token banned: nothing to sample
            bad_code = torch.where((bad_code == 0) & (row_max == -math.inf), 3, bad_code)
        if metadata.has_penalties:
            logits = self.apply_penalties(logits, metadata)  # [num_rows, vocab]
            argmax, _ = _argmax_and_max(logits)

        if metadata.all_greedy:
            sampled = argmax  # [num_rows]
        else:
            sampled = self.sample_random(logits, metadata)  # [num_rows]
            if metadata.greedy is not None:
                sampled = torch.where(metadata.greedy, argmax, sampled)
        sampled = torch.where(bad_code > 0, -1, sampled)  # [num_rows]

        parts = [sampled.double(), bad_code.double()]
        num_logprob_rows = len(metadata.logprob_rows)
        n = metadata.max_num_logprobs
        if num_logprob_rows:
            # Only the rows that asked: log_softmax over the vocab is the expensive part.
            idx = metadata.logprob_row_index
            logprobs = logits[idx].log_softmax(dim=-1)  # [num_logprob_rows, vocab]
            token_ids = sampled[idx].clamp(min=0).unsqueeze(1)  # [num_logprob_rows, 1]
            parts.append(logprobs.gather(1, token_ids).squeeze(1).double())
            if n:
                top_logprobs, top_ids = logprobs.topk(n, dim=-1)  # [num_logprob_rows, n] each
                parts += [top_ids.double().flatten(), top_logprobs.double().flatten()]

        # NOTE: the one host sync of the step: everything the caller needs, in one list.
        flat = torch.cat(parts).tolist()
        sampled_ids = [int(x) for x in flat[:num_rows]]
        bad_rows = {row: BAD_ROW_REASONS[int(code)]
                    for row, code in enumerate(flat[num_rows:2 * num_rows]) if code}
        out_logprobs: list[TokenLogprob | None] = [None] * num_rows
        offset = 2 * num_rows
        sampled_lps = flat[offset:offset + num_logprob_rows]
        offset += num_logprob_rows
        top_ids_flat = flat[offset:offset + num_logprob_rows * n]
        top_lps_flat = flat[offset + num_logprob_rows * n:]
        for j, (row, k) in enumerate(zip(metadata.logprob_rows, metadata.num_logprobs,
                                         strict=True)):
            if row in bad_rows:
                continue
            start = j * n
            # NOTE: -inf (a token masked out by penalties) is None on the wire: JSON has no inf.
            out_logprobs[row] = TokenLogprob(
                token_id=sampled_ids[row],
                logprob=_finite(sampled_lps[j]),
                top_token_ids=[int(x) for x in top_ids_flat[start:start + k]],
                top_logprobs=[_finite(x) for x in top_lps_flat[start:start + k]],
            )
        return SamplerOutput(sampled_ids, out_logprobs, bad_rows)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Repetition, then frequency and presence penalties; returns a new tensor when any
        row has one. Neutral values (1, 0, 0) leave a logit bit-for-bit unchanged."""
        if not metadata.has_penalties:
            return logits
        rows = metadata.penalty_rows
        sub = logits if rows is None else logits[rows]  # [num_penalty_rows, vocab]
        seen, repetition = metadata.seen_token_mask, metadata.repetition_penalties
        if seen is not None and repetition is not None:
            penalty = torch.where(seen, repetition, 1.0)  # [num_penalty_rows, vocab]
            sub = torch.where(sub > 0, sub / penalty, sub * penalty)
        counts = metadata.output_token_counts  # [num_penalty_rows, vocab]
        frequency, presence = metadata.frequency_penalties, metadata.presence_penalties
        if counts is not None and frequency is not None and presence is not None:
            sub = sub - frequency * counts
            sub = sub - presence * (counts > 0)
        if rows is None:
            return sub
        return logits.index_copy(0, rows, sub)  # [num_rows, vocab], a copy: the input is kept

    @staticmethod
    def apply_top_k_top_p_min_p(logits: torch.Tensor,
                                metadata: SamplingMetadata) -> torch.Tensor:
        """Mask (to -inf) what top-k, then top-p, then min-p exclude; returns a new tensor.

        Ties are kept: top-k keeps every token equal to the k-th logit, top-p every token as
        likely as the least likely one the nucleus needs, so the kept set never depends on
        how a sort ordered equal values."""
        neg_inf = -math.inf
        vocab_size = metadata.vocab_size
        k, p = metadata.top_k, metadata.top_p
        if k is not None:
            top = logits.topk(metadata.max_top_k, dim=-1).values  # [num_rows, max_top_k]
            kth = top.gather(1, k.clamp(max=metadata.max_top_k) - 1)  # [num_rows, 1]
            kth = torch.where(k >= vocab_size, neg_inf, kth)  # k = vocab: keep everything
            logits = logits.masked_fill(logits < kth, neg_inf)
        if p is not None:
            probs = logits.softmax(dim=-1)  # [num_rows, vocab]
            threshold = _top_p_threshold(probs, p, metadata.max_top_k)  # [num_rows, 1]
            logits = logits.masked_fill(probs < threshold, neg_inf)
        if metadata.log_min_p is not None:
            # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p)
            threshold = logits.amax(dim=-1, keepdim=True) + metadata.log_min_p  # [num_rows, 1]
            logits = logits.masked_fill(logits < threshold, neg_inf)
        return logits

    def sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then an inverse-CDF draw per row."""
        if metadata.temperature is not None:
            logits = logits / metadata.temperature  # [num_rows, vocab]
        logits = self.apply_top_k_top_p_min_p(logits, metadata)  # [num_rows, vocab]
        # NOTE: torch's CPU cumsum accumulates float32 in double, so each prefix is rounded
        # once; masked tokens add exactly 0 and so can never be where the CDF reaches u.
        cdf = logits.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, vocab]

        u = metadata.seeded_uniforms  # [num_rows] float64 or None
        if metadata.unseeded is not None:
            shared = 1.0 - torch.rand(metadata.num_rows, dtype=torch.float64,  # (0, 1]
                                      generator=self.generator)
            u = shared if u is None else torch.where(metadata.unseeded, shared, u)
        assert u is not None  # some random row exists, seeded or not
        # u in (0, 1] and total > 0, so the target is > 0 and <= total: the first index
        # reaching it has a positive probability.
        target = (u * cdf[:, -1].double()).float().unsqueeze(1)  # [num_rows, 1]
        sampled = torch.searchsorted(cdf, target).squeeze(1)  # [num_rows]
        return sampled.clamp_(max=metadata.vocab_size - 1)
