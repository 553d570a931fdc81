"""A real worker's /readyz and /metrics, scraped over HTTP through a whole life cycle.

Uses the default model so that loading takes long enough to be seen: /readyz must say "not
ready" while the model loads, "ready" while serving, and "not ready" again once draining.
"""

from __future__ import annotations

import signal
import urllib.error
import urllib.request

import pytest
import redis

from llmq import protocol
from llmq.broker.embedded import free_port
from llmq.broker.keys import Keys
from tests.integration.worker_harness import WorkerProcess, wait_for, wait_terminal, xadd_json

pytestmark = [pytest.mark.model, pytest.mark.redis]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def sample(metrics_text: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_readyz_follows_loading_serving_draining_and_metrics_count_a_real_run(
        valkey_server, default_model_path, tmp_path):
    r = redis.Redis.from_url(valkey_server.url)
    r.flushall()
    port = free_port()
    # Given a worker starting on the real model with its metrics port open
    w = WorkerProcess(valkey_server.url, default_model_path, tmp_path, "observed",
                      drain=120.0, extra=["--metrics-port", str(port), "--max-model-len", "1024",
                                         "--kv-cache-memory-bytes", str(64 << 20)]).start()
    try:
        # Then while the model loads, /readyz answers 503 and says why
        wait_for(lambda: get(port, "/readyz")[0] != 0, 60, "the health server to answer")
        status, reason = get(port, "/readyz")
        assert (status, reason.strip()) == (503, "loading model"), w.log_tail()
        # ... and once loaded and warmed up, 200
        wait_for(lambda: get(port, "/readyz")[0] == 200, 120, "/readyz to answer 200")
        assert get(port, "/healthz")[0] == 200

        # When requests run to completion
        ids = [f"m{i}" for i in range(3)]
        for i, request_id in enumerate(ids):
            xadd_json(r, {"id": request_id, "prompt": f"Count to {i + 3}:", "max_tokens": 8,
                          "temperature": 0, "ignore_eos": True})
        for request_id in ids:
            assert isinstance(wait_terminal(r, request_id, 60), protocol.Done)
        # Then /metrics shows them: requests, prompt and generated tokens, TTFT observations
        _, text = get(port, "/metrics")
        assert sample(text, "llmq_requests_total") >= 3
        assert sample(text, "llmq_generation_tokens_total") >= 3 * 8
        assert sample(text, "llmq_prompt_tokens_total") > 0
        assert sample(text, "llmq_time_to_first_token_seconds_count") >= 3
        assert sample(text, "llmq_time_to_first_token_seconds_sum") > 0

        # When SIGTERM arrives while a long generation runs
        long_id = "long"
        xadd_json(r, {"id": long_id, "prompt": "Tell a long story.", "max_tokens": 200,
                      "ignore_eos": True, "temperature": 0})
        wait_for(lambda: r.xlen(Keys().result(long_id)) >= 3, 60, "the long request to stream")
        w.signal(signal.SIGTERM)
        # Then /readyz turns 503 "draining" while the worker finishes it, and it exits 0
        wait_for(lambda: get(port, "/readyz") == (503, "draining\n"), 10,
                 "/readyz to say draining")
        assert w.wait(150) == 0
        assert isinstance(wait_terminal(r, long_id, 5), protocol.Done)
    finally:
        w.stop()
