"""AsyncResultReader: one asyncio reader for every result stream an `AsyncClient` follows.

Each lane of the `ReadMux` (at most KEYS_PER_LANE streams) is one task with one dedicated
connection, looping on `XREAD BLOCK` over its streams and putting each follower's new entries on
that follower's queue. A stream subscribed while the lane's read is blocked is picked up at once:
the lane's connection is woken with `CLIENT UNBLOCK` (its id read with `CLIENT ID` when it
connects). Without the ACL rights for those two, reads are cut into short slices instead.

Transient failures (see `RetryPolicy`) are waited out with backoff and the read resumes from the
last entry each follower got; only a follower's own timeout ends it. A failure that waiting cannot
cure ends the lane's followers with the error, translated as the client's other calls are.
`llmq.broker.result_reader.ResultReader` is the threaded twin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

import redis
import redis.asyncio

from llmq.broker import replies
from llmq.broker.commands import Followed, ResultFollower
from llmq.broker.connection import dedicated_connection, is_cluster, translate
from llmq.broker.multiplex import (
    FALLBACK_SLICE_MS,
    KEYS_PER_LANE,
    UNBLOCK_TRIES,
    Lane,
    LaneIO,
    ReaderBase,
    format_entry_id,
    merge_replies,
    single_key_reads,
)
from llmq.broker.replies import StreamEntry
from llmq.broker.retry import Backoff, RetryPolicy
from llmq.protocol.errors import ResultTimeout

__all__ = ["AsyncResultReader"]

logger = logging.getLogger(__name__)



class AsyncResultReader(ReaderBase):
    def __init__(self, client: redis.asyncio.Redis, url: str, policy: RetryPolicy, *,
                 keys_per_lane: int = KEYS_PER_LANE) -> None:
        super().__init__(url, policy, keys_per_lane, polled=is_cluster(client))
        self._redis = client
        self._background: set[asyncio.Task] = set()

    async def follow(self, follower: ResultFollower) -> AsyncGenerator[Followed, None]:
        """The follower's events as they arrive; ResultTimeout at its deadline."""
        sink: asyncio.Queue[Any] = asyncio.Queue()
        subscription, wake = self._mux.subscribe(follower.key, sink)
        assert subscription.lane is not None
        lane = self._lane_task(subscription.lane)
        lane.work.set()
        if wake:
            self._wake(lane)
        try:
            while not follower.finished:
                try:
                    remaining = follower.remaining()
                except ResultTimeout:
                    # NOTE: no await between a dispatch and its puts: position and queue agree.
                    for followed in await self._last_look(follower, sink, subscription.position):
                        yield followed
                    if follower.finished:
                        return
                    raise
                try:
                    item = await asyncio.wait_for(sink.get(), remaining)
                except TimeoutError:
                    continue
                if isinstance(item, BaseException):
                    raise item
                for followed in follower.feed(item):
                    yield followed
        finally:
            self._mux.unsubscribe(subscription)

    async def _last_look(self, follower: ResultFollower, sink: asyncio.Queue[Any],
                         position: tuple[int, int]) -> list[Followed]:
        """At the deadline: what was delivered but not taken, then what the stream holds now.

        So a timeout of 0 still reads what is already there, as one XREAD without BLOCK would.
        """
        entries: list[StreamEntry] = []
        while not sink.empty():
            item = sink.get_nowait()
            if isinstance(item, BaseException):
                raise item
            entries += item
        try:
            reply = await self._redis.xread({follower.key: format_entry_id(position)}, count=512)
        except redis.RedisError:
            reply = None
        return follower.feed(entries + replies.read_entries(reply))

    async def aclose(self) -> None:
        self._closed = True
        for lane in self._lanes.values():
            if lane.runner is not None:
                lane.runner.cancel()
        for task in [lane.runner for lane in self._lanes.values() if lane.runner] + list(
                self._background):
            with contextlib.suppress(BaseException):
                await task
        for lane in self._lanes.values():
            await self._drop_connection(lane)

    # -- lanes ------------------------------------------------------------------------------------

    def _lane_task(self, lane: Lane) -> LaneIO:
        state = self._lanes.get(lane.index)
        if state is None or state.runner is None or state.runner.done():
            state = state or LaneIO(lane, asyncio.Event())
            state.runner = asyncio.get_running_loop().create_task(self._run(state))
            self._lanes[lane.index] = state
        return state

    async def _run(self, state: LaneIO) -> None:
        backoff = Backoff()
        failing = False
        while not self._closed:
            if not len(state.lane):
                state.work.clear()
                await state.work.wait()
                continue
            try:
                if self._polled:
                    command = self._mux.read_command(state.lane, None)
                    if command is None:
                        continue  # its last follower left: back to the idle wait
                    reply = await self._poll(command)
                else:
                    if state.conn is None:
                        state.conn = dedicated_connection(self._redis)
                        await state.conn.connect()
                        state.client_id = await self._client_id(state.conn)
                    block = self._block_ms(state)
                    command = self._mux.read_command(state.lane, block)
                    state.wake_pending = False
                    if command is None:
                        continue
                    await state.conn.send_command(*command)
                    reply = await state.conn.read_response()
            except (redis.RedisError, OSError) as exc:
                self._mux.read_failed(state.lane)
                await self._drop_connection(state)
                if not self._policy.should_retry(exc, None):
                    self._fail(state.lane, exc)
                elif not failing:
                    logger.warning("reading result streams from %s failed (%s); retrying",
                                   self._url, exc)
                failing = True
                await asyncio.sleep(backoff.delay())
                continue
            if failing:
                logger.warning("reading result streams from %s again", self._url)
                failing = False
            self._policy.reached = True
            backoff.reset()
            for sink, entries in self._mux.dispatch(state.lane, reply):
                sink.put_nowait(entries)
            if self._polled:
                await asyncio.sleep(state.pace.after(bool(reply)))

    async def _poll(self, command: list[Any]) -> list[list[object]]:
        """One polled round on a cluster: an XREAD per stream, pipelined per node."""
        pipe = self._redis.pipeline(transaction=False)
        for key, after, count in single_key_reads(command):
            pipe.xread({key: after}, count=count)
        return merge_replies(await pipe.execute())

    def _fail(self, lane: Lane, exc: BaseException) -> None:
        error = translate(exc, self._url) or exc
        for sink in self._mux.sinks(lane):
            sink.put_nowait(error)
        self._mux.drop_lane_subscriptions(lane)

    async def _client_id(self, conn: Any) -> int | None:
        if not self._can_unblock:
            return None
        try:
            await conn.send_command("CLIENT", "ID")
            return int(await conn.read_response())
        except redis.ResponseError as exc:  # NOPERM: no CLIENT ID / UNBLOCK for this user
            logger.info("no CLIENT ID (%s): result reads wait up to %d ms for new streams",
                        exc, FALLBACK_SLICE_MS)
            self._can_unblock = False
            return None

    async def _drop_connection(self, state: LaneIO) -> None:
        conn, state.conn, state.client_id = state.conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.disconnect()

    # -- waking a blocked read --------------------------------------------------------------------

    def _wake(self, state: LaneIO) -> None:
        if state.wake_pending or state.client_id is None:
            return
        state.wake_pending = True
        task = asyncio.get_running_loop().create_task(self._unblock(state, state.lane.rounds))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _unblock(self, state: LaneIO, round_: int) -> None:
        client_id = state.client_id
        try:
            for attempt in range(UNBLOCK_TRIES):
                if client_id is None or not state.lane.reading or state.lane.rounds != round_:
                    return
                if await self._redis.client_unblock(client_id):
                    return
                await asyncio.sleep(0.0005 * 2 ** attempt)
        except redis.ResponseError as exc:
            logger.info("no CLIENT UNBLOCK (%s): result reads wait up to %d ms for new "
                        "streams", exc, FALLBACK_SLICE_MS)
            self._can_unblock = False
            state.client_id = None
        except redis.RedisError:
            pass  # the read ends at its slice anyway
