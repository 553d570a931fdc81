"""End to end with the real default model: requests through Redis equal the engine in-process.

16 concurrent requests (greedy and seeded sampling, plain prompts and chat) are queued through
the llmq client, served by a worker around SmolLM2-135M-Instruct (float32), and compared token
for token with the same requests run by `EngineCore.generate` with no Redis in between.
"""

from __future__ import annotations

from typing import Any

import pytest

from llmq import protocol
from llmq.broker import Client
from llmq.worker.engine.config import EngineConfig
from llmq.worker.engine.engine_core import EngineCore
from llmq.worker.engine.sampling_params import SamplingParams
from tests.integration.worker_harness import (
    InProcessWorker,
    num_pending,
    read_events,
    terminal_events,
)

pytestmark = [pytest.mark.model, pytest.mark.redis, pytest.mark.slow]

PROMPTS = ["The capital of France is", "Write one sentence about the sea.",
           "List three colours:", "def fibonacci(n):", "Once upon a time",
           "The best way to learn Python is", "2 + 2 =", "Translate 'hello' to French:"]


def requests_16() -> list[dict[str, Any]]:
    """8 greedy, 8 seeded-sampled; half plain prompts, half chat messages."""
    requests = []
    for i in range(16):
        text = PROMPTS[i % len(PROMPTS)]
        body: dict[str, Any] = ({"prompt": text} if i % 2 == 0
                                else {"messages": [{"role": "user", "content": text}]})
        body.update(max_tokens=24, temperature=0.0 if i < 8 else 0.8, seed=1000 + i)
        requests.append(body)
    return requests


def test_sixteen_concurrent_requests_stream_the_in_process_tokens(
        valkey_server, valkey_client, default_model_f32) -> None:
    requests = requests_16()
    # Given the same requests run in-process, with no Redis
    reference = EngineCore(EngineConfig(model="default", dtype="float32", num_kv_blocks=256),
                           loaded=default_model_f32)
    tokenizer = reference.tokenizer
    prompts = [tokenizer.encode(r["prompt"]) if "prompt" in r
               else tokenizer.encode_chat(r["messages"]) for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"],
                             seed=r["seed"]) for r in requests]
    expected = reference.generate(prompts, params)

    # When they are queued through Redis together and one worker serves them
    with Client(valkey_server.url) as client:
        ids = client.submit_many(requests)
        worker = InProcessWorker(valkey_server.url, default_model_f32, num_kv_blocks=256)
        with worker:
            results = [client.result(rid, timeout=600) for rid in ids]

    # Then every request streamed exactly the engine's tokens, and its deltas add up to `done`
    for rid, done, want, prompt in zip(ids, results, expected, prompts, strict=True):
        events = read_events(valkey_client, rid)
        deltas = [e for e in events if isinstance(e, protocol.Delta)]
        assert [t for d in deltas for t in d.token_ids] == want.new_token_ids, rid
        assert "".join(d.text for d in deltas) == done.text == want.text, rid
        assert (done.finish_reason, done.usage.prompt_tokens) == (want.finish_reason,
                                                                 len(prompt))
        assert len(terminal_events(events)) == 1
    assert num_pending(valkey_client) == 0
