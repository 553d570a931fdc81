"""ResultReader: one reader for every result stream a `Client` follows, on threads.

The threaded twin of `llmq.broker.aio_result_reader.AsyncResultReader` (read that module's
docstring): each lane of the `ReadMux` is a daemon thread with one dedicated connection looping on
`XREAD BLOCK`, and hands each follower its new entries through a queue; a stream subscribed while
a read is blocked wakes it with `CLIENT UNBLOCK`; transient failures are waited out and reads
resume from the last entry handed over. The mux is shared between the lane threads and the
callers' threads, under one lock that is never held across IO.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis

from llmq.broker import replies
from llmq.broker.commands import Followed, ResultFollower
from llmq.broker.connection import dedicated_connection, is_cluster, translate
from llmq.broker.keys import Keys
from llmq.broker.multiplex import (
    FALLBACK_SLICE_MS,
    KEYS_PER_LANE,
    UNBLOCK_TRIES,
    Lane,
    LaneIO,
    ReaderBase,
    Subscription,
    format_entry_id,
    merge_replies,
    single_key_reads,
)
from llmq.broker.replies import StreamEntry
from llmq.broker.retry import Backoff, RetryPolicy
from llmq.broker.transcript import Transcript
from llmq.protocol.errors import ResultTimeout

__all__ = ["FollowerGroup", "ResultReader"]

logger = logging.getLogger(__name__)


class ResultReader(ReaderBase):
    def __init__(self, client: redis.Redis, url: str, policy: RetryPolicy, *,
                 keys_per_lane: int = KEYS_PER_LANE) -> None:
        super().__init__(url, policy, keys_per_lane, polled=is_cluster(client))
        self._redis = client
        self._lock = threading.Lock()

    def follow(self, follower: ResultFollower) -> Iterator[Followed]:
        """The follower's events as they arrive; ResultTimeout at its deadline."""
        sink: queue.SimpleQueue[Any] = queue.SimpleQueue()
        subscription = self.subscribe(follower.key, sink)
        try:
            while not follower.finished:
                try:
                    remaining = follower.remaining()
                except ResultTimeout:
                    yield from self._last_look(follower, sink, subscription)
                    if follower.finished:
                        return
                    raise
                try:
                    item = sink.get(timeout=remaining)
                except queue.Empty:
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield from follower.feed(item)
        finally:
            self.unsubscribe(subscription)

    def subscribe(self, key: str, sink: Any) -> Subscription:
        """Hand every entry of stream `key` to `sink.put(entries)`, from the first entry on."""
        with self._lock:
            subscription, wake = self._mux.subscribe(key, sink)
            assert subscription.lane is not None
            lane = self._lane_thread(subscription.lane)
            lane.work.set()
        if wake:
            self._wake(lane)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._mux.unsubscribe(subscription)

    def _last_look(self, follower: ResultFollower, sink: queue.SimpleQueue[Any],
                   subscription: Subscription) -> list[Followed]:
        """At the deadline: what was delivered but not taken, then what the stream holds now."""
        entries: list[StreamEntry] = []
        with self._lock:
            position = subscription.position
            while not sink.empty():
                item = sink.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                entries += item
        try:
            reply = self._redis.xread({follower.key: format_entry_id(position)}, count=512)
        except redis.RedisError:
            reply = None
        return follower.feed(entries + replies.read_entries(reply))

    def close(self) -> None:
        self._closed = True
        for lane in list(self._lanes.values()):
            lane.work.set()
            self._drop_connection(lane)  # a blocked read fails at once and the thread ends

    # -- lanes ------------------------------------------------------------------------------------

    def _lane_thread(self, lane: Lane) -> LaneIO:
        """The lane's thread, started if needed (called with the lock held)."""
        state = self._lanes.get(lane.index)
        if state is None or state.runner is None or not state.runner.is_alive():
            state = state or LaneIO(lane, threading.Event())
            state.runner = threading.Thread(target=self._run, args=(state,), daemon=True,
                                            name=f"llmq-result-reader-{lane.index}")
            self._lanes[lane.index] = state
            state.runner.start()
        return state

    def _run(self, state: LaneIO) -> None:
        backoff = Backoff()
        failing = False
        while not self._closed:
            with self._lock:
                idle = not len(state.lane)
                if idle:
                    state.work.clear()
            if idle:
                state.work.wait()
                continue
            try:
                if self._polled:
                    with self._lock:
                        command = self._mux.read_command(state.lane, None)
                    if command is None:
                        continue  # its last follower left: back to the idle wait
                    reply = self._poll(command)
                else:
                    conn = state.conn
                    if conn is None:
                        conn = state.conn = dedicated_connection(self._redis)
                        conn.connect()
                        state.client_id = self._client_id(conn)
                    block = self._block_ms(state)
                    with self._lock:
                        command = self._mux.read_command(state.lane, block)
                        state.wake_pending = False
                    if command is None:
                        continue
                    conn.send_command(*command)
                    reply = conn.read_response()
            except (redis.RedisError, OSError, ValueError, AttributeError) as exc:
                with self._lock:
                    self._mux.read_failed(state.lane)
                self._drop_connection(state)
                if self._closed:
                    return
                if not self._policy.should_retry(exc, None):
                    self._fail(state.lane, exc)
                elif not failing:
                    logger.warning("reading result streams from %s failed (%s); retrying",
                                   self._url, exc)
                failing = True
                time.sleep(backoff.delay())
                continue
            if failing:
                logger.warning("reading result streams from %s again", self._url)
                failing = False
            self._policy.reached = True
            backoff.reset()
            # NOTE: handed over under the lock, so a follower's last look (below) sees every
            # entry either in its queue or after its position, never in between.
            with self._lock:
                for sink, entries in self._mux.dispatch(state.lane, reply):
                    sink.put(entries)
            if self._polled:
                time.sleep(state.pace.after(bool(reply)))

    def _poll(self, command: list[Any]) -> list[list[object]]:
        """One polled round on a cluster: an XREAD per stream, pipelined per node."""
        pipe = self._redis.pipeline(transaction=False)
        for key, after, count in single_key_reads(command):
            pipe.xread({key: after}, count=count)
        return merge_replies(pipe.execute())

    def _fail(self, lane: Lane, exc: BaseException) -> None:
        error = translate(exc, self._url) or exc
        with self._lock:
            sinks = self._mux.sinks(lane)
            self._mux.drop_lane_subscriptions(lane)
        for sink in sinks:
            sink.put(error)

    def _client_id(self, conn: Any) -> int | None:
        if not self._can_unblock:
            return None
        try:
            conn.send_command("CLIENT", "ID")
            return int(conn.read_response())
        except redis.ResponseError as exc:
            logger.info("no CLIENT ID (%s): result reads wait up to %d ms for new streams",
                        exc, FALLBACK_SLICE_MS)
            self._can_unblock = False
            return None

    @staticmethod
    def _drop_connection(state: LaneIO) -> None:
        conn, state.conn, state.client_id = state.conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.disconnect()

    # -- waking a blocked read --------------------------------------------------------------------

    def _wake(self, state: LaneIO) -> None:
        with self._lock:
            if state.wake_pending or state.client_id is None:
                return
            state.wake_pending = True
            round_, client_id = state.lane.rounds, state.client_id
        try:
            for attempt in range(UNBLOCK_TRIES):
                with self._lock:
                    if not state.lane.reading or state.lane.rounds != round_:
                        return
                if self._redis.client_unblock(client_id):
                    return
                time.sleep(0.0005 * 2 ** attempt)
        except redis.ResponseError as exc:
            logger.info("no CLIENT UNBLOCK (%s): result reads wait up to %d ms for new "
                        "streams", exc, FALLBACK_SLICE_MS)
            self._can_unblock = False
            state.client_id = None
        except redis.RedisError:
            pass  # the read ends at its slice anyway


class _Tagged:
    """A sink that tells the group's queue whose entries these are."""

    def __init__(self, inbox: queue.SimpleQueue[Any], request_id: str) -> None:
        self.inbox = inbox
        self.request_id = request_id

    def put(self, entries: Any) -> None:
        self.inbox.put((self.request_id, entries))


class FollowerGroup:
    """Many requests followed at once (file and batch jobs); `poll()` returns those that ended.

        group = client.follow_many(request_ids)
        while group:
            for transcript in group.poll(block_ms=250):   # each ended request once
                ...
    """

    def __init__(self, reader: ResultReader, keys: Keys) -> None:
        self._reader = reader
        self._keys = keys
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[str, tuple[ResultFollower, Subscription]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_ids: Any) -> None:
        for request_id in request_ids:
            if request_id not in self._pending:
                follower = ResultFollower(self._keys, request_id, None)
                sink = _Tagged(self._inbox, request_id)
                self._pending[request_id] = (follower, self._reader.subscribe(follower.key, sink))

    def discard(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._reader.unsubscribe(pending[1])

    def pending_ids(self) -> list[str]:
        return list(self._pending)

    def poll(self, block_ms: int = 250) -> list[Transcript]:
        """The requests that ended since the last poll, waiting up to `block_ms` for one."""
        ended: list[Transcript] = []
        timeout: float | None = block_ms / 1000
        while self._pending:
            try:
                item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                break
            timeout = None  # then take what else is there without waiting
            if isinstance(item, BaseException):
                raise item
            request_id, entries = item
            if isinstance(entries, BaseException):
                raise entries
            pending = self._pending.get(request_id)
            if pending is None:
                continue
            follower, _ = pending
            follower.feed(entries)
            if follower.finished:
                self.discard(request_id)
                ended.append(follower.transcript)
        return ended

    def close(self) -> None:
        for request_id in list(self._pending):
            self.discard(request_id)
