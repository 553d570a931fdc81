"""A burst is shared by the pool: no request waits in one worker's engine while a peer idles.

Two `llmq worker` processes on the tiny random Llama, each step slowed to 40 ms (the fault hook
`slow_step`) so the burst lasts long enough to see who runs what. Before the intake window
(worker/intake_window.py) the first worker to read took up to `max_num_seqs` entries at once:
61 of a 64-request burst ran on one of two workers while the other sat at 0 running.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from llmq import protocol
from llmq.broker import Client
from tests.integration.worker_harness import KEYS, WorkerProcess, read_events, wait_terminal

pytestmark = [pytest.mark.redis, pytest.mark.slow]

NUM_REQUESTS = 64
PROMPT_TOKENS = 64


def test_a_64_request_burst_keeps_both_workers_busy(redis_server, redis_client,
                                                     tiny_model_path: Path,
                                                     tmp_path: Path) -> None:
    # Given two idle workers whose engines take 128 tokens a step (a window of 4 such prompts)
    workers = [WorkerProcess(redis_server.url, tiny_model_path, tmp_path, f"w{i}",
                             fault="slow_step:40",
                             extra=["--max-num-batched-tokens", "128"]).start()
               for i in (1, 2)]
    try:
        for w in workers:
            w.wait_ready(redis_client)
        # When 64 requests of 64-token prompts arrive at once
        submitted = time.time()
        with Client(redis_server.url) as client:
            ids = client.submit_many([
                {"prompt_token_ids": [5 + (i + j) % 50 for j in range(PROMPT_TOKENS)],
                 "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                for i in range(NUM_REQUESTS)])
        finals = [wait_terminal(redis_client, request_id, timeout=120) for request_id in ids]
        # Then every request is answered, and both workers ran a fair part of the burst
        assert all(isinstance(f, protocol.Done) for f in finals), finals
        starts = {request_id: next(e for e in read_events(redis_client, request_id)
                                   if isinstance(e, protocol.Start)) for request_id in ids}
        ran = Counter(start.worker for start in starts.values())
        assert set(ran) == {"w1", "w2"} and min(ran.values()) >= NUM_REQUESTS // 4, ran
        # and each began its first request within 2 s of the burst (start events carry the
        # server time of admission in their ids' milliseconds)
        for worker in ("w1", "w2"):
            first_ms = min(_start_ms(redis_client, request_id)
                           for request_id, start in starts.items() if start.worker == worker)
            assert first_ms / 1000.0 - submitted < 2.0, (worker, first_ms / 1000.0 - submitted)
    finally:
        for w in workers:
            w.stop()


def _start_ms(r: redis.Redis, request_id: str) -> int:
    """Milliseconds of the result-stream entry holding the request's first start event."""
    for entry_id, fields in r.xrange(KEYS.result(request_id)):
        if isinstance(protocol.decode_event(fields), protocol.Start):
            return int(entry_id.decode().partition("-")[0])
    raise AssertionError(f"no start event for {request_id}")
