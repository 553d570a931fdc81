"""A burst is shared by the pool: no request waits in one worker's engine while a peer idles.

Two `llmq worker` processes on the tiny random Llama, each step slowed to 40 ms (the fault hook
`slow_step`) so the burst lasts long enough to see who runs what. Before the intake window
(worker/intake_window.py) the first worker to read took up to `max_num_seqs` entries at once:
61 of a 64-request burst ran on one of two workers while the other sat at 0 running.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from llmq import protocol
from llmq.broker import Client
from tests.integration.worker_harness import (
    HEARTBEAT,
    KEYS,
    QUEUE_KEY,
    WorkerProcess,
    read_events,
    wait_terminal,
    xadd_json,
)

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
        # Then both workers ran a fair part of it, each from within 2 s
        _assert_shared(redis_client, ids, submitted)
    finally:
        for w in workers:
            w.stop()


def test_a_burst_in_one_transaction_after_short_warm_ups_is_shared(redis_server, redis_client,
                                                                   tiny_model_path: Path,
                                                                   tmp_path: Path) -> None:
    # Given two idle workers of the default token budget that have answered four 8-token
    # warm-ups (seen with the 1B model: the warm-ups set one worker's window to all 64 seats,
    # and it read 63 of the burst that followed while its peer idled to the end)
    workers = [WorkerProcess(redis_server.url, tiny_model_path, tmp_path, f"w{i}",
                             fault="slow_step:40").start() for i in (1, 2)]
    try:
        for w in workers:
            w.wait_ready(redis_client)
        warm_ups = [xadd_json(redis_client, {"prompt_token_ids": [7 + i] * 8, "max_tokens": 4})
                    for i in range(4)]
        for request_id in warm_ups:
            wait_terminal(redis_client, request_id, timeout=60)
        time.sleep(HEARTBEAT + 0.5)  # each worker's heartbeat has counted the other
        # When 64 requests of 16-token prompts land at once, in one MULTI/EXEC (as a producer's
        # transactional pipeline writes them: one wake, every entry already there)
        submitted = time.time()
        with redis_client.pipeline(transaction=True) as pipe:
            for i in range(NUM_REQUESTS):
                pipe.xadd(QUEUE_KEY, {"json": json.dumps(
                    {"prompt_token_ids": [5 + (i + j) % 50 for j in range(16)],
                     "max_tokens": 24, "temperature": 0, "ignore_eos": True})})
            entry_ids = pipe.execute()
        ids = [entry_id.decode() for entry_id in entry_ids]
        # Then both workers ran a fair part of it, each from within 2 s
        _assert_shared(redis_client, ids, submitted)
    finally:
        for w in workers:
            w.stop()


def _assert_shared(r: redis.Redis, ids: list[str], submitted: float) -> None:
    """Every request of the burst is answered, both workers ran at least a quarter of it, and
    each began its first within 2 s of `submitted` (start events carry the server time of
    admission in their ids' milliseconds)."""
    finals = [wait_terminal(r, request_id, timeout=120) for request_id in ids]
    assert all(isinstance(f, protocol.Done) for f in finals), finals
    starts = {request_id: next(e for e in read_events(r, request_id)
                               if isinstance(e, protocol.Start)) for request_id in ids}
    ran = Counter(start.worker for start in starts.values())
    assert set(ran) == {"w1", "w2"} and min(ran.values()) >= len(ids) // 4, ran
    for worker in ("w1", "w2"):
        first_ms = min(_start_ms(r, request_id)
                       for request_id, start in starts.items() if start.worker == worker)
        assert first_ms / 1000.0 - submitted < 2.0, (worker, first_ms / 1000.0 - submitted)


def _start_ms(r: redis.Redis, request_id: str) -> int:
    """Milliseconds of the result-stream entry holding the request's first start event."""
    for entry_id, fields in r.xrange(KEYS.result(request_id)):
        if isinstance(protocol.decode_event(fields), protocol.Start):
            return int(entry_id.decode().partition("-")[0])
    raise AssertionError(f"no start event for {request_id}")
