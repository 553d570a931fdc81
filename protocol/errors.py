"""llmq's errors: the exceptions it raises on purpose, and the stable codes of `error` events.

The CLI catches `LLMQError` and prints one line; every message is written to be shown to a person
as it is: what went wrong and how to fix it. `ErrorCode` and `RequestRejected` are the one code
enum and the one "this request can never run" error of the whole project: the wire decoder
(`InvalidRequest`), the worker's input processor, the engine's bookkeeping, `llmq generate` and
the worker all raise or read these. Stdlib only, so every layer may import it.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmq.protocol import Error

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "ErrorCode",
    "InvalidRequest",
    "LLMQError",
    "ProtocolError",
    "SchemaMismatch",
    "StreamExhausted",
    "RequestFailed",
    "RequestIdConflict",
    "RequestRejected",
    "ResultTimeout",
    "ServerStartError",
]


class ErrorCode(enum.StrEnum):
    """Stable `code` values of `error` events; readers must accept codes not listed here."""

    INVALID_REQUEST = "invalid_request"  # failed decoding or validation (message names the field)
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+ max_tokens) does not fit the model context
    INVALID_TOKEN_ID = "invalid_token_id"  # a token id outside the model's vocabulary
    DEADLINE_EXCEEDED = "deadline_exceeded"  # not started within deadline_ms of being queued
    POISON = "poison"  # delivered max_deliveries times without finishing: dead-lettered
    CANCELLED = "cancelled"  # reserved: llmq reports cancellation as done{finish_reason=cancelled}
    PREEMPTED = "preempted"  # preempted more often than the engine allows
    NUMERICAL = "numerical"  # NaN/inf logits for this request
    ENGINE_ERROR = "engine_error"  # the engine failed this request for another reason
    LOST_PAYLOAD = "lost_payload"  # the entry was trimmed or deleted before a worker read it
    DUPLICATE_ID = "duplicate_id"  # another entry owns this request id (running or finished)


class LLMQError(Exception):
    """Base of every error llmq raises on purpose."""


class RequestRejected(LLMQError):
    """A request that can never run, refused before it reaches the scheduler.

    `code` is an `ErrorCode`, `message` names the field at fault, `details` holds
    machine-readable specifics for the `error` event (e.g. {"prompt_tokens": 9000, "limit": 2047}).
    """

    def __init__(self, code: ErrorCode, message: str,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


class RequestIdConflict(LLMQError):
    """A submit with a request id that is already marked, for an entry that is not this
    request's or no longer exists: submitting again would queue nothing and answer nothing."""


class BrokerUnavailable(LLMQError):
    """No Redis server answers at the configured URL (or none is configured)."""


class BrokerError(LLMQError):
    """The server answered with an error (out of memory, permission denied, wrong key type...)."""


class InvalidRequest(RequestRejected, ValueError):
    """A request failed the wire's validation (code `invalid_request`); the message names the
    field. Producers get it before anything is sent, workers answer it with an `error` event."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_REQUEST, message)


class SchemaMismatch(LLMQError):
    """Redis holds keys of another key schema version (a v1 request stream): refuse to run
    beside it rather than split one queue in two."""


class StreamExhausted(LLMQError):
    """A request stream whose last entry id is the last possible one: nothing can be added."""


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
