"""AsyncClient: the asyncio twin of `llmq.broker.client.Client`, method for method.

    async with AsyncClient() as client:
        request_id = await client.submit("Hello", max_tokens=32)
        async for event in client.events(request_id):
            ...

Only the IO differs: commands are built and replies parsed by `llmq.broker.commands`, events are
folded by `Transcript`, and requests validated by the worker's own decoder, as in the sync client.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import redis
import redis.asyncio

from llmq.broker.client import _ClientBase
from llmq.broker.commands import (
    DEFAULT_REQUEST_TTL,
    RETRY_SCRIPT,
    SUBMIT_SCRIPT,
    DeadLetterEntry,
    QueueStats,
    ResultFollower,
    as_str,
    dead_letter_to_retry,
    group_created,
    parse_dead_letters,
    parse_heartbeats,
    queue_group_creation,
)
from llmq.broker.connection import connect_async, translate_errors
from llmq.broker.errors import RequestFailed
from llmq.broker.protocol import (
    Done,
    Encoding,
    Error,
    Event,
    WorkerHeartbeat,
)
from llmq.broker.settings import BrokerSettings

__all__ = ["AsyncClient"]

logger = logging.getLogger(__name__)


class AsyncClient(_ClientBase):
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
    ) -> None:
        self._configure(redis_url, queue, prefix, encoding, request_ttl, settings, connection)
        self._owns_connection = connection is None
        self.redis: redis.asyncio.Redis = (connection if connection is not None
                                           else connect_async(self.url))
        self._submit_script = self.redis.register_script(SUBMIT_SCRIPT)
        self._retry_script = self.redis.register_script(RETRY_SCRIPT)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_connection:
            await self.redis.aclose()

    async def ping(self) -> None:
        with translate_errors(self.url):
            await self.redis.ping()

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
        with translate_errors(self.url):
            await self._ensure_group_once(queue)
            if submission.request_id is None:
                reply = await self.redis.xadd(self.keys.queue(queue),
                                              {submission.encoding: submission.payload})
            else:
                keys, args = self._script_args(submission, queue)
                reply = await self._submit_script(keys=keys, args=args)
        return self._submitted_id(submission, reply)

    async def submit_many(self, requests: Iterable[Mapping[str, Any]], *,
                          queue: str | None = None) -> list[str]:
        submissions = self._submissions(requests)
        queue = self._queue(queue)
        with translate_errors(self.url):
            await self._ensure_group_once(queue)
            pipe = self.redis.pipeline(transaction=False)
            for submission in submissions:
                if submission.request_id is None:
                    pipe.xadd(self.keys.queue(queue), {submission.encoding: submission.payload})
                else:
                    keys, args = self._script_args(submission, queue)
                    await self._submit_script(keys=keys, args=args, client=pipe)
            replies = await pipe.execute()
        return [self._submitted_id(s, r) for s, r in zip(submissions, replies, strict=True)]

    async def ensure_group(self, queue: str | None = None) -> bool:
        queue = self._queue(queue)
        with translate_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            queue_group_creation(pipe, self.keys, queue)
            created = group_created(await pipe.execute(raise_on_error=False))
        self._groups_ready.add(queue)
        return created

    async def _ensure_group_once(self, queue: str) -> None:
        if queue not in self._groups_ready:
            await self.ensure_group(queue)

    async def events(self, request_id: str, *, timeout: float | None = None
                     ) -> AsyncIterator[Event]:
        follower = ResultFollower(self.keys, request_id, timeout)
        with translate_errors(self.url):
            while not follower.finished:
                reply = await self.redis.xread(**follower.next_read())
                for event in follower.events(reply):
                    yield event

    async def result(self, request_id: str, timeout: float | None = None) -> Done:
        async for event in self.events(request_id, timeout=timeout):
            if isinstance(event, Done):
                return event
            if isinstance(event, Error):
                raise RequestFailed(event)
        raise AssertionError("events() ends only after a terminal event")

    async def cancel(self, request_id: str, *, queue: str | None = None) -> None:
        queue = self._queue(queue)
        with translate_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            self._queue_cancel(pipe, request_id, queue)
            await pipe.execute()

    async def stats(self, queue: str | None = None) -> QueueStats:
        queue = self._queue(queue)
        with translate_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            self._queue_stats_reads(pipe, queue)
            return self._parse_stats(queue, await pipe.execute(raise_on_error=False))

    async def queues(self) -> list[str]:
        with translate_errors(self.url):
            return sorted(as_str(m) for m in await self.redis.smembers(self.keys.queues()))

    async def workers(self) -> list[WorkerHeartbeat]:
        with translate_errors(self.url):
            worker_ids = [as_str(m) for m in await self.redis.zrange(self.keys.workers(), 0, -1)]
            pipe = self.redis.pipeline(transaction=False)
            for worker_id in worker_ids:
                pipe.hgetall(self.keys.worker(worker_id))
            hashes = await pipe.execute()
            live, dead = parse_heartbeats(worker_ids, hashes)
            if dead:
                await self.redis.zrem(self.keys.workers(), *dead)
        return live

    async def dead_letters(self, queue: str | None = None, *,
                           count: int = 100) -> list[DeadLetterEntry]:
        queue = self._queue(queue)
        with translate_errors(self.url):
            entries = await self.redis.xrange(self.keys.dlq(queue), count=count)
        return parse_dead_letters(entries)

    async def retry_dead_letter(self, dlq_entry_id: str, *, queue: str | None = None) -> str:
        queue = self._queue(queue)
        with translate_errors(self.url):
            entries = await self.redis.xrange(self.keys.dlq(queue), dlq_entry_id, dlq_entry_id)
            entry = dead_letter_to_retry(entries, dlq_entry_id, queue)
            keys, args = self._retry_args(entry, queue)
            new_id = await self._retry_script(keys=keys, args=args)
        return as_str(new_id)

    async def purge_dead_letters(self, queue: str | None = None) -> int:
        queue = self._queue(queue)
        with translate_errors(self.url):
            pipe = self.redis.pipeline(transaction=True)
            pipe.xlen(self.keys.dlq(queue))
            pipe.delete(self.keys.dlq(queue))
            count, _ = await pipe.execute()
        return int(count)
