"""`llmq batch-worker` (gateway/batch_store.py's rq worker) stops promptly on a real server.

rq stops its command-channel thread by unsubscribing, then waiting for the thread. When the
UNSUBSCRIBE reply is read before the thread is told to stop, the thread waits for a subscription
again, as long as its read timeout; CI saw batch workers take more than 20 s to exit after
SIGTERM. The test makes that order certain rather than waiting for load to produce it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from llmq.broker.client import Client
from llmq.gateway.batch_store import BatchStore, new_batch_worker

pytestmark = pytest.mark.redis


@pytest.fixture
def store(redis_server, redis_client: redis.Redis) -> Iterator[BatchStore]:
    with Client(redis_server.url) as client:
        yield BatchStore(redis_client, client)


def test_a_batch_worker_stops_within_seconds_when_its_unsubscribe_reply_is_read_first(
        store: BatchStore) -> None:
    # Given a batch worker listening on its command channel
    worker = new_batch_worker(store, "stop-order")
    worker.subscribe()
    # When the thread has already read the reply to an unsubscribe before rq stops it
    worker.pubsub.unsubscribe()
    deadline = time.monotonic() + 5
    while worker.pubsub.subscribed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.pubsub.subscribed
    started = time.monotonic()
    worker.unsubscribe()
    # Then the stop still ends within a couple of seconds, not rq's 60 s read
    assert time.monotonic() - started < 5
    assert not worker.pubsub_thread.is_alive()
