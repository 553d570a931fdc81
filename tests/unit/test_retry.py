"""Which Redis failures a client waits out, and how each one reads to a person."""

from __future__ import annotations

import pytest
import redis
import redis.exceptions

from llmq.broker.connection import translate
from llmq.broker.retry import RetryPolicy, is_transient
from llmq.protocol.errors import BrokerError, BrokerUnavailable

URL = "redis://user:secret@cache:6379/0"


@pytest.mark.parametrize("exc, before, after", [
    (redis.ConnectionError("Error 111 connecting. Connection refused."), False, True),
    (redis.ConnectionError("Connection reset by peer"), False, True),
    (redis.TimeoutError("Timeout reading from socket"), False, True),
    (redis.exceptions.MaxConnectionsError("Too many connections"), True, True),
    (redis.ConnectionError("No connection available."), True, True),
    (redis.ConnectionError("max number of clients reached"), True, True),
    (redis.exceptions.BusyLoadingError("LOADING Redis is loading the dataset"), True, True),
    (redis.ResponseError("MASTERDOWN Link with MASTER is down"), True, True),
    (redis.exceptions.ReadOnlyError("READONLY You can't write against a replica"), True, True),
    (redis.AuthenticationError("WRONGPASS invalid username-password pair"), False, False),
    (redis.exceptions.NoPermissionError("NOPERM this user has no permissions"), False, False),
    (redis.exceptions.OutOfMemoryError("OOM command not allowed"), False, False),
    (redis.ResponseError("WRONGTYPE Operation against a key"), False, False),
])
def test_outages_are_waited_out_answers_are_not(exc, before, after) -> None:
    # A server never reached is a configuration problem; one reached before is an outage
    assert is_transient(exc, reached=False) is before
    assert is_transient(exc, reached=True) is after


def test_a_full_pool_is_not_reported_as_a_missing_server() -> None:
    message = str(translate(redis.exceptions.MaxConnectionsError("Too many connections"), URL))
    assert "pool" in message and "max_connections" in message
    assert "no Redis server" not in message and "secret" not in message
    busy = translate(redis.ConnectionError("max number of clients reached"), URL)
    assert isinstance(busy, BrokerUnavailable) and "maxclients" in str(busy)
    refused = translate(redis.ConnectionError("Error 111. Connection refused."), URL)
    assert str(refused).startswith("no Redis server at redis://user:***@cache:6379/0")
    assert isinstance(translate(redis.ResponseError("WRONGTYPE x"), URL), BrokerError)


def test_a_call_stops_retrying_at_its_deadline() -> None:
    policy = RetryPolicy(retry_timeout=0)
    policy.reached = True
    reset = redis.ConnectionError("Connection reset by peer")
    assert not policy.should_retry(reset, policy.deadline())
    assert RetryPolicy(None).deadline() is None
