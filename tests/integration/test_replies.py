"""Every reply llmq reads means the same under RESP2 and RESP3, parsed or raw (broker/replies.py).

A `?protocol=3` URL changes the shapes redis-py hands back (maps, entries wrapped once more);
the readers must give llmq the same entries, rows and values either way.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from llmq.broker import replies
from llmq.broker.replies import ConsumerInfo, GroupInfo, StreamEntry
from llmq.protocol.errors import ProtocolError

pytestmark = pytest.mark.redis


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def client(request: pytest.FixtureRequest, redis_server) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(f"{redis_server.url}?protocol={request.param}")
    client.flushall()
    try:
        yield client
    finally:
        client.flushall()
        client.close()


def test_stream_entries_read_alike_from_xread_xreadgroup_xrange_and_a_raw_connection(client):
    # Given a stream with two entries and a consumer group
    first = replies.text(client.xadd("s", {"json": b"1"}), "XADD")
    second = replies.text(client.xadd("s", {"msgpack": b"\x01"}), "XADD")
    client.xgroup_create("s", "g", id="0")
    expected = [StreamEntry(first, {"json": b"1"}), StreamEntry(second, {"msgpack": b"\x01"})]
    # Then every read gives the same entries: ids as text, field values as bytes
    assert replies.read_entries(client.xread({"s": "0-0"})) == expected
    assert replies.read_entries(client.xreadgroup("g", "w1", {"s": ">"}, count=1)) == \
        expected[:1]
    assert replies.entries(client.xrange("s")) == expected
    assert replies.entries(client.xrevrange("s", count=1), "XREVRANGE") == expected[1:]
    # And a read that times out, or a missing key, gives no entries
    assert replies.read_entries(client.xread({"s": "$"}, block=1)) == []
    assert replies.entries(client.xrange("missing")) == []
    # And the result reader's raw replies (no redis-py parsing) read the same, per stream
    conn = client.connection_pool.get_connection()
    try:
        conn.send_command("XREAD", "COUNT", 10, "STREAMS", "s", "none", "0-0", "0-0")
        assert replies.read_streams(conn.read_response()) == [("s", expected)]
    finally:
        client.connection_pool.release(conn)


def test_a_claim_of_an_entry_deleted_while_pending_claims_nothing(client):
    # Given an entry read by one consumer, then deleted from the stream
    entry_id = replies.text(client.xadd("s", {"json": b"1"}), "XADD")
    client.xgroup_create("s", "g", id="0")
    client.xreadgroup("g", "w1", {"s": ">"})
    client.xdel("s", entry_id)
    # When another consumer claims it, Then no entry comes back (none named "None")
    assert replies.entries(client.xclaim("s", "g", "w2", 0, [entry_id]), "XCLAIM") == []


def test_group_consumer_and_pending_rows_are_typed(client):
    # Given a group where consumer w1 holds one of two entries
    first = replies.text(client.xadd("s", {"json": b"1"}), "XADD")
    last = replies.text(client.xadd("s", {"json": b"2"}), "XADD")
    client.xgroup_create("s", "g", id="0")
    client.xreadgroup("g", "w1", {"s": ">"}, count=1)
    # Then XINFO and XPENDING read as rows of text and ints
    assert replies.groups(client.xinfo_groups("s")) == [
        GroupInfo(name="g", consumers=1, pending=1, last_delivered_id=first, lag=1,
                  entries_read=1)]
    (consumer,) = replies.consumers(client.xinfo_consumers("s", "g"))
    assert consumer == ConsumerInfo("w1", 1, consumer.idle_ms) and consumer.idle_ms >= 0
    (pending,) = replies.pending_entries(client.xpending_range("s", "g", "-", "+", 10))
    assert (pending.entry_id, pending.consumer, pending.times_delivered) == (first, "w1", 1)
    assert replies.pending_summary(client.xpending("s", "g")) == (1, first, first)
    assert replies.last_generated_id(client.xinfo_stream("s")) == last


def test_scalars_hashes_lists_and_sets_read_as_text_bytes_and_ints(client):
    client.hset("h", mapping={"a": "1", "b": "2"})
    client.sadd("members", "x", "y")
    client.rpush("lines", b'{"a": 1}', b"\xff")
    client.set("payload", b"\x00\xff")
    assert replies.string_hash(client.hgetall("h")) == {"a": "1", "b": "2"}
    assert replies.string_hash(client.hgetall("missing")) == {}
    assert replies.string_hash(client.hscan("h", 0)[1], "HSCAN") == {"a": "1", "b": "2"}
    assert replies.optional_texts(client.hmget("h", ["a", "zz"]), "HMGET") == ["1", None]
    assert sorted(replies.texts(client.smembers("members"), "SMEMBERS")) == ["x", "y"]
    assert replies.optional_text(client.set("k", "v", nx=True, get=True)) is None
    assert replies.optional_text(client.set("k", "w", nx=True, get=True)) == "v"
    assert replies.integer(client.exists("k"), "EXISTS") == 1
    assert replies.blobs(client.lrange("lines", 0, -1), "LRANGE") == [b'{"a": 1}', b"\xff"]
    assert replies.optional_blob(client.get("payload"), "GET") == b"\x00\xff"
    assert replies.optional_blob(client.get("missing"), "GET") is None
    seconds, micros = client.time()
    assert replies.server_time_ms((seconds, micros)) == seconds * 1000 + micros // 1000


def test_a_reply_of_another_shape_is_a_protocol_error_naming_the_command():
    with pytest.raises(ProtocolError, match="XRANGE: expected an array from Redis, got 42"):
        replies.entries(42)
    with pytest.raises(ProtocolError, match="XINFO GROUPS: expected a string"):
        replies.groups([{"name": None}])
