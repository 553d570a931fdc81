"""CancelListener: follows `llmq:cancel:{<queue>}` and aborts in-flight requests it names.

Every worker of a queue reads the whole cancel stream (plain XREAD, no group: a cancel concerns
whichever worker holds the request), from the stream's last entry at start. A cancel for a request
in flight flags its entries and asks the busy loop to abort them, so generation stops within one
step and the terminal event says `done{finish_reason: cancelled}`. Requests not read yet are
covered by the `llmq:x:{<request_id>}` flag, which admission checks (worker/admission.py).

After a Redis outage the stream may have been recreated with lower ids (a restart without
persistence): the listener then starts again from the beginning of the new stream.
"""

from __future__ import annotations

import logging
import threading

import redis

from llmq.broker import protocol
from llmq.broker.commands import stream_entries
from llmq.broker.protocol import as_str, parse_entry_id
from llmq.worker.backoff import TRANSIENT_ERRORS, Backoff
from llmq.worker.inbox import AbortRequests
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)


class CancelListener:
    def __init__(self, ctx: WorkerContext) -> None:
        self.client = ctx.connect()
        self.cancel_key = ctx.keys.cancel(ctx.queue)
        self.table = ctx.table
        self.inbox = ctx.inbox
        self.block_ms = ctx.config.read_block_ms
        self.stop_event = threading.Event()
        self.backoff = Backoff("cancel listener", ctx.state, stop=self.stop_event)
        self.last_id: str | None = None
        self._thread = threading.Thread(target=self._run, name="llmq-cancel-listener",
                                        daemon=True)

    def start(self) -> None:
        # NOTE: find where the cancel stream ends before the stream reader admits anything: a
        # cancel sent between an admission and the listener's first read would be missed.
        try:
            self.last_id = self._stream_last_id()
        except (redis.RedisError, *TRANSIENT_ERRORS):  # type: ignore[misc]
            pass  # Redis not there yet: nothing admitted either; the thread reads it later
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self.stop_event.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _stream_last_id(self) -> str:
        last = self.client.xrevrange(self.cancel_key, count=1)
        if not last:
            return "0-0"
        return as_str(last[0][0])

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                if self.last_id is None:
                    self.last_id = self._stream_last_id()
                elif self.backoff.in_outage:
                    # Back from an outage: a stream recreated from scratch has lower ids.
                    if parse_entry_id(self._stream_last_id()) < parse_entry_id(self.last_id):
                        logger.warning("cancel stream was reset: reading it from the start")
                        self.last_id = "0-0"
                reply = self.client.xread({self.cancel_key: self.last_id}, block=self.block_ms)
                self.backoff.succeeded()
            except TRANSIENT_ERRORS as e:
                self.backoff.failed(e)
                continue
            except redis.ResponseError as e:
                if "UNBLOCKED" not in str(e):  # not just "the stream was deleted meanwhile"
                    logger.error("cancel stream read refused: %s", e)
                    self.stop_event.wait(1.0)
                continue
            for entry_id, fields in stream_entries(reply):
                self.last_id = as_str(entry_id)
                request_id = protocol.decode_cancel(fields)
                if request_id is not None:
                    self.cancel(request_id)

    def cancel(self, request_id: str) -> list[str]:
        entry_ids = self.table.request_cancel(request_id)
        if entry_ids:
            logger.info("cancel %s: aborting entries %s", request_id, entry_ids)
            self.inbox.put(AbortRequests(entry_ids))
        return entry_ids
