"""The exceptions llmq's producer API raises; the CLI catches `LLMQError` and prints one line.

Every message is written to be shown to a person as it is: what went wrong and how to fix it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmq.broker.protocol import Error

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "InvalidRequest",
    "LLMQError",
    "ProtocolError",
    "RequestFailed",
    "ResultTimeout",
    "ServerStartError",
]


class LLMQError(Exception):
    """Base of every error llmq raises on purpose."""


class BrokerUnavailable(LLMQError):
    """No Redis server answers at the configured URL (or none is configured)."""


class BrokerError(LLMQError):
    """The server answered with an error (out of memory, permission denied, wrong key type...)."""


class InvalidRequest(LLMQError, ValueError):
    """A request failed validation before anything was sent; the message names the field."""


class ProtocolError(LLMQError, ValueError):
    """Bytes read from Redis that are not a valid llmq record (event, dead letter, heartbeat)."""


class ResultTimeout(LLMQError, TimeoutError):
    """No terminal event arrived within the timeout; the request may still complete later."""

    def __init__(self, request_id: str, timeout: float) -> None:
        super().__init__(f"no result for request {request_id} within {timeout:g}s "
                         "(it may still be queued or running)")
        self.request_id = request_id
        self.timeout = timeout


class RequestFailed(LLMQError):
    """The request ended with an `error` event; `code` is stable, `message` is for people."""

    def __init__(self, event: Error) -> None:
        super().__init__(f"request {event.request_id} failed: {event.code}: {event.message}")
        self.event = event
        self.request_id = event.request_id
        self.code = event.code
        self.message = event.message


class ServerStartError(LLMQError):
    """A private Redis-compatible server (embedded or test) did not start; the message says why."""
