"""logit_bias, allowed_token_ids and bad_words stay exact under speculative decoding: a draft
token they ban is rejected at verification, so the output is the plain engine's (tiny random
Llama, float32; drafts from `OracleSpeculator`)."""

from __future__ import annotations

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.sampling_params import SamplingParams
from tests.engine.spec_oracle import use_oracle


def make_engine(tiny_model, tiny_model_path, speculative: bool) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_model_path), dtype="float32",
                                   num_kv_blocks=256,
                                   speculative_method="ngram" if speculative else None),
                      loaded=tiny_model)


def test_adjusted_output_is_the_same_with_drafts_that_ignore_the_adjustments(tiny_model,
                                                                             tiny_model_path):
    # Given prompts, their free greedy outputs, and adjustments that change those outputs
    prompts = [[100 + (i * 31 + j * 17) % 400 for j in range(6 + i)] for i in range(4)]
    free_params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = make_engine(tiny_model, tiny_model_path, speculative=False)
    free = [o.new_token_ids for o in plain.generate(prompts, free_params)]
    banned = free[0][3]
    pair = (free[1][4], free[1][5])  # a two-token bad word, by its ids
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                             logit_bias=((banned, -100.0),)),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                             bad_words=("w",), bad_words_token_ids=(pair,)),
              SamplingParams(max_tokens=20, temperature=0.7, seed=5, ignore_eos=True,
                             allowed_token_ids=tuple(sorted(set(free[2]))[:-1])),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                             logit_bias=((free[3][0], 5.0), (free[3][1], -3.0)))]
    expected = [o.new_token_ids for o in plain.generate(prompts, params)]
    assert expected != free  # the adjustments change something
    # When a speculating engine drafts the free outputs (what the adjustments forbid)
    engine = make_engine(tiny_model, tiny_model_path, speculative=True)
    speculator = use_oracle(engine, {tuple(p): f for p, f in zip(prompts, free, strict=True)},
                            corrupt_every=0)
    outs = engine.generate(prompts, params)
    # Then every output is the plain engine's with the adjustments, drafts were rejected
    assert [o.new_token_ids for o in outs] == expected
    assert banned not in outs[0].new_token_ids
    got = outs[1].new_token_ids
    assert pair not in set(zip(got, got[1:], strict=False))
    assert set(outs[2].new_token_ids) <= set(params[2].allowed_token_ids or ())
    stats = speculator.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens
