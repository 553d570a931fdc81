"""AsyncClient: the asyncio twin of `llmq.broker.client.Client`, method for method.

    async with AsyncClient() as client:
        request_id = await client.submit("Hello", max_tokens=32)
        async for event in client.events(request_id):
            ...

Only the IO differs: commands are built and replies parsed by `llmq.broker.commands`, events are
folded by `Transcript`, and requests validated by the worker's own decoder, as in the sync client.
Any number of `events()` may run at once: one reader follows every result stream on a few
connections (`llmq.broker.aio_result_reader`), and transient failures are retried as in `Client`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import redis
import redis.asyncio

from llmq.broker import replies
from llmq.broker.aio_result_reader import AsyncResultReader
from llmq.broker.client_base import ClientBase
from llmq.broker.commands import (
    DEFAULT_REQUEST_TTL,
    DeadLetterEntry,
    Followed,
    QueueStats,
    ResultFollower,
    Submission,
    dead_letter_to_retry,
    group_created,
    parse_dead_letters,
    parse_heartbeats,
    queue_group_creation,
    queue_names,
)
from llmq.broker.connection import DEFAULT_MAX_CONNECTIONS, connect_async
from llmq.broker.functions import RETRY_FUNCTION, ensure_functions_async
from llmq.broker.lane_stats import LaneStats, lane_stats_reads, parse_lane_stats, queue_lanes
from llmq.broker.retry import DEFAULT_RETRY_TIMEOUT, Backoff
from llmq.broker.settings import BrokerSettings
from llmq.protocol import (
    Done,
    Encoding,
    Error,
    Event,
    WorkerHeartbeat,
)
from llmq.protocol.errors import BrokerError, RequestFailed

__all__ = ["AsyncClient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncClient(ClientBase):
    """Asyncio producer client; the arguments and methods are those of `Client`."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        queue: str | None = None,
        prefix: str | None = None,
        encoding: Encoding = "json",
        request_ttl: int = DEFAULT_REQUEST_TTL,
        settings: BrokerSettings | None = None,
        connection: redis.asyncio.Redis | None = None,
        retry_timeout: float | None = DEFAULT_RETRY_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        client_name: str | None = None,
    ) -> None:
        self._configure(redis_url, queue, prefix, encoding, request_ttl, settings, connection,
                        retry_timeout)
        self._owns_connection = connection is None
        self.redis: redis.asyncio.Redis = (
            connection if connection is not None
            else connect_async(self.url, max_connections=max_connections,
                               client_name=client_name))
        self.reader = AsyncResultReader(self.redis, self.url, self._policy)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.reader.aclose()
        if self._owns_connection:
            await self.redis.aclose()

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """await fn() with the retries and error translation of `Client.call`."""
        deadline, backoff = self._policy.deadline(), Backoff()
        while True:
            try:
                result = await fn()
            except redis.RedisError as exc:
                await asyncio.sleep(self._retrying(exc, deadline, backoff))
                continue
            self._policy.reached = True
            return result

    async def ping(self) -> None:
        await self.call(self.redis.ping)

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[Mapping[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        queue: str | None = None,
        **params: Any,
    ) -> str:
        submission = self._submission(prompt, messages, prompt_token_ids, request_id, params)
        queue = self._queue(queue)
        await self._ensure_group_once(queue)
        await self._ensure_lane_groups(queue, [submission])

        async def send() -> Any:
            return await self.redis.fcall(*self._fcall_args(submission, queue))

        reply = await self._submitting(send, queue)
        await self._verify_markers(queue, [(submission, reply)])
        return self._submitted_id(submission, reply)

    async def _verify_markers(self, queue: str, sent: Iterable[tuple[Any, Any]]) -> None:
        """`Client._verify_markers`, awaited."""
        if not (marked := self._marked_elsewhere(queue, sent)):
            return

        async def read() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_marker_checks(pipe, queue, marked)
            return await pipe.execute(raise_on_error=False)

        self._check_markers(marked, await self.call(read))

    async def submit_many(self, requests: Iterable[Mapping[str, Any]], *,
                          queue: str | None = None) -> list[str]:
        submissions = self._submissions(requests)
        queue = self._queue(queue)
        await self._ensure_group_once(queue)
        await self._ensure_lane_groups(queue, submissions)

        async def send() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for submission in submissions:
                pipe.fcall(*self._fcall_args(submission, queue))
            return await pipe.execute()

        replies = await self._submitting(send, queue)
        await self._verify_markers(queue, zip(submissions, replies, strict=True))
        return [self._submitted_id(s, r) for s, r in zip(submissions, replies, strict=True)]

    async def _submitting(self, send: Callable[[], Awaitable[T]], queue: str) -> T:
        """send() through `call`, loading the function library once if the server lacks it."""
        while True:
            try:
                return await self.call(send)
            except BrokerError as exc:
                failure = self._submit_failed(exc, queue)
                if failure is not None:
                    raise failure from None
                try:
                    await self.call(lambda: ensure_functions_async(self.redis))
                except BrokerError as load_error:
                    logger.info("could not load the function library: %s", load_error)

    async def ensure_group(self, queue: str | None = None) -> bool:
        queue = self._queue(queue)
        async def create() -> bool:
            pipe = self.redis.pipeline(transaction=False)
            queue_group_creation(pipe, self.keys, queue)
            return group_created(await pipe.execute(raise_on_error=False), self.keys, queue)

        created = await self.call(create)
        self._groups_ready.add(queue)
        return created

    async def _ensure_lane_groups(self, queue: str, submissions: list[Submission]) -> None:
        if not (lanes := self._new_lanes(queue, submissions)):
            return

        async def create() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_lane_groups(pipe, lanes)
            return await pipe.execute(raise_on_error=False)

        self._lane_groups_made(lanes, await self.call(create))

    async def _ensure_group_once(self, queue: str) -> None:
        if queue not in self._groups_ready:
            await self.ensure_group(queue)

    async def events(self, request_id: str, *, timeout: float | None = None
                     ) -> AsyncGenerator[Event, None]:
        async for followed in self.follow(request_id, timeout=timeout):
            yield followed.event

    async def follow(self, request_id: str, *, timeout: float | None = None,
                     after: str | None = None) -> AsyncGenerator[Followed, None]:
        follower = ResultFollower(self.keys, request_id, timeout, after=after)
        async for followed in self.reader.follow(follower):
            yield followed

    async def result(self, request_id: str, timeout: float | None = None) -> Done:
        async for event in self.events(request_id, timeout=timeout):
            if isinstance(event, Done):
                return event
            if isinstance(event, Error):
                raise RequestFailed(event)
        raise AssertionError("events() ends only after a terminal event")

    async def cancel(self, request_id: str, *, queue: str | None = None) -> None:
        queue = self._queue(queue)

        async def set_flag() -> None:  # first, as in Client.cancel
            pipe = self.redis.pipeline(transaction=False)
            self._set_cancel_flag(pipe, request_id)
            await pipe.execute()

        async def notify() -> None:
            pipe = self.redis.pipeline(transaction=False)
            self._notify_cancel(pipe, request_id, queue)
            await pipe.execute()

        await self.call(set_flag)
        await self.call(notify)

    async def stats(self, queue: str | None = None) -> QueueStats:
        queue = self._queue(queue)

        async def read() -> QueueStats:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_stats_reads(pipe, queue)
            return self._parse_stats(queue, await pipe.execute(raise_on_error=False))

        return await self.call(read)

    async def lane_stats(self, queue: str | None = None) -> list[LaneStats]:
        """Backlog, pending and entries read of each lane stream of a queue (its own first)."""
        queue = self._queue(queue)

        async def read() -> list[LaneStats]:
            names = replies.texts(await self.redis.hkeys(self.keys.lanes(queue)), "HKEYS")
            lanes = queue_lanes(self.keys, queue, names)
            pipe = self.redis.pipeline(transaction=False)
            lane_stats_reads(pipe, lanes)
            return parse_lane_stats(lanes, await pipe.execute(raise_on_error=False))

        return await self.call(read)

    async def queues(self) -> list[str]:
        return queue_names(await self.call(lambda: self.redis.smembers(self.keys.queues())))

    async def workers(self) -> list[WorkerHeartbeat]:
        async def read() -> list[WorkerHeartbeat]:
            worker_ids = replies.texts(await self.redis.zrange(self.keys.workers(), 0, -1),
                                       "ZRANGE")
            pipe = self.redis.pipeline(transaction=False)
            for worker_id in worker_ids:
                pipe.hgetall(self.keys.worker(worker_id))
            live, dead = parse_heartbeats(worker_ids, await pipe.execute())
            if dead:
                try:
                    await self.redis.zrem(self.keys.workers(), *dead)
                except redis.exceptions.NoPermissionError:
                    pass  # a user that may only read the registry still sees the live ones
            return live

        return await self.call(read)

    async def dead_letters(self, queue: str | None = None, *,
                           count: int = 100) -> list[DeadLetterEntry]:
        queue = self._queue(queue)
        entries = await self.call(lambda: self.redis.xrange(self.keys.dlq(queue), count=count))
        return parse_dead_letters(entries)

    async def retry_dead_letter(self, dlq_entry_id: str, *, queue: str | None = None) -> str:
        queue = self._queue(queue)
        entries = await self.call(lambda: self.redis.xrange(self.keys.dlq(queue), dlq_entry_id,
                                                             dlq_entry_id))
        entry = dead_letter_to_retry(entries, dlq_entry_id, queue)
        old_result, fcall_args = self._retry_args(entry, queue)
        if old_result is not None:  # first, as in Client.retry_dead_letter
            await self.call(lambda: self.redis.delete(old_result))

        async def send() -> object:
            return await self.redis.fcall(RETRY_FUNCTION, *fcall_args)

        return replies.text(await self._submitting(send, queue), RETRY_FUNCTION)

    async def purge_dead_letters(self, queue: str | None = None) -> int:
        queue = self._queue(queue)

        async def purge() -> int:
            pipe = self.redis.pipeline(transaction=True)
            pipe.xlen(self.keys.dlq(queue))
            pipe.delete(self.keys.dlq(queue))
            return replies.integer((await pipe.execute())[0], "XLEN")

        return await self.call(purge)
