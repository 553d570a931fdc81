"""A burst is shared by the pool: no request waits in one worker's engine while a peer idles,
each worker holds an even part of it (worker/even_share.py), and a peer that cannot take its part
leaves it to the others, not unread.

Two `llmq worker` processes on the tiny random Llama, each step slowed to 40 ms (the fault hook
`slow_step`) so the burst lasts long enough to see who runs what. Before the intake window
(worker/intake_window.py) the first worker to read took up to `max_num_seqs` entries at once:
61 of a 64-request burst ran on one of two workers while the other sat at 0 running.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
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


def test_a_burst_is_split_evenly_between_two_workers(redis_server, redis_client,
                                                   tiny_model_path: Path,
                                                   tmp_path: Path) -> None:
    # Given two idle workers that know of each other, whose engines take 128 tokens a step
    with _two_workers(redis_server.url, redis_client, tiny_model_path, tmp_path):
        # When 64 requests arrive at once, long enough that none ends before all are read
        # (seen with the 1B model: a 29/35 split, and the drain lasted as long as the 35)
        ids = _burst(redis_server.url, max_tokens=96)
        # Then each worker ran exactly half of them
        ran = _ran_by(redis_client, ids)
        assert ran == {"w1": 32, "w2": 32}, ran


def test_a_peer_with_few_seats_leaves_the_rest_to_the_other(redis_server, redis_client,
                                                           tiny_model_path: Path,
                                                           tmp_path: Path) -> None:
    # Given two workers of which w1 has 4 seats and w2 has 64
    with _two_workers(redis_server.url, redis_client, tiny_model_path, tmp_path,
                      seats={"w1": 4}):
        # When 64 long requests arrive at once
        ids = _burst(redis_server.url, max_tokens=180)
        ran = _ran_by(redis_client, ids)
        # Then w2 took all that w1 could not (it did not stop at an even half while entries
        # sat unread), so every request had started before w1 finished its first
        assert ran == {"w1": 4, "w2": 60}, ran
        last_start = max(_event_ms(redis_client, i, protocol.Start) for i in ids)
        first_done = min(_event_ms(redis_client, i, protocol.Done) for i in ids
                         if _ran_on(redis_client, i) == "w1")
        assert last_start < first_done


def test_without_the_even_share_a_faster_worker_takes_more(redis_server, redis_client,
                                                          tiny_model_path: Path,
                                                          tmp_path: Path) -> None:
    # Given a pool of a fast worker (20 ms steps) and a slow one (100 ms), run with
    # --no-even-share as docs/operations.md advises for workers of different speeds
    with _two_workers(redis_server.url, redis_client, tiny_model_path, tmp_path,
                      steps_ms={"w1": 20, "w2": 100}, extra=["--no-even-share"]):
        # When 64 long requests arrive at once
        ran = _ran_by(redis_client, _burst(redis_server.url, max_tokens=180))
        # Then each read as fast as its engine started requests: the fast one ran most (with
        # the even share, 32 each)
        assert ran["w1"] > 40, ran


@contextmanager
def _two_workers(url: str, r: redis.Redis, model: Path, tmp_path: Path,
                 seats: dict[str, int] | None = None, steps_ms: dict[str, int] | None = None,
                 extra: list[str] | None = None) -> Iterator[list[WorkerProcess]]:
    """Workers w1 and w2 (steps slowed to 40 ms unless `steps_ms` says, 128 tokens a step),
    ready, and each counted in the other's registry read; stopped on the way out."""
    workers = [WorkerProcess(url, model, tmp_path, name,
                             fault=f"slow_step:{(steps_ms or {}).get(name, 40)}",
                             extra=["--max-num-batched-tokens", "128",
                                    "--max-num-seqs", str((seats or {}).get(name, 64)),
                                    *(extra or [])]).start()
               for name in ("w1", "w2")]
    try:
        for w in workers:
            w.wait_ready(r)
        time.sleep(HEARTBEAT + 0.5)
        yield workers
    finally:
        for w in workers:
            w.stop()


def _burst(url: str, max_tokens: int) -> list[str]:
    with Client(url) as client:
        return client.submit_many([
            {"prompt_token_ids": [5 + (i + j) % 50 for j in range(PROMPT_TOKENS)],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            for i in range(NUM_REQUESTS)])


def _ran_by(r: redis.Redis, ids: list[str]) -> Counter[str]:
    """How many of the requests each worker ran, once all are answered."""
    finals = [wait_terminal(r, request_id, timeout=120) for request_id in ids]
    assert all(isinstance(f, protocol.Done) for f in finals), finals
    return Counter(_ran_on(r, request_id) for request_id in ids)


def _ran_on(r: redis.Redis, request_id: str) -> str:
    return next(e.worker for e in read_events(r, request_id) if isinstance(e, protocol.Start))


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
        first_ms = min(_event_ms(r, request_id, protocol.Start)
                       for request_id, start in starts.items() if start.worker == worker)
        assert first_ms / 1000.0 - submitted < 2.0, (worker, first_ms / 1000.0 - submitted)


def _event_ms(r: redis.Redis, request_id: str,
              kind: type[protocol.Start] | type[protocol.Done]) -> int:
    """Milliseconds of the result-stream entry holding the request's first event of `kind`."""
    for entry_id, fields in r.xrange(KEYS.result(request_id)):
        if isinstance(protocol.decode_event(fields), kind):
            return int(entry_id.decode().partition("-")[0])
    raise AssertionError(f"no {kind.__name__} event for {request_id}")
