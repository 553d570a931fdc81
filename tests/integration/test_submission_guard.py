"""What a producer credential can still break with raw XADD is detected and answered.

The queue emptied by `XADD ... MAXLEN 0` (a producer may XADD, and an ACL cannot restrict its
arguments): every request submitted through the function gets `lost_payload` on its result
stream, and a forged record cannot fail someone else's request. A stream pushed to the last
possible id: submits fail naming the fix, and `llmq status` reports it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmq import protocol
from llmq.broker import Client
from llmq.broker.commands import LAST_ENTRY_ID
from llmq.protocol.errors import StreamExhausted
from tests.integration.worker_harness import (
    KEYS,
    QUEUE_KEY,
    InProcessWorker,
    dead_letters,
    read_events,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.redis


def test_requests_trimmed_away_unread_are_answered_lost_payload(redis_server, redis_client,
                                                                 tiny_model) -> None:
    # Given two requests submitted through the function, one with an id of its own
    with Client(redis_server.url) as client:
        named = client.submit("Hi", request_id="victim-1", max_tokens=2)
        anonymous = client.submit("Hi", max_tokens=2)
    # And a record forged by another producer for a request it does not own
    redis_client.hset(KEYS.submissions("default"), "1-1", "someone-else")
    # When a producer empties the queue with a raw XADD before any worker read them
    redis_client.xadd(QUEUE_KEY, {"json": "{}"}, maxlen=0, approximate=False)
    assert redis_client.xlen(QUEUE_KEY) == 0
    with InProcessWorker(redis_server.url, tiny_model) as worker:
        # And a worker's once-a-minute check runs
        worker.worker.reclaimer.answer_vanished_unread()
        # Then both requests are answered with lost_payload where their producers wait
        for rid in (named, anonymous):
            error = wait_terminal(redis_client, rid, timeout=30)
            assert isinstance(error, protocol.Error) and error.code == "lost_payload", error
        # And dead letters name them for operators
        wait_for(lambda: len(dead_letters(redis_client)) == 3, 30, "three dead letters")
        codes = {(d.request_id, d.code) for d, _ in dead_letters(redis_client)}
        assert codes == {(named, "lost_payload"), (anonymous, "lost_payload"),
                         (None, "lost_payload")}
        # But the forged record failed nobody: its id's stream was never written
        assert read_events(redis_client, "someone-else") == []
        # And the records are gone, so the next check answers nothing twice
        wait_for(lambda: not redis_client.exists(KEYS.submissions("default")), 10,
                 "the records to be cleared")
        assert worker.worker.reclaimer.answer_vanished_unread() == 0


def test_a_stream_at_the_last_id_is_refused_naming_the_fix(redis_server, redis_client) -> None:
    # Given a producer that XADDed the last possible id by hand
    with Client(redis_server.url) as client:
        client.ensure_group()
        redis_client.xadd(QUEUE_KEY, {"json": "{}"}, id=LAST_ENTRY_ID)
        # When anyone submits
        with pytest.raises(StreamExhausted) as info:
            client.submit("Hi", max_tokens=2)
        # Then the error says what happened and how to fix it
        assert "last possible entry id" in str(info.value)
        assert f"DEL {QUEUE_KEY}" in str(info.value)
        assert client.stats().exhausted
    # And `llmq status` reports the queue as full, with the fix
    out = subprocess.run([sys.executable, "-m", "llmq.cli.main", "status", "--redis-url",
                          redis_server.url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "is FULL" in out.stdout and f"DEL {QUEUE_KEY}" in out.stdout
    as_json = subprocess.run([sys.executable, "-m", "llmq.cli.main", "status", "--json",
                              "--redis-url", redis_server.url], capture_output=True, text=True,
                             timeout=60)
    (queue,) = json.loads(as_json.stdout)["queues"]
    assert queue["exhausted"] is True
