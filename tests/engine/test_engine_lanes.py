"""Lanes through the whole engine (tiny random Llama, float32): batch requests that sit steps
out for an interactive one, and whose prompts are cut by `max_batch_prefill_tokens`, produce the
same greedy tokens as without lanes, with speculative decoding, n > 1, chunked prefill and the
prefix cache all in play."""

from __future__ import annotations

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.sampling_params import SamplingParams
from tests.engine.spec_oracle import use_oracle

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TWO = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2)


def make_engine(tiny_model, tiny_model_path, **overrides) -> EngineCore:
    fields = {"model": str(tiny_model_path), "dtype": "float32", "num_kv_blocks": 256,
              "block_size": 4}
    fields.update(overrides)
    return EngineCore(EngineConfig(**fields), loaded=tiny_model)


def test_batch_work_beside_an_interactive_request_gives_the_tokens_it_gives_alone(
        tiny_model, tiny_model_path):
    # Given batch prompts (one long, two sharing a prefix, one asking for 2 completions), an
    # interactive prompt, and each one's greedy tokens run alone without lanes
    shared = [200 + j for j in range(12)]
    batch = {"a": shared + [5, 6], "b": shared + [7, 8, 9], "two": [300 + j for j in range(9)],
             **{f"s{i}": [100 + (i * 31 + j * 17) % 400 for j in range(5 + i)] for i in range(4)},
             "long": [100 + (j * 7) % 300 for j in range(90)]}
    online = [150 + j for j in range(7)]
    plain = make_engine(tiny_model, tiny_model_path)
    expected = {name: plain.generate([prompt], TWO if name == "two" else GREEDY)
                for name, prompt in {**batch, "online": online}.items()}
    expected_tokens = {name: [o.new_token_ids for o in outs] for name, outs in expected.items()}
    # When they run on an engine with speculation, steps of 32 tokens, at most 8 of them batch
    # prompt, and the interactive request arrives while the long prompt is half computed
    engine = make_engine(tiny_model, tiny_model_path, speculative_method="ngram",
                         max_num_batched_tokens=32, max_batch_prefill_tokens=8)
    speculator = use_oracle(engine, {tuple(prompt): expected_tokens[name][0]
                                     for name, prompt in batch.items()})
    for name, prompt in batch.items():
        engine.add_request(name, prompt, TWO if name == "two" else GREEDY, batch=True)
    tokens: dict[tuple[str, int], list[int]] = {}

    def step() -> set[str]:
        outs = engine.step()
        for out in outs:
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        return {out.request_id for out in outs if out.new_token_ids}

    long = engine.scheduler.requests["long"]
    while long.num_computed_tokens == 0:
        step()
    assert long.num_computed_tokens < 90 and tokens
    engine.add_request("online", online, GREEDY)
    # Then the very next step gives it its first token, and no batch request a token
    assert step() == {"online"}
    while engine.has_unfinished_requests():
        step()
    # And every request produced what it produces alone
    for name, outs in expected_tokens.items():
        assert [tokens[(name, index)] for index in range(len(outs))] == outs
    assert speculator.stats.num_accepted_tokens > 0
    assert engine.stats().kv_cache_usage == 0.0
