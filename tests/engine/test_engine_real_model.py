"""The engine on SmolLM2-135M-Instruct: batching must not change greedy output."""

from __future__ import annotations

import pytest

from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
    "What is 12 times 7?", "Who wrote Hamlet?", "Give me a synonym for happy.",
    "Explain gravity in one sentence.", "What language is spoken in Brazil?",
]


def test_32_concurrent_greedy_requests_match_each_run_alone(default_model_f32,
                                                            default_model_path):
    # Given 32 chat prompts of different lengths
    engine = EngineCore(EngineConfig(model=str(default_model_path), dtype="float32",
                                     num_kv_blocks=512), loaded=default_model_f32)
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"{QUESTIONS[i % 8]} (variant {i})" + " Please." * (i % 5)}]))
        for i in range(32)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    # When they run concurrently, and each alone
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    # Then the tokens are identical
    assert [o.new_token_ids for o in together] == [o.new_token_ids for o in alone]
    assert all(o.text for o in together)
