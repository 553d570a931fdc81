"""llmq.broker: the Redis-facing side of llmq (keys, wire protocol, producer clients, servers).

    from llmq.broker import Client
    client = Client()                      # LLMQ_REDIS_URL, else the server `llmq up` started
    request_id = client.submit("Hello", max_tokens=16)
    print(client.result(request_id, timeout=60).text)

Imports only stdlib, msgspec and redis. The names below load lazily (PEP 562), because the engine's
scheduler imports `llmq.broker.protocol` and must not pull in redis through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_HOMES = {
    "AsyncClient": "aio",
    "BrokerError": "errors",
    "BrokerSettings": "settings",
    "BrokerUnavailable": "errors",
    "Client": "client",
    "Delta": "protocol",
    "Done": "protocol",
    "EmbeddedServer": "embedded",
    "Error": "protocol",
    "Event": "protocol",
    "InvalidRequest": "errors",
    "Keys": "keys",
    "LLMQError": "errors",
    "QueueStats": "commands",
    "Request": "protocol",
    "RequestFailed": "errors",
    "RequestIdConflict": "errors",
    "ResultTimeout": "errors",
    "Start": "protocol",
    "Transcript": "transcript",
    "resolve_redis_url": "connection",
}

if TYPE_CHECKING:
    from llmq.broker.aio import AsyncClient
    from llmq.broker.client import Client
    from llmq.broker.commands import QueueStats
    from llmq.broker.connection import resolve_redis_url
    from llmq.broker.embedded import EmbeddedServer
    from llmq.broker.errors import (
        BrokerError,
        BrokerUnavailable,
        InvalidRequest,
        LLMQError,
        RequestFailed,
        RequestIdConflict,
        ResultTimeout,
    )
    from llmq.broker.keys import Keys
    from llmq.broker.protocol import Delta, Done, Error, Event, Request, Start
    from llmq.broker.settings import BrokerSettings
    from llmq.broker.transcript import Transcript


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
