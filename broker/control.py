"""Utility calls to the workers of a queue: the wire format and the caller's side.

After vLLM v1's `EngineCore` utility calls (`call_utility`: reset_prefix_cache, sleep, wake_up,
profile), carried over Redis: an admin XADDs one `ControlCall` to `llmq:ctl:<queue>`, which every
worker of the queue follows with a plain XREAD from `$` (its own position, not the consumer
group: a call concerns every worker, or the one it names). Each worker that takes the call
answers with one `ControlReply` on `llmq:ctlr:<call_id>`, which expires after `REPLY_TTL_S`.

Methods and their `args`:

    reset_prefix_cache                 forget every cached prefix block (refused while requests
                                       run: their blocks are in use)
    sleep        {"level": 1 | 2}      stop reading, hand in-flight work back to peers, free the
                                       KV cache (level 2: the weights too)
    wake_up                            reallocate what sleep freed, read again
    profile      {"action": "start" | "stop", "dir": optional}
                                       torch profiler; stop writes a Chrome trace and answers
                                       its path
    stats                              the engine's counters

Both structs are JSON in one `json` field, as requests are. The control keys are admin-only in
deploy/acl.conf: workers may only read calls and write answers.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import Struct

from llmq.broker.commands import stream_entries
from llmq.broker.connection import translate_errors
from llmq.broker.keys import Keys, validate_name

__all__ = ["METHODS", "REPLY_TTL_S", "ControlCall", "ControlReply", "call_workers",
           "decode_call", "decode_reply", "encode_call", "encode_reply"]

METHODS: tuple[str, ...] = ("reset_prefix_cache", "sleep", "wake_up", "profile", "stats")
REPLY_TTL_S = 3600
CONTROL_STREAM_MAXLEN = 1000


class ControlCall(Struct, kw_only=True):
    """One utility call. `method` is a string so a worker can answer an unknown one with an
    error rather than ignore it."""

    call_id: str
    method: str
    args: dict[str, Any] = {}
    worker: str | None = None  # only this worker answers; None: every worker of the queue


class ControlReply(Struct, kw_only=True):
    call_id: str
    worker: str
    ok: bool
    result: dict[str, Any] | None = None
    error: str | None = None


_encoder = msgspec.json.Encoder()
_call_decoder = msgspec.json.Decoder(ControlCall)
_reply_decoder = msgspec.json.Decoder(ControlReply)


def _field(fields: Mapping[Any, Any]) -> bytes | None:
    value = fields.get(b"json", fields.get("json"))
    return value.encode() if isinstance(value, str) else value


def encode_call(call: ControlCall) -> dict[str, bytes]:
    return {"json": _encoder.encode(call)}


def decode_call(fields: Mapping[Any, Any]) -> ControlCall | None:
    """The call in a control-stream entry; None when the entry is not one (logged by callers)."""
    payload = _field(fields)
    try:
        call = _call_decoder.decode(payload) if payload is not None else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if call is None or not _valid_id(call.call_id):
        return None
    return call


def encode_reply(reply: ControlReply) -> dict[str, bytes]:
    return {"json": _encoder.encode(reply)}


def decode_reply(fields: Mapping[Any, Any]) -> ControlReply | None:
    payload = _field(fields)
    try:
        return _reply_decoder.decode(payload) if payload is not None else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _valid_id(call_id: str) -> bool:
    try:
        validate_name("call_id", call_id)
    except ValueError:
        return False
    return True


def call_workers(client: Any, method: str, args: dict[str, Any] | None = None, *,
                 queue: str | None = None, worker: str | None = None,
                 expected: set[str] | None = None, timeout: float = 10.0) -> list[ControlReply]:
    """Send one call to the workers of `queue` (or just `worker`) and gather their answers.

    `client` is an `llmq.broker.Client`. Waits until every worker in `expected` answered (by
    default: the named worker, or the live workers of the queue by their heartbeats) or
    `timeout` seconds passed; returns the answers in arrival order.
    """
    keys: Keys = client.keys
    queue = queue or client.settings.queue
    if expected is None:
        expected = {worker} if worker else {w.worker_id for w in client.workers()
                                            if w.queue == queue}
    call = ControlCall(call_id=f"call-{uuid.uuid4().hex[:16]}", method=method, args=args or {},
                       worker=worker)
    reply_key = keys.control_reply(call.call_id)
    replies: list[ControlReply] = []
    last_id = "0-0"
    deadline = time.monotonic() + timeout
    with translate_errors(client.url):
        client.redis.xadd(keys.control(queue), encode_call(call),
                          maxlen=CONTROL_STREAM_MAXLEN, approximate=True)
        # NOTE: with nobody expected (no heartbeat yet) it listens for the whole timeout.
        while not expected or not expected <= {r.worker for r in replies}:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            reply = client.redis.xread({reply_key: last_id},
                                       block=max(1, int(min(left, 1.0) * 1000)))
            for entry_id, fields in stream_entries(reply):
                last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if (answer := decode_reply(fields)) is not None:
                    replies.append(answer)
    return replies
