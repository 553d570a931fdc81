"""Utility calls to the workers of a queue: the caller's side, and the Redis commands of both.

An admin XADDs one `ControlCall` (llmq.protocol.control) to `llmq:ctl:{<queue>}`, which
every worker of the queue follows with a plain XREAD from `$` (its own position, not the
consumer group: a call concerns every worker, or the one it names). Each worker that takes the
call answers with one `ControlReply` on `llmq:ctlr:<call_id>` (`queue_reply`), which expires
after `REPLY_TTL_S`. The control keys are admin-only in deploy/acl.conf: workers may only read
calls and write answers.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from llmq.broker import replies
from llmq.broker.client import Client
from llmq.broker.commands import as_fields
from llmq.broker.connection import translate_errors
from llmq.broker.keys import Keys
from llmq.protocol import (
    ControlCall,
    ControlReply,
    decode_reply,
    encode_call,
    encode_reply,
)

__all__ = ["CONTROL_STREAM_MAXLEN", "REPLY_TTL_S", "call_workers", "queue_reply"]

REPLY_TTL_S = 3600
CONTROL_STREAM_MAXLEN = 1000


def queue_reply(pipe: Any, keys: Keys, reply: ControlReply) -> None:
    """Queue one worker's answer on a pipeline: XADD to the call's reply stream, then EXPIRE."""
    key = keys.control_reply(reply.call_id)
    pipe.xadd(key, encode_reply(reply))
    pipe.expire(key, REPLY_TTL_S)


def call_workers(client: Client, method: str, args: dict[str, Any] | None = None, *,
                 queue: str | None = None, worker: str | None = None,
                 expected: set[str] | None = None, timeout: float = 10.0) -> list[ControlReply]:
    """Send one call to the workers of `queue` (or just `worker`) and gather their answers.

    Waits until every worker in `expected` answered (by default: the named worker, or the live
    workers of the queue by their heartbeats) or `timeout` seconds passed; returns the answers
    in arrival order.
    """
    keys = client.keys
    queue = queue or client.settings.queue
    if expected is None:
        expected = {worker} if worker else {w.worker_id for w in client.workers()
                                            if w.queue == queue}
    call = ControlCall(call_id=f"call-{uuid.uuid4().hex[:16]}", method=method, args=args or {},
                       worker=worker)
    reply_key = keys.control_reply(call.call_id)
    answers: list[ControlReply] = []
    last_id = "0-0"
    deadline = time.monotonic() + timeout
    # NOTE: not retried through outages: a call sent twice would run twice.
    with translate_errors(client.url):
        client.redis.xadd(keys.control(queue), as_fields(encode_call(call)),
                          maxlen=CONTROL_STREAM_MAXLEN, approximate=True)
        # NOTE: with nobody expected (no heartbeat yet) it listens for the whole timeout.
        while not expected or not expected <= {a.worker for a in answers}:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            reply = client.redis.xread({reply_key: last_id},
                                       block=max(1, int(min(left, 1.0) * 1000)))
            for entry_id, fields in replies.read_entries(reply):
                last_id = entry_id
                if (answer := decode_reply(fields)) is not None:
                    answers.append(answer)
    return answers
