"""Speculative decoding with a draft model is exact: greedy and seeded outputs token for token,
unseeded ones in distribution, through preemption, prefix-cache hits, chunked prefill, n > 1,
opt-outs and aborts; and a draft of another vocabulary is refused at load.

Tiny random Llamas, float32. The target drafting for itself accepts every draft token (which
proves the draft's KV follows the request's tokens); the same weights quantized to Q8_0 instead
of Q4_1 disagree on near-ties, so its drafts are accepted and rejected at every position.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.model.loader import LoadedModel, load_model
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.spec_decode.draft_model import DraftModelProposer
from tests.engine.test_spec_decode import assert_same_sampled_tokens
from tests.fixtures.tiny_gguf import write_tiny_llama

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def other_draft_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's own weights (same seed) quantized differently: a near, imperfect draft."""
    path = tmp_path_factory.mktemp("draft") / "tiny-q8.gguf"
    write_tiny_llama(path, weight_type=gguf.GGMLQuantizationType.Q8_0)
    return path


@pytest.fixture(scope="module")
def other_draft(other_draft_path: Path) -> LoadedModel:
    return load_model(other_draft_path, "float32")


def make_engine(target: LoadedModel, target_path: Path, draft: LoadedModel | None = None,
                draft_path: Path | None = None, **overrides: object) -> EngineCore:
    fields: dict = {"model": str(target_path), "dtype": "float32", "num_kv_blocks": 256}
    if draft_path is not None:
        fields.update(speculative_method="draft", draft_model=str(draft_path))
    fields.update(overrides)
    return EngineCore(EngineConfig(**fields), loaded=target, draft=draft)


def prompts_of(n: int) -> list[list[int]]:
    return [[100 + (i * 31 + j * 17) % 400 for j in range(5 + i)] for i in range(n)]


def plain_outputs(tiny_model, tiny_model_path, prompts, params, **overrides) -> list[list[int]]:
    plain = make_engine(tiny_model, tiny_model_path, **overrides)
    return [o.new_token_ids for o in plain.generate(prompts, params)]


def proposer_of(engine: EngineCore) -> DraftModelProposer:
    assert engine.draft_speculator is not None
    return engine.draft_speculator.proposer


def assert_draft_cache_empty(engine: EngineCore) -> None:
    proposer = proposer_of(engine)
    assert not proposer.seqs
    assert proposer.num_free_blocks == proposer.num_blocks - 1  # block 0 pads the tables


def test_the_target_drafting_for_itself_accepts_every_draft_token(tiny_model, tiny_model_path):
    # Given 10 prompts and their greedy outputs without speculation
    prompts = prompts_of(10)
    expected = plain_outputs(tiny_model, tiny_model_path, prompts, GREEDY)
    engine = make_engine(tiny_model, tiny_model_path, tiny_model, tiny_model_path)
    # When the model drafts for itself
    outs = engine.generate(prompts, GREEDY)
    # Then the outputs are the same, every draft token was accepted (the draft's KV is exactly
    # at the request's tokens, step after step), whole 4-token drafts included
    assert [o.new_token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 100
    assert stats.spec_acceptance_rate == 1.0
    assert engine.draft_speculator is not None
    assert engine.draft_speculator.stats.accepted_per_position[3] > 0
    assert engine.stats().kv_cache_usage == 0.0
    assert_draft_cache_empty(engine)


def test_a_different_draft_changes_nothing_but_the_speed(tiny_model, tiny_model_path,
                                                         other_draft, other_draft_path):
    # Given greedy outputs without speculation
    prompts = prompts_of(12)
    expected = plain_outputs(tiny_model, tiny_model_path, prompts, GREEDY)
    engine = make_engine(tiny_model, tiny_model_path, other_draft, other_draft_path)
    # When a draft that often disagrees proposes
    outs = engine.generate(prompts, GREEDY)
    # Then the outputs are the same, drafts were both accepted and rejected (rolled back)
    assert [o.new_token_ids for o in outs] == expected
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_draft_cache_empty(engine)


@pytest.mark.parametrize("draft_name", ["self", "other"])
def test_preemption_and_prefix_cache_hits_in_the_middle_of_drafting(
        tiny_model, tiny_model_path, other_draft, other_draft_path, draft_name):
    # Given 16 prompts sharing a 2-block prefix, on a cache far too small to run them together
    prefix = list(range(200, 208))
    prompts = [prefix + p for p in prompts_of(16)]
    expected = plain_outputs(tiny_model, tiny_model_path, prompts, GREEDY)
    draft, draft_path = (tiny_model, tiny_model_path) if draft_name == "self" \
        else (other_draft, other_draft_path)
    engine = make_engine(tiny_model, tiny_model_path, draft, draft_path, num_kv_blocks=28,
                         block_size=4)
    # When they run together with a draft model: requests are preempted between drafted
    # steps and resumed from the prefix cache, the draft recomputing their prompts
    outs = engine.generate(prompts, GREEDY)
    # Then nothing changed, and all of that happened
    assert [o.new_token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert engine.scheduler.kv_cache_manager.num_prefix_hits > 0
    assert stats.spec_num_accepted_tokens > 0
    if draft_name == "self":
        assert stats.spec_acceptance_rate == 1.0
    assert stats.kv_cache_usage == 0.0
    assert_draft_cache_empty(engine)


def test_requests_the_draft_cache_cannot_hold_decode_without_drafts(tiny_model,
                                                                    tiny_model_path):
    # Given a draft cache of 6 blocks of 4 tokens (its sizing never allows that few: trimmed
    # here) for 8 requests of ~30 tokens each
    prompts = prompts_of(8)
    expected = plain_outputs(tiny_model, tiny_model_path, prompts, GREEDY, block_size=4)
    engine = make_engine(tiny_model, tiny_model_path, tiny_model, tiny_model_path,
                         block_size=4)
    proposer = proposer_of(engine)
    del proposer.free_blocks[:-6]
    # When they run together
    outs = engine.generate(prompts, GREEDY)
    # Then the ones that found room drafted, the others did not, and nothing changed
    assert [o.new_token_ids for o in outs] == expected
    assert engine.stats().spec_num_accepted_tokens > 0
    assert not proposer.seqs and proposer.num_free_blocks == 6


@pytest.mark.parametrize("stop", ["max_tokens", "stop_token_ids", "stop"])
def test_stops_inside_an_accepted_draft_are_honoured(tiny_model, tiny_model_path, stop):
    # Given requests whose stop condition falls inside a run of accepted draft tokens
    prompts = prompts_of(4)
    references = plain_outputs(tiny_model, tiny_model_path, prompts, GREEDY)
    plain = make_engine(tiny_model, tiny_model_path)
    params = []
    for reference in references:
        fields: dict = {"max_tokens": 7} if stop == "max_tokens" else \
            {"stop_token_ids": (reference[9],)} if stop == "stop_token_ids" else \
            {"stop": (plain.tokenizer.decode(reference[6:8]),)}
        params.append(SamplingParams(**{**{"max_tokens": 24, "temperature": 0.0,
                                           "ignore_eos": True}, **fields}))
    expected = plain.generate(prompts, params)
    # When they run with the model drafting for itself
    engine = make_engine(tiny_model, tiny_model_path, tiny_model, tiny_model_path)
    outs = engine.generate(prompts, params)
    # Then they stop where the plain runs did, with the same text
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in expected]
    assert [o.text for o in outs] == [o.text for o in expected]
    assert engine.stats().spec_num_accepted_tokens > 0
    assert_draft_cache_empty(engine)


def test_long_prompts_are_caught_up_in_chunks(tiny_model, tiny_model_path):
    # Given prompts longer than a step's token budget (chunked prefill, and the draft's
    # catch-up of a prompt in pieces)
    prompts = [[100 + (i * 7 + j * 13) % 400 for j in range(40 + 9 * i)] for i in range(3)]
    expected = plain_outputs(tiny_model, tiny_model_path, prompts, GREEDY,
                             max_num_batched_tokens=16)
    engine = make_engine(tiny_model, tiny_model_path, tiny_model, tiny_model_path,
                         max_num_batched_tokens=16)
    # When they run with the model drafting for itself
    outs = engine.generate(prompts, GREEDY)
    # Then the outputs are the same and the drafts all right
    assert [o.new_token_ids for o in outs] == expected
    assert engine.stats().spec_acceptance_rate == 1.0
    assert engine.stats().spec_num_draft_tokens > 30


def test_seeded_parallel_samples_draw_the_same_tokens(tiny_model, tiny_model_path, other_draft,
                                                      other_draft_path):
    # Given seeded requests with n = 3 and penalties
    prompts = prompts_of(4)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=i, n=3,
                             presence_penalty=0.2, ignore_eos=True) for i in range(4)]
    expected = plain_outputs(tiny_model, tiny_model_path, prompts, params)
    engine = make_engine(tiny_model, tiny_model_path, other_draft, other_draft_path)
    # When they run with a draft model
    outs = engine.generate(prompts, params)
    # Then each child drew the very same tokens (a greedy draft is a one-hot proposal)
    assert [o.new_token_ids for o in outs] == expected
    assert engine.stats().spec_num_draft_tokens > 0
    assert_draft_cache_empty(engine)


def test_opted_out_requests_never_run_the_draft(tiny_model, tiny_model_path):
    # Given requests that opt out of speculation
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, speculative=False)
    engine = make_engine(tiny_model, tiny_model_path, tiny_model, tiny_model_path)
    proposer = proposer_of(engine)
    # When they run beside one that does not
    engine.add_request("out-1", prompts_of(2)[0], params)
    engine.add_request("out-2", prompts_of(2)[1], params)
    engine.add_request("in", prompts_of(3)[2], GREEDY)
    drafted_for: set[str] = set()  # requests holding draft KV after a step
    while engine.has_unfinished_requests():
        engine.step()
        drafted_for |= set(proposer.seqs)
    # Then the draft ran for the one that did, only
    assert drafted_for == {"in"}
    assert engine.stats().spec_num_draft_tokens > 0


def test_an_aborted_request_frees_its_draft_cache(tiny_model, tiny_model_path):
    # Given two drafting requests a few steps in
    engine = make_engine(tiny_model, tiny_model_path, tiny_model, tiny_model_path)
    proposer = proposer_of(engine)
    engine.add_request("a", prompts_of(2)[0], GREEDY)
    engine.add_request("b", prompts_of(2)[1], GREEDY)
    for _ in range(4):
        engine.step()
    assert set(proposer.seqs) == {"a", "b"}
    # When one is aborted
    engine.abort(["a"])
    engine.step()
    # Then its draft blocks are free at once; the other finishes, and all are free
    assert set(proposer.seqs) == {"b"}
    while engine.has_unfinished_requests():
        engine.step()
    assert_draft_cache_empty(engine)


def test_the_draft_cache_sleeps_and_wakes_with_the_engine(tiny_model, tiny_model_path):
    # Given an engine drafting with a model, after one request
    prompts = prompts_of(3)
    expected = plain_outputs(tiny_model, tiny_model_path, prompts, GREEDY)
    engine = make_engine(tiny_model, tiny_model_path, tiny_model, tiny_model_path)
    engine.generate(prompts[:1], GREEDY)
    # When it sleeps (its KV caches freed, the draft's too) and wakes up
    engine.sleep(1)
    assert proposer_of(engine).kv_caches == []
    engine.wake_up()
    # Then it drafts as before
    assert [o.new_token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert engine.stats().spec_acceptance_rate == 1.0


def test_sampled_tokens_follow_the_target_distribution(tiny_model, tiny_model_path,
                                                       other_draft, other_draft_path):
    # Given one prompt sampled 1200 times without speculation (seeds 0..1199), and 1200 times
    # with a draft model (seeds 10000..11199, so no run can repeat another's draws)
    prompt = prompts_of(1)[0]
    n = 1200

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=4, temperature=1.0, top_k=6, seed=seed,
                              ignore_eos=True)

    plain = make_engine(tiny_model, tiny_model_path, max_num_seqs=256)
    base = plain.generate([prompt] * n, [params(s) for s in range(n)])
    engine = make_engine(tiny_model, tiny_model_path, tiny_model, tiny_model_path,
                         max_num_seqs=256)
    spec = engine.generate([prompt] * n, [params(10_000 + s) for s in range(n)])
    # Then drafts (the greedy continuation) were accepted only sometimes, and the tokens at
    # the drafted positions 1..3 (and the pairs at 1, 2) have the same frequencies, by a
    # chi-square test at p = 0.001
    stats = engine.stats()
    assert 100 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_same_sampled_tokens(base, spec)


def test_a_draft_of_another_vocabulary_is_refused_naming_both(tiny_model, tiny_model_path,
                                                             tmp_path):
    # Given a draft model whose vocabulary is larger than the target's
    draft_path = tmp_path / "tiny-600.gguf"
    write_tiny_llama(draft_path, vocab=600)
    # When an engine is built with it
    with pytest.raises(ValueError) as refused:
        make_engine(tiny_model, tiny_model_path, draft_path=draft_path)
    # Then it is refused at load, naming both models
    message = str(refused.value)
    assert "does not share the vocabulary" in message
    assert str(draft_path) in message and str(tiny_model_path) in message


@pytest.mark.parametrize(("fields", "error"), [
    ({"speculative_method": "draft"}, "needs a draft_model"),
    ({"speculative_method": "ngram", "draft_model": "x.gguf"}, "only used with"),
    ({"draft_model": "x.gguf"}, "only used with"),
])
def test_draft_flags_are_checked(fields, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(**fields)


@pytest.mark.model
def test_the_default_model_drafting_for_itself_keeps_every_token(default_model_f32,
                                                                 default_model_path):
    # Given three chat prompts and their greedy answers on SmolLM2-135M-Instruct
    questions = ["Write a story about a cat.", "List the planets of the solar system.",
                 "Explain photosynthesis."]
    tok = default_model_f32.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = plain_outputs(default_model_f32, default_model_path, prompts, params)
    # When they run together, the model drafting for itself from its own KV cache
    engine = make_engine(default_model_f32, default_model_path, default_model_f32,
                         default_model_path)
    outs = engine.generate(prompts, params)
    # Then the answers are the same and (float32 rounding aside) every draft token is kept
    assert [o.new_token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 30
    assert stats.spec_acceptance_rate > 0.95
    assert_draft_cache_empty(engine)
