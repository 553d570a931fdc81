"""llmq.broker: the Redis-facing side of llmq (keys, wire protocol, producer clients, servers).

    from llmq.broker import Client
    client = Client()                      # LLMQ_REDIS_URL, else the server `llmq up` started
    request_id = client.submit("Hello", max_tokens=16)
    print(client.result(request_id, timeout=60).text)

Imports only stdlib, msgspec, redis and the wire contract (`llmq.protocol`).
"""

from __future__ import annotations

from llmq.broker.aio import AsyncClient
from llmq.broker.client import Client
from llmq.broker.commands import QueueStats
from llmq.broker.connection import resolve_redis_url
from llmq.broker.embedded import EmbeddedServer
from llmq.broker.keys import Keys
from llmq.broker.settings import BrokerSettings
from llmq.broker.transcript import Transcript
from llmq.protocol import Delta, Done, Error, Event, Request, Start
from llmq.protocol.errors import (
    BrokerError,
    BrokerUnavailable,
    InvalidRequest,
    LLMQError,
    RequestFailed,
    RequestIdConflict,
    ResultTimeout,
)

__all__ = [
    "AsyncClient",
    "BrokerError",
    "BrokerSettings",
    "BrokerUnavailable",
    "Client",
    "Delta",
    "Done",
    "EmbeddedServer",
    "Error",
    "Event",
    "InvalidRequest",
    "Keys",
    "LLMQError",
    "QueueStats",
    "Request",
    "RequestFailed",
    "RequestIdConflict",
    "ResultTimeout",
    "Start",
    "Transcript",
    "resolve_redis_url",
]
