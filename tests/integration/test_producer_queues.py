"""The producer's queue calls against real servers: cancel, stats and lag, workers, dead letters."""

from __future__ import annotations

import time

import pytest
import redis

from llmq.broker import Client
from llmq.broker.keys import GROUP
from llmq.protocol import (
    DeadLetter,
    DecodedRequest,
    WorkerHeartbeat,
    decode_cancel,
    decode_request_entry,
    encode_dead_letter,
    encode_heartbeat,
)
from llmq.protocol.errors import LLMQError
from tests.integration.producer_harness import KEYS
from tests.integration.producer_harness import client as client  # a fixture

pytestmark = pytest.mark.redis


def test_cancel_sets_the_flag_and_notifies_the_queues_workers(
        client: Client, redis_client: redis.Redis) -> None:
    # Given a worker following the cancel stream from now on
    request_id = client.submit("long story", max_tokens=1000, queue="gpu")
    # When the producer cancels
    client.cancel(request_id, queue="gpu")
    # Then the flag is set with a TTL (for a worker that has not read it yet)
    assert redis_client.get(KEYS.cancel_flag(request_id)) == b"1"
    assert 0 < redis_client.ttl(KEYS.cancel_flag(request_id)) <= client.request_ttl
    # And the workers of that queue see a notice naming it
    (_, fields), = redis_client.xrange(KEYS.cancel("gpu"))
    assert decode_cancel(fields) == request_id


def test_stats_report_length_lag_pending_and_dead_letters(client: Client,
                                                          redis_client: redis.Redis) -> None:
    # Given three requests, one read by a worker that has not acked it, and one dead letter
    for prompt in ("a", "b", "c"):
        client.submit(prompt)
    redis_client.xreadgroup(GROUP, "w1", {KEYS.queue("default"): ">"}, count=1)
    letter = DeadLetter(queue="default", entry_id="1-0", request_id=None,
                        code="invalid_request", message="truncated")
    redis_client.xadd(KEYS.dlq("default"), encode_dead_letter(letter, {"json": b"{"}))
    # When the producer asks for the queue's stats
    stats = client.stats()
    # Then each figure is what a person running `llmq status` expects
    assert (stats.length, stats.lag, stats.pending, stats.dead_letters, stats.consumers) == \
        (3, 2, 1, 1, 1)
    assert stats.group_exists and client.queues() == ["default"]


def test_stats_of_an_unknown_queue_are_zero(client: Client) -> None:
    stats = client.stats("never-used")
    assert (stats.length, stats.lag, stats.pending, stats.group_exists) == (0, 0, 0, False)


def test_lag_after_acked_entries_are_deleted(client: Client, redis_client: redis.Redis) -> None:
    # Given the worker pattern "XACK, then XDEL" on finished entries, with one still unread
    for prompt in ("a", "b", "c"):
        client.submit(prompt)
    reply = redis_client.xreadgroup(GROUP, "w1", {KEYS.queue("default"): ">"}, count=2)
    first, second = (entry_id for entry_id, _ in reply[0][1])
    redis_client.xack(KEYS.queue("default"), GROUP, first)
    redis_client.xdel(KEYS.queue("default"), first)
    # Then the stats still count the unread one as lag and the running one as pending
    stats = client.stats()
    assert (stats.length, stats.pending) == (2, 1)
    assert stats.lag == 1


def test_workers_lists_live_heartbeats_and_forgets_expired_ones(
        client: Client, redis_client: redis.Redis) -> None:
    now = int(time.time() * 1000)
    heartbeat = WorkerHeartbeat(worker_id="w1", queue="default", model="smollm2", running=2,
                                heartbeat_ms=now)
    redis_client.hset(KEYS.worker("w1"), mapping=encode_heartbeat(heartbeat))
    redis_client.expire(KEYS.worker("w1"), 30)
    redis_client.zadd(KEYS.workers(), {"w1": now, "gone": now - 60_000})
    assert client.workers() == [heartbeat]
    assert redis_client.zrange(KEYS.workers(), 0, -1) == [b"w1"]


def test_dead_letters_can_be_listed_retried_and_purged(client: Client,
                                                       redis_client: redis.Redis) -> None:
    # Given two dead letters, one with its payload and one whose payload was not kept
    letter = DeadLetter(queue="default", entry_id="5-0", request_id="r5", code="poison",
                        message="delivered 4 times", deliveries=4)
    kept = redis_client.xadd(KEYS.dlq("default"),
                             encode_dead_letter(letter, {"json": b'{"id":"r5","prompt":"x"}'}))
    redis_client.xadd(KEYS.dlq("default"), encode_dead_letter(letter, None))
    listed = client.dead_letters()
    assert [e.dead_letter.code for e in listed] == ["poison", "poison"]
    # ... and the failed run's result stream, whose attempt 4 would hide a new attempt 1
    redis_client.xadd(KEYS.result("r5"), {"json": b'{"type":"error"}'})
    # When the kept one is retried, Then its original request is queued again under its id
    new_entry = client.retry_dead_letter(kept.decode())
    (entry_id, fields), = redis_client.xrange(KEYS.queue("default"))
    decoded = decode_request_entry("9-0", fields)
    assert isinstance(decoded, DecodedRequest) and decoded.request_id == "r5"
    # And the old result stream is gone, and the id is known (and deduplicated) from now on
    assert entry_id.decode() == new_entry
    assert not redis_client.exists(KEYS.result("r5"))
    assert redis_client.get(KEYS.idempotency("default", "r5")) == entry_id
    assert client.submit("x", request_id="r5") == "r5"
    assert redis_client.xlen(KEYS.queue("default")) == 1
    with pytest.raises(LLMQError, match="kept no payload"):
        client.retry_dead_letter(client.dead_letters()[0].dlq_entry_id)
    assert client.purge_dead_letters() == 1 and client.dead_letters() == []


def test_retrying_a_dead_letter_with_a_default_id_leaves_the_old_id_alone(
        client: Client, redis_client: redis.Redis) -> None:
    # Given a dead letter of a request that had no id of its own (its id was its entry id)
    letter = DeadLetter(queue="default", entry_id="6-0", request_id="6-0", code="poison",
                        message="delivered 4 times", deliveries=4)
    redis_client.xadd(KEYS.result("6-0"), {"json": b'{"type":"error"}'})
    dlq_id = redis_client.xadd(KEYS.dlq("default"),
                               encode_dead_letter(letter, {"json": b'{"prompt":"x"}'}))
    # When it is retried
    new_entry = client.retry_dead_letter(dlq_id.decode())
    # Then it runs under its new entry id, and the old id's result stays as it was
    (entry_id, _), = redis_client.xrange(KEYS.queue("default"))
    assert entry_id.decode() == new_entry
    assert redis_client.exists(KEYS.result("6-0"))
    assert not redis_client.exists(KEYS.idempotency("default", "6-0"))
