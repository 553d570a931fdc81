"""Lanes and fair share on a real server: interactive work first, tenants in fair shares, and
a dead worker's entries on a lane stream reclaimed like any other (broker/work_lanes.py,
worker/stream_reader.py, worker/fair_share.py).

Order is read from the start events' result-stream ids, whose milliseconds are the server's
clock when the worker admitted the request: requests admitted by a later read never carry an
earlier time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from llmq import protocol
from llmq.broker import Client
from llmq.broker.keys import GROUP
from llmq.broker.work_lanes import BATCH, work_lane
from tests.integration.worker_harness import (
    KEYS,
    InProcessWorker,
    WorkerProcess,
    dead_letters,
    read_events,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.redis


def _request(i: int, **fields: object) -> dict[str, object]:
    return {"prompt_token_ids": [5 + (i + j) % 50 for j in range(16)], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, **fields}


def _start_ms(r: redis.Redis, request_id: str) -> int:
    for entry_id, fields in r.xrange(KEYS.result(request_id)):
        if isinstance(protocol.decode_event(fields), protocol.Start):
            return int(entry_id.decode().partition("-")[0])
    raise AssertionError(f"no start event for {request_id}")


def test_interactive_entries_are_read_before_batch_entries_queued_earlier(
        redis_server, redis_client, tiny_model) -> None:
    # Given 12 batch requests queued, then 3 interactive ones, before any worker runs
    with Client(redis_server.url) as client:
        batch = client.submit_many([_request(i, lane="batch") for i in range(12)])
        interactive = client.submit_many([_request(i) for i in range(3)])
    assert redis_client.xlen(KEYS.lane_stream("default", "batch")) == 12
    # When a worker with 4 seats (one kept for interactive work) serves the queue
    with InProcessWorker(redis_server.url, tiny_model, max_num_seqs=4):
        finals = [wait_terminal(redis_client, r, timeout=60) for r in batch + interactive]
    # Then every request ran, and the interactive ones were admitted before any batch one
    assert all(isinstance(f, protocol.Done) for f in finals), finals
    assert max(_start_ms(redis_client, r) for r in interactive) \
        <= min(_start_ms(redis_client, r) for r in batch)


def test_two_tenants_share_a_lane_whatever_the_order_they_submitted_in(
        redis_server, redis_client, tiny_model) -> None:
    # Given tenant acme queues 30 batch requests, and then bob 10 of the same shape
    with Client(redis_server.url) as client:
        acme = client.submit_many([_request(i, id=f"acme:{i}", lane="batch")
                                   for i in range(30)])
        bob = client.submit_many([_request(i, id=f"bob:{i}", lane="batch") for i in range(10)])
    # When one worker works them off
    with InProcessWorker(redis_server.url, tiny_model, max_num_seqs=4):
        finals = [wait_terminal(redis_client, r, timeout=120) for r in acme + bob]
    assert all(isinstance(f, protocol.Done) for f in finals), finals
    # Then bob did not wait behind acme's 30: about as many of acme's ran before bob's last as
    # bob had (first come, first served would have run all 30 first)
    bob_last = max(_start_ms(redis_client, r) for r in bob)
    acme_before = sum(1 for r in acme if _start_ms(redis_client, r) < bob_last)
    assert acme_before <= 20, acme_before


def test_a_dead_workers_entries_on_a_lane_stream_are_taken_over(
        redis_server, redis_client, tiny_model_path: Path, tmp_path: Path) -> None:
    lane = work_lane(KEYS, "default", BATCH, "acme")
    slow = WorkerProcess(redis_server.url, tiny_model_path, tmp_path, "slow",
                         fault="slow_step:300").start()
    peer = WorkerProcess(redis_server.url, tiny_model_path, tmp_path, "peer")
    try:
        slow.wait_ready(redis_client)
        # Given a worker running two of tenant acme's batch requests
        with Client(redis_server.url) as client:
            ids = client.submit_many([_request(i, id=f"acme:{i}", lane="batch",
                                               max_tokens=16) for i in range(2)])
        wait_for(lambda: all(any(isinstance(e, protocol.Start) for e in
                                 read_events(redis_client, r)) for r in ids),
                 60, "both requests to start on the slow worker")
        # When it is SIGKILLed and a peer comes up
        slow.kill()
        peer.start().wait_ready(redis_client)
        finals = [wait_terminal(redis_client, r, timeout=60) for r in ids]
        # Then the peer took them from the lane stream and finished them as attempt 2
        assert all(isinstance(f, protocol.Done) and f.attempt == 2 for f in finals), finals
        starts = [e for r in ids for e in read_events(redis_client, r)
                  if isinstance(e, protocol.Start) and e.attempt == 2]
        assert {s.worker for s in starts} == {"peer"}, starts
        # and the lane's pending list and submission records are empty
        wait_for(lambda: redis_client.xpending(lane.stream, GROUP)["pending"] == 0, 10,
                 "the lane's pending list to empty")
        assert redis_client.hlen(lane.submissions) == 0
    finally:
        slow.stop()
        peer.stop()


def test_entries_that_do_not_fit_their_stream_are_dead_lettered_not_run(
        redis_server, redis_client, tiny_model) -> None:
    acme = work_lane(KEYS, "default", BATCH, "acme")
    shared = work_lane(KEYS, "default", BATCH)
    with Client(redis_server.url) as client:  # the lanes and their groups exist
        ok = client.submit_many([_request(0, id="acme:ok", lane="batch"),
                                 _request(0, id="shared-ok", lane="batch")])
    # Given entries added by hand: a queue-style id on acme's lane, bob's id on acme's lane
    # (with an id in its range), a tenant's id on the shared batch lane, and a lane-style id on
    # the queue's own stream
    def last(stream: str) -> tuple[int, int]:
        ((entry_id, _),) = redis_client.xrevrange(stream, count=1)
        ms, seq = entry_id.decode().split("-")
        return int(ms), int(seq)

    (a_ms, a_seq), (s_ms, s_seq) = last(acme.stream), last(shared.stream)
    raw = redis_client.xadd(acme.stream, {"json": '{"id": "acme:raw", "prompt": "x"}'},
                            id=f"{a_ms + 5}-0")
    forged = [
        redis_client.xadd(acme.stream, {"json": '{"id": "bob:1", "prompt": "x"}'},
                          id=f"{a_ms + 6}-{a_seq}"),
        redis_client.xadd(shared.stream, {"json": '{"id": "acme:2", "prompt": "x"}'},
                          id=f"{s_ms + 6}-{s_seq}"),
        redis_client.xadd(KEYS.queue("default"), {"json": '{"prompt": "x"}'},
                          id=f"{a_ms + 7}-{a_seq}")]
    with InProcessWorker(redis_server.url, tiny_model):
        # When a worker reads them all, Then the genuine ones run
        assert all(isinstance(wait_terminal(redis_client, r, timeout=60), protocol.Done)
                   for r in ok)
        # And every forged one is dead-lettered, acked, and answered on no result stream
        entries = {e.decode() for e in (raw, *forged)}
        wait_for(lambda: entries <= {letter.entry_id for letter, _ in dead_letters(redis_client)},
                 30, "the forged entries dead-lettered")
    assert all(redis_client.xpending(s, GROUP)["pending"] == 0
               for s in (acme.stream, shared.stream, KEYS.queue("default")))
    for request_id in ("acme:raw", "bob:1", "acme:2", *entries):
        assert read_events(redis_client, request_id) == [], request_id
