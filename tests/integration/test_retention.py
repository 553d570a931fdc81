"""The request stream sheds acked entries and keeps everything a worker may still need."""

from __future__ import annotations

import pytest
import redis

from llmq.broker.keys import GROUP, Keys
from llmq.broker.retention import trim_acked_requests

pytestmark = pytest.mark.redis

KEYS = Keys("llmq")
QUEUE = "default"


def test_only_acked_entries_are_trimmed_and_lag_stays_known(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushdb()
    key = KEYS.queue(QUEUE)
    client.xgroup_create(key, GROUP, id="0", mkstream=True)
    ids = [client.xadd(key, {"json": f'{{"prompt":"p{i}"}}'}) for i in range(10)]
    # Given 6 entries delivered, of which entries 0, 1, 3, 4, 5 were acked and 2 is pending,
    # and 4 entries never delivered
    client.xreadgroup(GROUP, "w1", {key: ">"}, count=6)
    client.xack(key, GROUP, ids[0], ids[1], ids[3], ids[4], ids[5])
    # When the stream is trimmed
    removed = trim_acked_requests(client, KEYS, QUEUE)
    # Then only the acked entries older than the pending one went
    remaining = [entry_id for entry_id, _ in client.xrange(key)]
    assert removed == 2
    assert remaining == ids[2:]
    # And the pending entry can still be reclaimed with its payload, the lag is still known
    _, claimed, *_ = client.xautoclaim(key, GROUP, "w2", 0, start_id="0-0")
    assert [(i, f["json"]) for i, f in claimed] == [(ids[2], '{"prompt":"p2"}')]
    (group,) = client.xinfo_groups(key)
    assert group["lag"] == 4

    # When everything delivered is acked, the next trim leaves only the undelivered entries
    client.xack(key, GROUP, ids[2])
    assert trim_acked_requests(client, KEYS, QUEUE) == 3
    assert [entry_id for entry_id, _ in client.xrange(key)] == ids[5:]
    (group,) = client.xinfo_groups(key)
    assert group["lag"] == 4 and group["pending"] == 0
    assert len(client.xreadgroup(GROUP, "w1", {key: ">"}, count=10)[0][1]) == 4


def test_trimming_a_missing_queue_is_a_no_op(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushdb()
    assert trim_acked_requests(client, KEYS, "nothing-here") == 0
