"""Speculative decoding is exact: the same tokens (greedy, seeded) or the same distribution
(unseeded) as plain decoding, through preemption, prefix-cache hits and stops inside a run.

Tiny random Llama, float32. Drafts come from `OracleSpeculator` (what a plain run produced,
with every fifth token wrong), since the tiny model never copies its prompt; prompt lookup
itself is tested on the real model below (slow) and in tests/unit/test_spec_decode_units.py.
"""

from __future__ import annotations

import collections
import math

import pytest

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.model.loader import load_model
from llmq.worker.engine.sampling_params import SamplingParams
from tests.engine.spec_oracle import use_oracle

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_engine(tiny_model, tiny_model_path, speculative: bool, **overrides) -> EngineCore:
    fields = {"model": str(tiny_model_path), "dtype": "float32", "num_kv_blocks": 256,
              "speculative_method": "ngram" if speculative else None}
    fields.update(overrides)
    return EngineCore(EngineConfig(**fields), loaded=tiny_model)


def prompts_of(n: int) -> list[list[int]]:
    return [[100 + (i * 31 + j * 17) % 400 for j in range(5 + i)] for i in range(n)]


def references(tiny_model, tiny_model_path, prompts, params) -> dict[tuple[int, ...], list[int]]:
    plain = make_engine(tiny_model, tiny_model_path, speculative=False)
    outs = plain.generate(prompts, params)
    return {tuple(p): o.new_token_ids for p, o in zip(prompts, outs, strict=True)}


def test_greedy_output_is_identical_with_and_without_speculation(tiny_model, tiny_model_path):
    # Given 12 prompts, their greedy outputs without speculation, and drafts often wrong
    prompts = prompts_of(12)
    expected = references(tiny_model, tiny_model_path, prompts, GREEDY)
    engine = make_engine(tiny_model, tiny_model_path, speculative=True)
    speculator = use_oracle(engine, expected)
    # When they run together with speculation
    outs = engine.generate(prompts, GREEDY)
    # Then every output is the same, drafts were both accepted and rejected, and no block leaks
    assert [o.new_token_ids for o in outs] == [expected[tuple(p)] for p in prompts]
    stats = speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[3] > 0  # whole 4-token drafts were accepted too
    assert engine.stats().kv_cache_usage == 0.0


def test_seeded_sampling_draws_the_same_tokens_with_speculation(tiny_model, tiny_model_path):
    # Given sampled requests with seeds, penalties, top-k and top-p
    prompts = prompts_of(8)
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=i,
                             frequency_penalty=0.3, repetition_penalty=1.1, ignore_eos=True)
              for i in range(len(prompts))]
    plain = make_engine(tiny_model, tiny_model_path, speculative=False)
    expected = [o.new_token_ids for o in plain.generate(prompts, params)]
    engine = make_engine(tiny_model, tiny_model_path, speculative=True)
    speculator = use_oracle(engine, {tuple(p): e for p, e in zip(prompts, expected,
                                                                 strict=True)})
    # When they run with speculation
    outs = engine.generate(prompts, params)
    # Then each row drew with the same uniform as without: the very same tokens
    assert [o.new_token_ids for o in outs] == expected
    assert speculator.stats.num_accepted_tokens > 0


def _chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z of the normal), Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _two_sample_chi_square(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Homogeneity chi-square of two samples of tokens; rare tokens pooled into one cell."""
    n_a, n_b = sum(a.values()), sum(b.values())
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    cells = [(a[t], b[t]) for t in common]
    rest = (n_a - sum(c[0] for c in cells), n_b - sum(c[1] for c in cells))
    if sum(rest) > 0:
        cells.append(rest)
    stat = 0.0
    for count_a, count_b in cells:
        total = count_a + count_b
        for count, n in ((count_a, n_a), (count_b, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (count - expected) ** 2 / expected
    return stat, len(cells) - 1


def assert_same_sampled_tokens(base: list, spec: list) -> None:
    """Outputs of one sampled prompt with and without drafts: the tokens at the drafted
    positions 1..3 have the same frequencies position by position, and so do the pairs at
    (1, 2), by a chi-square test at p = 0.001."""
    for position in (1, 2, 3):
        a = collections.Counter(o.new_token_ids[position] for o in base)
        b = collections.Counter(o.new_token_ids[position] for o in spec)
        stat, dof = _two_sample_chi_square(a, b)
        assert dof >= 3
        assert stat < _chi_square_critical(dof), (position, stat, dof, a, b)
    a = collections.Counter(tuple(o.new_token_ids[1:3]) for o in base)
    b = collections.Counter(tuple(o.new_token_ids[1:3]) for o in spec)
    stat, dof = _two_sample_chi_square(a, b)
    assert stat < _chi_square_critical(dof), (stat, dof)


def test_unseeded_and_differently_seeded_outputs_have_the_same_distribution(
        tiny_model, tiny_model_path):
    # Given one prompt sampled 1500 times without speculation (seeds 0..1499), and 1500 times
    # with it (seeds 10000..11499, so no run can simply repeat another's draws), drafts being
    # the greedy continuation (accepted only when the sample happens to agree)
    prompt = prompts_of(1)[0]
    n = 1500

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=4, temperature=1.0, top_k=6, seed=seed,
                              ignore_eos=True)

    greedy = references(tiny_model, tiny_model_path, [prompt], GREEDY)
    plain = make_engine(tiny_model, tiny_model_path, speculative=False, max_num_seqs=256)
    base = plain.generate([prompt] * n, [params(s) for s in range(n)])
    engine = make_engine(tiny_model, tiny_model_path, speculative=True, max_num_seqs=256)
    speculator = use_oracle(engine, greedy, corrupt_every=0)
    spec = engine.generate([prompt] * n, [params(10_000 + s) for s in range(n)])
    # Then the tokens at the drafted positions 1..3 (position 0 comes from the prefill) have
    # the same frequencies, by a chi-square test at p = 0.001, position by position, and so do
    # the pairs (position 1, position 2), the draft's first two verdicts together
    assert speculator.stats.num_accepted_tokens > 100
    assert speculator.stats.num_accepted_tokens < speculator.stats.num_draft_tokens
    assert_same_sampled_tokens(base, spec)


def test_preemption_and_prefix_cache_hits_in_the_middle_of_speculation(
        tiny_model, tiny_model_path):
    # Given 16 prompts sharing a 2-block prefix, on a cache far too small to run them together
    prefix = list(range(200, 208))
    prompts = [prefix + p for p in prompts_of(16)]
    expected = references(tiny_model, tiny_model_path, prompts, GREEDY)
    engine = make_engine(tiny_model, tiny_model_path, speculative=True, num_kv_blocks=28,
                         block_size=4)
    speculator = use_oracle(engine, expected)
    # When they run together with speculation: requests are preempted between speculated
    # steps and resumed from blocks the speculated steps wrote and the prefix cache kept
    outs = engine.generate(prompts, GREEDY)
    # Then nothing changed, and all of that happened
    assert [o.new_token_ids for o in outs] == [expected[tuple(p)] for p in prompts]
    assert engine.stats().num_preemptions > 0
    assert engine.scheduler.kv_cache_manager.num_prefix_hits > 0
    assert speculator.stats.num_accepted_tokens > 0
    assert engine.stats().kv_cache_usage == 0.0


def test_a_prompt_continuing_a_speculated_output_reuses_only_correct_blocks(
        tiny_model, tiny_model_path):
    # Given a request run with speculation (rejected drafts wrote KV past its accepted tokens)
    prompt = prompts_of(3)[2]
    expected = references(tiny_model, tiny_model_path, [prompt], GREEDY)
    engine = make_engine(tiny_model, tiny_model_path, speculative=True, block_size=4)
    use_oracle(engine, expected)
    (first,) = engine.generate([prompt], GREEDY)
    # When a second prompt is the first one's prompt and output, so its blocks hit the cache
    follow_up = prompt + first.new_token_ids[:-3]
    plain = make_engine(tiny_model, tiny_model_path, speculative=False, block_size=4)
    (reference,) = plain.generate([follow_up], GREEDY)
    (second,) = engine.generate([follow_up], GREEDY)
    # Then it found them cached, and their KV is what a plain run computes: same output
    assert second.usage.cached_prompt_tokens >= len(follow_up) - 4
    assert second.new_token_ids == reference.new_token_ids


@pytest.mark.parametrize("stop", [
    {"max_tokens": 7},
    {"stop_token_ids": "token 5"},
    {"stop": "text of tokens 3..4"},
    {"max_model_len": 20},
])
def test_stops_inside_an_accepted_run_are_honoured(tiny_model, tiny_model_path, stop):
    # Given a request whose drafts are all right, 8 at a time, and a stop condition that
    # falls inside an accepted run
    prompt = prompts_of(6)[5]  # 10 tokens
    reference = references(tiny_model, tiny_model_path, [prompt], GREEDY)[tuple(prompt)]
    plain = make_engine(tiny_model, tiny_model_path, speculative=False,
                        max_model_len=stop.get("max_model_len"))
    text = plain.tokenizer.decode(reference[3:5])
    fields = {"max_tokens": 7} if "max_tokens" in stop else \
        {"stop_token_ids": (reference[5],)} if "stop_token_ids" in stop else \
        {"stop": (text,)} if "stop" in stop else {}
    params = SamplingParams(**{"max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
                               **fields})
    (expected,) = plain.generate([prompt], params)
    engine = make_engine(tiny_model, tiny_model_path, speculative=True,
                         max_model_len=stop.get("max_model_len"))
    speculator = use_oracle(engine, {tuple(prompt): reference}, corrupt_every=0, k=8)
    # When it runs with speculation, streaming
    engine.add_request("r", prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    # Then it stops exactly where the plain run did, with the same text and reason
    assert [t for d in deltas for t in d.new_token_ids] == expected.new_token_ids
    assert "".join(d.new_text for d in deltas) == expected.text
    last = deltas[-1]
    assert (last.text, last.finish_reason, last.stop_reason) == (
        expected.text, expected.finish_reason, expected.stop_reason)
    # And a delta carried several tokens at once
    assert max(len(d.new_token_ids) for d in deltas) > 1
    assert speculator.stats.num_accepted_tokens > 0
    assert engine.stats().kv_cache_usage == 0.0


def streamed_logprobs(engine: EngineCore, prompt: list[int], params: SamplingParams) -> list:
    """The logprobs of every output, as the steps streamed them."""
    engine.add_request("r", prompt, params)
    logprobs = []
    while engine.has_unfinished_requests():
        logprobs += [lp for out in engine.step() for lp in out.new_logprobs]
    return logprobs


def test_logprobs_come_for_every_accepted_token(tiny_model, tiny_model_path):
    prompt = prompts_of(4)[3]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = make_engine(tiny_model, tiny_model_path, speculative=False)
    engine = make_engine(tiny_model, tiny_model_path, speculative=True)
    # Given a greedy request asking for logprobs, and drafts from its plain run
    expected = streamed_logprobs(plain, prompt, params)
    use_oracle(engine, {tuple(prompt): [lp.token_id for lp in expected]})
    # When it runs with speculation
    logprobs = streamed_logprobs(engine, prompt, params)
    # Then each accepted token has its logprob and top logprobs, as without speculation
    assert [lp.token_id for lp in logprobs] == [lp.token_id for lp in expected]
    for got, want in zip(logprobs, expected, strict=True):
        assert got.top_token_ids == want.top_token_ids
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


@pytest.mark.usefixtures("cpu_kernels")
def test_native_quantized_verification_computes_the_decodes_logits_bit_for_bit(tiny_model_path):
    # Given the tiny model on its GGUF blocks (the compiled quantized kernels, as the default
    # model runs in a worker), and greedy requests asking for logprobs
    loaded = load_model(tiny_model_path, "bfloat16")
    prompts = prompts_of(3)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)

    def engine(speculative: bool) -> EngineCore:
        return EngineCore(EngineConfig(model=str(tiny_model_path), dtype="bfloat16",
                                       speculative_method="ngram" if speculative else None),
                          loaded=loaded)

    expected = [streamed_logprobs(engine(False), p, params) for p in prompts]
    # When each runs with speculation, drafts of up to 7 tokens (verifications of up to 8
    # rows) from its plain run, every ninth draft token wrong
    speculating = engine(True)
    speculator = use_oracle(speculating, {tuple(p): [lp.token_id for lp in e]
                                          for p, e in zip(prompts, expected, strict=True)},
                            corrupt_every=9, k=7)
    got = [streamed_logprobs(speculating, p, params) for p in prompts]
    # Then every verified row's logits were the lone decode's to the bit: the same tokens,
    # logprobs and top logprobs exactly (a near tie cannot go the other way)
    stats = speculator.stats
    assert stats.accepted_per_position[6] > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert got == expected


def test_a_request_that_opts_out_never_drafts(tiny_model, tiny_model_path):
    # Given a speculating engine
    prompts = prompts_of(3)
    expected = references(tiny_model, tiny_model_path, prompts, GREEDY)
    engine = make_engine(tiny_model, tiny_model_path, speculative=True)
    speculator = use_oracle(engine, expected)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    # When requests opt out of speculation on an engine that runs it
    outs = engine.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == [expected[tuple(p)] for p in prompts]
    # Then they never draft, and produce the same tokens
    assert speculator.stats.num_draft_tokens == 0


COPY_PROMPTS = [
    "Repeat the following list in reverse order, one item per line: apple, banana, cherry, "
    "date, elderberry, fig, grape, honeydew, kiwi, lemon.",
    'Re-format this JSON record with one key per line: {"id": 48213, "name": "Alice Johnson", '
    '"email": "alice.johnson@example.com", "city": "Portland", "skills": ["python", "sql"]}',
]
STORY_PROMPT = "Write a short story about a dragon who learns to bake bread."


def chat(tokenizer, user: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prompt_lookup_on_the_real_model_keeps_greedy_output_and_accepts_copies(
        default_model_f32, default_model_path):
    # Given the default model in float32, prompts whose answers copy their prompt and one that
    # does not
    def engine(speculative: bool) -> EngineCore:
        return EngineCore(EngineConfig(model=str(default_model_path), dtype="float32",
                                       speculative_method="ngram" if speculative else None),
                          loaded=default_model_f32)

    tokenizer = default_model_f32.tokenizer
    prompts = [chat(tokenizer, p) for p in [*COPY_PROMPTS, STORY_PROMPT]]
    params = SamplingParams(max_tokens=96, temperature=0.0)
    expected = [o.new_token_ids for o in engine(False).generate(prompts, params)]
    # When each runs alone with prompt-lookup speculation
    speculating = engine(True)
    outs, rates = [], []
    for prompt in prompts:
        before = speculating.stats()
        outs.append(speculating.generate([prompt], params)[0].new_token_ids)
        after = speculating.stats()
        drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        rates.append((accepted / drafted if drafted else 0.0, drafted))
    # Then the outputs are the same (float32: the kernels agree to ~1e-5 whatever the rows
    # beside a row, see worker/engine/spec_decode/rejection_sampler.py), and the copying
    # answers accepted a good part of their drafts
    assert outs == expected
    assert all(rate >= 0.4 and drafted >= 10 for rate, drafted in rates[:2]), rates


LIGHTHOUSE_PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a "
                     "bottle.")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("cpu_kernels")
def test_prompt_lookup_on_the_native_default_model_keeps_a_long_story_exact(default_model_path):
    # Given the default model as a worker runs it (Q4_1 blocks on the quantized kernels), and
    # bench/spec_decode.py's story whose plain greedy run meets a near tie at token 190 (top
    # two logits 0.004 apart): verification rows once computed it 0.009 the other way
    loaded = load_model(default_model_path, "bfloat16")
    prompt = loaded.tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        f"Face<|im_end|>\n<|im_start|>user\n{LIGHTHOUSE_PROMPT}<|im_end|>\n"
        "<|im_start|>assistant\n")
    params = SamplingParams(max_tokens=200, temperature=0.0)

    def engine(speculative: bool) -> EngineCore:
        return EngineCore(EngineConfig(model=str(default_model_path),
                                       speculative_method="ngram" if speculative else None),
                          loaded=loaded)

    (expected,) = engine(False).generate([prompt], params)
    # When it runs alone with prompt-lookup speculation
    (got,) = engine(True).generate([prompt], params)
    # Then the story is token for token the same
    assert len(expected.new_token_ids) == 200
    assert got.new_token_ids == expected.new_token_ids


def test_parallel_sampling_children_speculate_and_draw_the_same_tokens(
        tiny_model, tiny_model_path):
    # Given a seeded request for 3 completions, and drafts from its first completion
    prompt = prompts_of(20)[19]  # 24 tokens: the parent prefills shared blocks, then forks
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, n=3, ignore_eos=True)
    plain = make_engine(tiny_model, tiny_model_path, speculative=False, block_size=4)
    expected = [o.new_token_ids for o in plain.generate([prompt], params)]
    engine = make_engine(tiny_model, tiny_model_path, speculative=True, block_size=4)
    speculator = use_oracle(engine, {tuple(prompt): expected[0]})
    # When it runs with speculation
    outs = engine.generate([prompt], params)
    # Then every child drew what it draws without speculation
    assert [o.new_token_ids for o in outs] == expected
    assert speculator.stats.num_accepted_tokens > 0
    assert engine.stats().kv_cache_usage == 0.0
