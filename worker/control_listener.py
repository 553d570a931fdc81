"""ControlListener: follows `llmq:ctl:<queue>`, hands utility calls to the busy loop, and writes
the answers to `llmq:ctlr:<call_id>`.

Like the cancel listener, every worker reads the whole control stream with a plain XREAD from
its end at start (its own position, not the consumer group: a call is for every worker, or the
one it names). The call itself runs on the busy loop (worker/utility_calls.py), which owns the
engine; its answer comes back here through `answer()` and is written between two reads, so the
busy loop never waits on Redis. Answers wait at most one `block_ms` read slice.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import redis

from llmq.broker.commands import stream_entries
from llmq.broker.control import REPLY_TTL_S, ControlCall, ControlReply, decode_call, encode_reply
from llmq.broker.keys import Keys
from llmq.worker.backoff import TRANSIENT_ERRORS, Backoff, ConnectionState

logger = logging.getLogger(__name__)

# NOTE: short, so an answer queued by the busy loop is written soon after the call ran.
ANSWER_BLOCK_MS = 200


@dataclass
class UtilityCall:
    """A control call for the busy loop to run (put on the worker's inbox)."""

    call: ControlCall


class ControlListener:
    def __init__(self, client: redis.Redis, keys: Keys, queue_name: str, worker_id: str,
                 inbox: Any, *, state: ConnectionState) -> None:
        self.client = client
        self.keys = keys
        self.control_key = keys.control(queue_name)
        self.worker_id = worker_id
        self.inbox = inbox
        self.stop_event = threading.Event()
        self.backoff = Backoff("control listener", state, stop=self.stop_event)
        self.last_id: str | None = None
        self._answers: queue.SimpleQueue[ControlReply] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="llmq-control-listener",
                                        daemon=True)

    def start(self) -> None:
        try:
            self.last_id = self._stream_last_id()
        except (redis.RedisError, *TRANSIENT_ERRORS):  # type: ignore[misc]
            pass  # Redis not there yet: the thread finds the end later
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self.stop_event.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def answer(self, reply: ControlReply) -> None:
        """Queue an answer for writing (busy loop)."""
        self._answers.put(reply)

    def _stream_last_id(self) -> str:
        last = self.client.xrevrange(self.control_key, count=1)
        if not last:
            return "0-0"
        entry_id = last[0][0]
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._write_answers()
                if self.last_id is None:
                    self.last_id = self._stream_last_id()
                reply = self.client.xread({self.control_key: self.last_id},
                                          block=ANSWER_BLOCK_MS)
                self.backoff.succeeded()
            except TRANSIENT_ERRORS as e:
                self.backoff.failed(e)
                continue
            except redis.ResponseError as e:
                if "UNBLOCKED" not in str(e):
                    logger.error("control stream read refused: %s", e)
                    self.stop_event.wait(1.0)
                continue
            for entry_id, fields in stream_entries(reply):
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                call = decode_call(fields)
                if call is None:
                    logger.warning("control entry %s is not a call: ignored", self.last_id)
                elif call.worker in (None, self.worker_id):
                    logger.info("utility call %s: %s %s", call.call_id, call.method, call.args)
                    self.inbox.put(UtilityCall(call))
        self._write_answers()

    def _write_answers(self) -> None:
        while True:
            try:
                reply = self._answers.get_nowait()
            except queue.Empty:
                return
            key = self.keys.control_reply(reply.call_id)
            try:
                pipe = self.client.pipeline(transaction=True)
                pipe.xadd(key, encode_reply(reply))
                pipe.expire(key, REPLY_TTL_S)
                pipe.execute()
            except (redis.RedisError, *TRANSIENT_ERRORS) as e:  # type: ignore[misc]
                # NOTE: an answer is worth a retry, not a lost reader thread.
                logger.warning("answer to %s not written (%s): retrying", reply.call_id, e)
                self._answers.put(reply)
                raise
