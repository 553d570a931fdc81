"""StreamFollower: an IO thread that reads one stream every worker of a queue follows whole.

The cancel stream and the control stream are read this way: a plain XREAD (no consumer group:
what they carry concerns every worker, or the one that holds a request), from the stream's last
entry at start, so nothing older is replayed. Each read takes at most `READ_COUNT` entries: a
burst (or a flood) is read in pages, never as one reply the size of all written since the last
read. After a Redis outage the stream may have been recreated with lower ids (a restart without
persistence): the follower then reads the new stream from its beginning. Subclasses say what an
entry means (`handle`) and may act before each blocking read (`before_read`).
"""

from __future__ import annotations

import logging
import threading

import redis

from llmq.broker import replies
from llmq.protocol import parse_entry_id
from llmq.worker.backoff import REDIS_ERRORS, TRANSIENT_ERRORS, Backoff
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)

READ_COUNT = 256  # entries per read


class StreamFollower:
    """Follows `key` on a connection of its own; `block_ms` defaults to the worker's read slice."""

    def __init__(self, ctx: WorkerContext, key: str, *, name: str,
                 block_ms: int | None = None) -> None:
        self.client = ctx.connect()
        self.key = key
        self.block_ms = ctx.config.read_block_ms if block_ms is None else block_ms
        self.name = name
        self.stop_event = threading.Event()
        self.backoff = Backoff(name, ctx.state, stop=self.stop_event)
        self.last_id: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"llmq-{name.replace(' ', '-')}",
                                        daemon=True)

    def start(self) -> None:
        # NOTE: find where the stream ends before the stream reader admits anything: a cancel
        # sent between an admission and the first read would be missed.
        try:
            self.last_id = self._stream_last_id()
        except REDIS_ERRORS:
            pass  # Redis not there yet: nothing admitted either; the thread reads it later
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self.stop_event.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def handle(self, entry_id: str, fields: replies.Fields) -> None:
        raise NotImplementedError

    def before_read(self) -> None:
        """Called before each read, and once more when the thread stops."""

    def _stream_last_id(self) -> str:
        last = replies.entries(self.client.xrevrange(self.key, count=1), "XREVRANGE")
        return last[0].entry_id if last else "0-0"

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.before_read()
                if self.last_id is None:
                    self.last_id = self._stream_last_id()
                elif self.backoff.in_outage:
                    # Back from an outage: a stream recreated from scratch has lower ids.
                    if parse_entry_id(self._stream_last_id()) < parse_entry_id(self.last_id):
                        logger.warning("%s: %s was reset, reading it from the start", self.name,
                                       self.key)
                        self.last_id = "0-0"
                reply = self.client.xread({self.key: self.last_id}, count=READ_COUNT,
                                          block=self.block_ms)
                self.backoff.succeeded()
            except TRANSIENT_ERRORS as e:
                self.backoff.failed(e)
                continue
            except redis.ResponseError as e:
                if "UNBLOCKED" not in str(e):  # not just "the stream was deleted meanwhile"
                    logger.error("%s: refused by Redis: %s", self.name, e)
                    self.stop_event.wait(1.0)
                continue
            for entry_id, fields in replies.read_entries(reply):
                self.last_id = entry_id
                self.handle(entry_id, fields)
        try:
            self.before_read()
        except REDIS_ERRORS:
            pass
