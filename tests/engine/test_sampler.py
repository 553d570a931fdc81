"""The batched sampler: what a request sees of greedy, temperature, top-k / top-p / min-p, seeds,
penalties, logprobs and bad logits, whatever else shares its step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmq.worker.engine.sampler import BAD_ROW_REASONS, Sampler, SamplerOutput, SamplingMetadata
from llmq.worker.engine.sampling_params import SamplingParams

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def sample(logits: torch.Tensor, params: list[SamplingParams],
           outputs: list[list[int]] | None = None, prompts: list[list[int]] | None = None,
           sampler: Sampler | None = None) -> SamplerOutput:
    num_rows, vocab_size = logits.shape
    metadata = SamplingMetadata.build(
        params, prompts or [[] for _ in params], outputs or [[] for _ in params], vocab_size)
    return (sampler or Sampler(seed=0))(logits, metadata)


def random_logits(num_rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


# --- greedy -------------------------------------------------------------------------------------

@SETTINGS
@given(vocab_size=st.integers(2, 300), num_rows=st.integers(1, 8), seed=st.integers(0, 2**31),
       num_masked=st.integers(0, 5))
def test_greedy_rows_take_the_argmax_even_next_to_random_rows(vocab_size, num_rows, seed,
                                                              num_masked):
    # Given logits with some masked (-inf) tokens, and a batch mixing greedy and random rows
    logits = random_logits(num_rows, vocab_size, seed)
    logits[:, :min(num_masked, vocab_size - 1)] = -math.inf
    params = [SamplingParams(temperature=0.0) if row % 2 == 0
              else SamplingParams(temperature=1.3, top_p=0.8, seed=row)
              for row in range(num_rows)]

    # When sampled
    out = sample(logits, params)

    # Then every greedy row got exactly the most likely token
    argmax = logits.argmax(dim=-1).tolist()
    for row in range(0, num_rows, 2):
        assert out.sampled_token_ids[row] == argmax[row]
    assert out.bad_rows == {}


def test_top_k_1_and_min_p_1_are_greedy():
    # Given random rows restricted to a single token by top_k=1 or min_p=1
    logits = random_logits(4, 500, seed=1)
    params = [SamplingParams(temperature=2.0, top_k=1, seed=1),
              SamplingParams(temperature=2.0, min_p=1.0),
              SamplingParams(temperature=2.0, top_k=1, top_p=0.5, seed=3),
              SamplingParams(temperature=2.0, top_p=1e-6)]
    # When sampled, Then each returns the argmax
    assert sample(logits, params).sampled_token_ids == logits.argmax(dim=-1).tolist()


# --- seeds --------------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_across_calls_and_sampler_instances():
    # Given seeded high-temperature rows over a flat-ish distribution
    logits = random_logits(8, 1000, seed=2, scale=1.0)
    params = [SamplingParams(temperature=1.5, top_p=0.95, seed=100 + row) for row in range(8)]
    # When the same step is sampled twice, by samplers whose shared generators differ
    first = sample(logits, params, sampler=Sampler(seed=1)).sampled_token_ids
    second = sample(logits, params, sampler=Sampler(seed=2)).sampled_token_ids
    # Then the tokens are the same, and different seeds did draw different tokens
    assert first == second
    assert len(set(first)) > 4


def _config(draw_kind: int, seed: int) -> SamplingParams:
    """Other requests a seeded request may share a step with."""
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9),  # unseeded: the shared generator
        SamplingParams(temperature=1.2, top_p=0.7, seed=seed),
        SamplingParams(temperature=0.6, top_k=20, min_p=0.02),
        SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5,
                       repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, logprobs=0),
        SamplingParams(temperature=3.0, top_p=0.99),  # flat: top-p must look at the whole vocab
    ][draw_kind]


@SETTINGS
@given(
    target=st.builds(SamplingParams,
                     temperature=st.sampled_from([0.5, 1.0, 1.7]),
                     top_k=st.sampled_from([0, 5, 50]),
                     top_p=st.sampled_from([1.0, 0.9, 0.3]),
                     min_p=st.sampled_from([0.0, 0.05]),
                     presence_penalty=st.sampled_from([0.0, 0.5]),
                     repetition_penalty=st.sampled_from([1.0, 1.2]),
                     seed=st.integers(0, 2**63 - 1)),
    others=st.lists(st.integers(0, 6), min_size=1, max_size=10),
    position=st.integers(0, 10),
    logits_seed=st.integers(0, 2**31),
)
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch(target, others, position,
                                                                      logits_seed):
    # Given a seeded request decoding 4 steps over a vocab that is no multiple of a SIMD width,
    # once alone and once sharing every step with other rows of every kind
    vocab_size = 1003
    steps = 4
    position = min(position, len(others))
    prompt = [7, 8, 9, 7]
    tokens_alone: list[int] = []
    tokens_batched: list[int] = []
    sampler = Sampler(seed=logits_seed)
    for step in range(steps):
        target_logits = random_logits(1, vocab_size, seed=logits_seed + step)  # [1, vocab]
        # When it samples alone
        tokens_alone.append(sample(target_logits, [target], [tokens_alone], [prompt],
                                   sampler=sampler).sampled_token_ids[0])
        # And in a batch
        other_logits = random_logits(len(others), vocab_size, seed=logits_seed + 1000 + step)
        logits = torch.cat([other_logits[:position], target_logits, other_logits[position:]])
        params = [_config(kind, seed=row) for row, kind in enumerate(others)]
        params.insert(position, target)
        outputs = [[row, row + 1, step] for row in range(len(others))]
        outputs.insert(position, tokens_batched)
        prompts = [[1, 2, 3]] * len(others)
        prompts.insert(position, prompt)
        out = sample(logits, params, outputs, prompts, sampler=sampler)
        tokens_batched.append(out.sampled_token_ids[position])
    # Then it drew the same tokens
    assert tokens_batched == tokens_alone


def test_a_seeded_request_recomputed_after_preemption_continues_identically():
    # Given a seeded request that has produced some tokens, in a sampler with a long history
    logits = random_logits(1, 800, seed=5, scale=1.0)
    params = [SamplingParams(temperature=1.0, seed=42)]
    busy = Sampler(seed=9)
    for _ in range(5):
        sample(random_logits(3, 800, seed=6), [SamplingParams()] * 3, sampler=busy)
    outputs = [[11, 12, 13]]
    # When its next token is drawn there, and again by a fresh worker after a preemption
    before = sample(logits, params, outputs, sampler=busy).sampled_token_ids
    after = sample(logits, params, outputs, sampler=Sampler()).sampled_token_ids
    # Then the token is the same; and a different step of the same request draws afresh
    assert before == after
    draws = {sample(logits, params, [[0] * n]).sampled_token_ids[0] for n in range(20)}
    assert len(draws) > 5


# --- top-k / top-p / min-p ----------------------------------------------------------------------

@st.composite
def filtered_rows(draw):
    vocab_size = draw(st.integers(2, 40))
    values = draw(st.lists(
        st.one_of(st.floats(-10, 10, width=32), st.just(-math.inf)),
        min_size=vocab_size, max_size=vocab_size))
    if all(v == -math.inf for v in values):
        values[0] = 0.0
    params = dict(
        temperature=draw(st.floats(0.05, 3.0)),
        top_k=draw(st.integers(0, vocab_size + 2)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
    )
    return torch.tensor([values], dtype=torch.float32), params


def allowed_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float, tol: float = 1e-4) -> set[int]:
    """The tokens top-k, then top-p, then min-p let through; the tolerance only ever admits
    more, so float rounding inside the sampler cannot fail the test."""
    scaled = logits[0] / torch.tensor(temperature, dtype=torch.float32)  # as the sampler does
    vocab = range(len(scaled))
    keep = {t for t in vocab if scaled[t] > -math.inf}
    if 0 < top_k < len(scaled):
        kth = sorted(scaled.tolist(), reverse=True)[top_k - 1]
        keep = {t for t in keep if scaled[t] >= kth}  # ties with the k-th are kept
    x = scaled.double()
    top = max(x[t].item() for t in keep)
    mass = {t: math.exp(x[t].item() - top) for t in keep}
    total = sum(mass.values())
    if top_p < 1.0:
        # A token is in the nucleus when the tokens more likely than it hold less than top_p
        # (tokens within float32 rounding of it count as ties, which the sampler keeps).
        keep = {t for t in keep
                if sum(m for u, m in mass.items() if x[u] > x[t] + tol) / total < top_p + tol}
    if min_p > 0.0:
        keep = {t for t in keep if x[t].item() - top >= math.log(min_p) - tol}
    return keep


@settings(max_examples=150, deadline=None)
@given(row=filtered_rows())
def test_top_k_top_p_min_p_never_return_a_masked_token(row):
    # Given one row's logits and filters, drawn 64 times with different seeds in one batch
    logits, params = row
    num_draws = 64
    batch = logits.expand(num_draws, -1).contiguous()  # [num_draws, vocab]
    out = sample(batch, [SamplingParams(seed=s, **params) for s in range(num_draws)])
    # Then every token drawn is one the filters allow
    allowed = allowed_tokens(logits, **params)
    assert set(out.sampled_token_ids) <= allowed


def test_top_p_keeps_the_smallest_nucleus_and_samples_inside_it():
    # Given probabilities 0.5, 0.3, 0.15, 0.05 and top_p = 0.75
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    batch = logits.expand(2000, -1).contiguous()
    # When drawn 2000 times
    out = sample(batch, [SamplingParams(top_p=0.75, seed=s) for s in range(2000)])
    # Then only the two tokens whose mass first reaches 0.75 appear, in proportion 5:3
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 2000 - 0.625) < 0.04


# --- temperature --------------------------------------------------------------------------------

def _empirical(out: SamplerOutput, vocab_size: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=vocab_size)
    return counts.double() / counts.sum()


def _entropy(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def test_temperature_spreads_the_distribution_as_softmax_of_logits_over_temperature():
    # Given a fixed 6-token distribution, drawn 4000 times per temperature with fixed seeds
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    num_draws = 4000
    batch = logits.expand(num_draws, -1).contiguous()
    entropies = []
    for temperature in (0.5, 1.0, 2.0):
        # When sampled
        out = sample(batch, [SamplingParams(temperature=temperature, seed=s)
                             for s in range(num_draws)])
        # Then the frequencies match softmax(logits / T) (4 sigma is ~0.03) ...
        empirical = _empirical(out, 6)
        expected = (logits[0].double() / temperature).softmax(dim=-1)
        assert (empirical - expected).abs().max() < 0.03, temperature
        entropies.append(_entropy(empirical))
    # ... and a higher temperature spreads the draws wider
    assert entropies[0] < entropies[1] < entropies[2]


def test_unseeded_rows_follow_the_distribution_too():
    # Given the shared generator of a sampler (seeded here only to keep the test fixed)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    batch = logits.expand(4000, -1).contiguous()
    # When unseeded rows are drawn
    out = sample(batch, [SamplingParams(temperature=1.0)] * 4000, sampler=Sampler(seed=123))
    # Then their frequencies match the softmax as well
    assert (_empirical(out, 6) - logits[0].double().softmax(-1)).abs().max() < 0.03


# --- penalties ----------------------------------------------------------------------------------

def penalised(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              output: list[int]) -> torch.Tensor:
    metadata = SamplingMetadata.build([params], [prompt], [output], logits.shape[1])
    return Sampler.apply_penalties(logits, metadata)


def test_presence_penalty_lowers_each_generated_token_by_exactly_the_penalty():
    # Given output tokens 3, 3, 5 after a prompt holding token 1
    logits = random_logits(1, 10, seed=3)
    # When a presence penalty of 0.7 is applied
    got = penalised(logits, SamplingParams(presence_penalty=0.7), prompt=[1], output=[3, 3, 5])
    # Then tokens 3 and 5 drop by 0.7 once each; the prompt's token 1 and the rest are untouched
    expected = logits.clone()
    expected[0, [3, 5]] -= 0.7
    assert torch.equal(got, expected)


def test_frequency_penalty_lowers_each_generated_token_by_count_times_the_penalty():
    logits = random_logits(1, 10, seed=4)
    got = penalised(logits, SamplingParams(frequency_penalty=0.4), prompt=[1], output=[3, 3, 5])
    expected = logits.clone()
    expected[0, 3] -= torch.tensor(0.4) * 2
    expected[0, 5] -= torch.tensor(0.4) * 1
    assert torch.equal(got, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # Given a prompt [1, 2] and an output [3]; tokens 1 and 3 positive, token 2 negative
    logits = torch.tensor([[0.5, 2.0, -1.0, 3.0, -4.0, 1.0]])
    # When a repetition penalty of 1.5 is applied
    got = penalised(logits, SamplingParams(repetition_penalty=1.5), prompt=[1, 2], output=[3])
    # Then seen tokens become less likely either way; unseen tokens keep their logits
    expected = torch.tensor([[0.5, 2.0 / 1.5, -1.0 * 1.5, 3.0 / 1.5, -4.0, 1.0]])
    assert torch.equal(got, expected)


def test_penalties_touch_only_the_rows_that_ask_for_them():
    # Given a batch where only the middle row has penalties
    logits = random_logits(3, 50, seed=8)
    params = [SamplingParams(), SamplingParams(presence_penalty=2.0, frequency_penalty=1.0,
                                               repetition_penalty=2.0), SamplingParams()]
    outputs = [[1, 2], [1, 2, 2], [2]]
    metadata = SamplingMetadata.build(params, [[4, 5]] * 3, outputs, 50)
    # When penalties are applied
    got = Sampler.apply_penalties(logits, metadata)
    # Then the other rows are bit-for-bit unchanged, the input tensor too
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    assert not torch.equal(got[1], logits[1])
    assert torch.equal(logits, random_logits(3, 50, seed=8))


def test_a_presence_penalty_steers_greedy_decoding_away_from_a_repeated_token():
    # Given a greedy request whose favourite token 0 was already generated
    logits = torch.tensor([[5.0, 4.5, 0.0, -1.0]])
    # When sampled without and with a presence penalty of 1
    plain = sample(logits, [SamplingParams(temperature=0)], [[0]])
    steered = sample(logits, [SamplingParams(temperature=0, presence_penalty=1.0)], [[0]])
    # Then the penalty makes it pick the runner-up
    assert plain.sampled_token_ids == [0]
    assert steered.sampled_token_ids == [1]


# --- bad logits ---------------------------------------------------------------------------------

def test_rows_with_nan_or_inf_logits_fail_alone():
    # Given good rows of every kind, and the same batch with NaN, +inf and all -inf rows mixed in
    vocab_size = 300
    good_logits = random_logits(5, vocab_size, seed=11)
    good_logits[1, :10] = -math.inf  # masked tokens are legitimate
    good_params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=0),
        SamplingParams(temperature=1.1, top_k=30, min_p=0.01, seed=2),
        SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, frequency_penalty=0.3, seed=3, logprobs=4),
    ]
    good_outputs = [[1], [2, 2], [], [4, 5], [6]]
    nan_row = random_logits(1, vocab_size, seed=12)
    nan_row[0, 17] = math.nan
    inf_row = random_logits(1, vocab_size, seed=13)
    inf_row[0, 99] = math.inf
    masked_row = torch.full((1, vocab_size), -math.inf)
    bad_params = SamplingParams(temperature=0.9, top_p=0.8, seed=4, presence_penalty=0.1,
                                logprobs=3)
    logits = torch.cat([nan_row, good_logits[:2], inf_row, good_logits[2:], masked_row])
    params = [bad_params, *good_params[:2], bad_params, *good_params[2:], bad_params]
    outputs = [[3], *good_outputs[:2], [3], *good_outputs[2:], [3]]

    # When both batches are sampled
    alone = sample(good_logits, good_params, good_outputs, sampler=Sampler(seed=1))
    mixed = sample(logits, params, outputs, sampler=Sampler(seed=1))

    # Then the bad rows fail with their reasons and no token ...
    assert mixed.bad_rows == {0: BAD_ROW_REASONS[1], 3: BAD_ROW_REASONS[2],
                              7: BAD_ROW_REASONS[3]}
    assert [mixed.sampled_token_ids[r] for r in (0, 3, 7)] == [-1, -1, -1]
    assert [mixed.logprobs[r] for r in (0, 3, 7)] == [None, None, None]
    # ... and every other row got exactly what it gets without them
    good_rows = [1, 2, 4, 5, 6]
    assert [mixed.sampled_token_ids[r] for r in good_rows] == alone.sampled_token_ids
    assert [mixed.logprobs[r] for r in good_rows] == alone.logprobs
    assert alone.bad_rows == {}


# --- logprobs -----------------------------------------------------------------------------------

def test_logprobs_are_of_the_penalised_logits_before_temperature():
    # Given rows asking for no logprobs, the sampled token's only, and the top 3 / top 5
    vocab_size = 200
    logits = random_logits(4, vocab_size, seed=21)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.5, seed=7, logprobs=3, presence_penalty=1.5),
              SamplingParams(temperature=1.8, top_k=10, seed=8, logprobs=5)]
    outputs = [[], [], [int(logits[2].argmax())], []]
    metadata = SamplingMetadata.build(params, [[]] * 4, outputs, vocab_size)

    # When sampled
    out = Sampler(seed=0)(logits, metadata)

    # Then each sampled token's logprob is log_softmax of the penalised logits at its id
    expected = Sampler.apply_penalties(logits, metadata).log_softmax(dim=-1)
    assert out.logprobs[0] is None
    for row, n in ((1, 0), (2, 3), (3, 5)):
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.sampled_token_ids[row]
        assert lp.logprob == pytest.approx(expected[row, lp.token_id].item(), abs=1e-6)
        # and the top n are the n most likely tokens, sorted, n of them
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == n
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        top = expected[row].topk(n) if n else None
        if top is not None:
            assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
            assert lp.top_token_ids[0] == top.indices[0].item()
            assert [expected[row, t].item() for t in lp.top_token_ids] == pytest.approx(
                lp.top_logprobs, abs=1e-6)


# --- the model runner's view --------------------------------------------------------------------

def test_metadata_holds_no_tensors_for_features_no_row_uses():
    # Given an all-greedy batch without penalties or logprobs (the common decode step)
    params = [SamplingParams(temperature=0.0)] * 64
    metadata = SamplingMetadata.build(params, [[1, 2]] * 64, [[3]] * 64, 49152)
    # Then nothing beyond the argmax is prepared
    assert metadata.all_greedy and not metadata.has_penalties
    assert metadata.temperature is metadata.top_k is metadata.top_p is None
    assert metadata.log_min_p is metadata.seeded_uniforms is metadata.unseeded is None
    assert metadata.output_token_counts is metadata.seen_token_mask is None
    assert metadata.logprob_rows == []
    # And filters set only on greedy rows are ignored too
    metadata = SamplingMetadata.build(
        [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)], [[]], [[]], 100)
    assert metadata.top_k is metadata.top_p is metadata.log_min_p is None


def test_bfloat16_logits_are_sampled_and_left_untouched():
    # Given bfloat16 logits, as a bfloat16 model produces them
    logits = random_logits(3, 100, seed=31).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(seed=1, top_p=0.9, logprobs=2),
              SamplingParams(presence_penalty=1.0, min_p=0.1)]
    # When sampled
    out = sample(logits, params, [[1], [2], [3]])
    # Then the greedy row took the argmax, every row got a token, and the input is unchanged
    assert out.sampled_token_ids[0] == int(logits[0].float().argmax())
    assert all(0 <= t < 100 for t in out.sampled_token_ids)
    assert torch.equal(logits, before)


def test_an_empty_step_samples_nothing():
    out = sample(torch.empty(0, 10), [])
    assert out == SamplerOutput([], [], {})
