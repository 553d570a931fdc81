"""What the producer tests share: the `client` fixture, and `answer()`, a fake worker's reply."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from llmq.broker import Client
from llmq.broker.commands import queue_event
from llmq.broker.keys import GROUP, Keys
from llmq.protocol import (
    DecodedRequest,
    Delta,
    Done,
    Error,
    Event,
    RejectedEntry,
    Start,
    Timings,
    Usage,
    decode_request_entry,
)

KEYS = Keys()
TTL = 60


@pytest.fixture
def client(redis_server: Any, redis_client: redis.Redis) -> Client:
    with Client(redis_server.url) as c:
        yield c


def write_events(r: redis.Redis, events: list[Event], encoding: str = "json") -> None:
    pipe = r.pipeline(transaction=False)
    for event in events:
        queue_event(pipe, KEYS, event, encoding, result_ttl=TTL, result_maxlen=1000)
    pipe.execute()


def answer(r: redis.Redis, words: list[str], *, queue: str = "default", attempt: int = 1,
           consumer: str = "fake-worker") -> DecodedRequest | RejectedEntry:
    """Play a worker: read one entry through the group, write start/deltas/done, then XACK."""
    reply = r.xreadgroup(GROUP, consumer, {KEYS.queue(queue): ">"}, count=1, block=5000)
    assert reply, "no request arrived"
    entry_id, fields = reply[0][1][0]
    decoded = decode_request_entry(entry_id, fields)
    if isinstance(decoded, RejectedEntry):
        assert decoded.request_id is not None
        events: list[Event] = [Error(decoded.request_id, attempt, decoded.code, decoded.message)]
        encoding = decoded.encoding or "json"
    else:
        rid = decoded.request_id
        events = [Start(rid, attempt, consumer, 3)]
        events += [Delta(rid, attempt, i, w, [i]) for i, w in enumerate(words)]
        events.append(Done(rid, attempt, "stop", "".join(words), Usage(3, len(words)),
                           Timings(0.01, 0.02, 0.03, 0.01), metadata=decoded.request.metadata))
        encoding = decoded.encoding
    write_events(r, events, encoding)
    r.xack(KEYS.queue(queue), GROUP, entry_id)
    return decoded
