"""Batch-invariant decoding (EngineConfig.batch_invariant, `llmq worker --batch-invariant`): a
greedy request's tokens and logprobs are bitwise the same alone, inside batches of other
requests, with its prompt chunked at any budget, and after a prefix-cache hit.

The tiny random Llama with native weights (the quantized kernels), as a worker runs a GGUF,
and with float32 dense weights (oneDNN, as a Hugging Face folder or --dtype float32 runs): a
row computed by other arithmetic changes its logprobs' bits (and at its near ties, tokens), so
these fail when the mode is off in any of the paths they cross (projections, LM head,
attention).
"""

from __future__ import annotations

import random
import struct

import pytest
import torch

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.sampling_params import SamplingParams
from tests.fixtures.models import one_torch_thread

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
PROMPT = [100 + (i * 13) % 300 for i in range(70)]

Answer = tuple[list[int], list[bytes]]  # tokens, and each step's logprobs as float32 bytes


@pytest.fixture(scope="module", params=["bfloat16:native", "float32:fp32"])
def invariant_model(tiny_model_path, request):
    """The tiny model loaded batch-invariant, as `dtype:weights` (its own, not the session's
    shared `tiny_model`: the mode changes the model)."""
    from llmq.worker.engine.model.loader import load_model

    one_torch_thread()
    dtype, weights = request.param.split(":")
    return load_model(tiny_model_path, dtype, weights, batch_invariant=True)


def make_engine(model, path, **overrides) -> EngineCore:
    dtype = "float32" if model.model.dtype == torch.float32 else "bfloat16"
    fields = {"model": str(path), "dtype": dtype, "num_kv_blocks": 1024,
              "batch_invariant": True} | overrides
    return EngineCore(EngineConfig(**fields), loaded=model)


def run(engine: EngineCore, prompts: list[list[int]]) -> list[Answer]:
    """Every prompt's greedy tokens and its logprobs (the sampled token's and the top 5's)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    answers: dict[str, Answer] = {f"r{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs = answers[out.request_id]
            tokens += out.new_token_ids
            logprobs += [struct.pack(f"{1 + len(lp.top_logprobs)}f", lp.logprob,
                                     *lp.top_logprobs) for lp in out.new_logprobs]
    return [answers[f"r{i}"] for i in range(len(prompts))]


def others(n: int) -> list[list[int]]:
    """n prompts of 3 to 120 tokens."""
    rng = random.Random(26)
    return [[rng.randrange(100, 500) for _ in range(rng.randint(3, 120))] for _ in range(n)]


@pytest.mark.parametrize("batch", [3, 17, 40])
def test_a_request_answers_the_same_alone_and_inside_a_batch(invariant_model, tiny_model_path,
                                                              batch):
    # Given a request's answer when it runs alone
    alone = run(make_engine(invariant_model, tiny_model_path), [PROMPT])[0]
    assert len(alone[1]) == GREEDY.max_tokens
    # When it runs among other requests of mixed prompt lengths
    mixed = others(batch - 1)
    answers = run(make_engine(invariant_model, tiny_model_path),
                  mixed[:batch // 2] + [PROMPT] + mixed[batch // 2:])
    # Then its tokens and every logprob are bitwise the same
    assert answers[batch // 2] == alone


@pytest.mark.parametrize("budget", [48, 300])
def test_a_prompt_chunked_at_any_budget_answers_the_same(invariant_model, tiny_model_path,
                                                          budget):
    # Given a long prompt's answer prefilled in one step, beside other requests
    long = [100 + (i * 7) % 300 for i in range(700)]
    whole = run(make_engine(invariant_model, tiny_model_path), [long, *others(3)])[0]
    # When the step budget splits it (and its neighbours) into chunks of other sizes
    chunked = make_engine(invariant_model, tiny_model_path, max_num_batched_tokens=budget,
                          max_batch_prefill_tokens=budget)
    answer = run(chunked, [long, *others(3)])[0]
    # Then its tokens and every logprob are bitwise the same
    assert answer == whole


def test_a_prefix_cache_hit_answers_the_same(invariant_model, tiny_model_path):
    # Given a long prompt's answer with nothing cached
    long = [100 + (i * 7) % 300 for i in range(700)]
    fresh = run(make_engine(invariant_model, tiny_model_path), [long])[0]
    # When another request sharing its first 336 tokens (21 blocks) ran before it on the same
    # engine
    engine = make_engine(invariant_model, tiny_model_path)
    run(engine, [long[:336] + [7, 8, 9]])
    engine.add_request("hit", long, GREEDY)
    answer: Answer = ([], [])
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            answer[0].extend(out.new_token_ids)
            answer[1].extend(struct.pack(f"{1 + len(lp.top_logprobs)}f", lp.logprob,
                                         *lp.top_logprobs) for lp in out.new_logprobs)
            if out.finished and out.usage is not None:
                cached = out.usage.cached_prompt_tokens
    # Then its first 336 tokens came from the cache, and its answer is bitwise the same
    assert cached == 336
    assert answer == fresh


def test_a_preempted_request_answers_the_same(invariant_model, tiny_model_path):
    # Given 20 requests' answers on an engine with room for all of them (NOTE: the same block
    # size as below: the attention's order of sums follows the cache's blocks)
    prompts = others(20)
    roomy = run(make_engine(invariant_model, tiny_model_path, block_size=4), prompts)
    # When they run on an engine whose KV cache is far too small, so some are preempted and
    # their prompt and tokens so far computed again as one prefill
    tight = make_engine(invariant_model, tiny_model_path, num_kv_blocks=64, block_size=4,
                        enable_prefix_caching=False)
    answers = run(tight, prompts)
    # Then preemptions happened, and every answer is bitwise the same
    assert tight.stats().num_preemptions > 0
    assert answers == roomy


def test_the_all_bfloat16_path_is_refused(tiny_model_path):
    from llmq.worker.engine.model.loader import load_model

    # Given the tiny model on the all-bfloat16 path (bf16 weights and cache: torch ops, no
    # per-row kernels)
    loaded = load_model(tiny_model_path, "bfloat16", "bf16")
    # When an engine is asked to run it batch-invariant
    # Then it says what the mode needs instead of running variant arithmetic
    with pytest.raises(ValueError, match="batch-invariant decoding needs"):
        make_engine(loaded, tiny_model_path)
