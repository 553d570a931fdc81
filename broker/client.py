"""Client: the synchronous producer API (submit, follow events, cancel, inspect queues).

    from llmq.broker import Client

    with Client() as client:                      # LLMQ_REDIS_URL, else the `llmq up` server
        request_id = client.submit("Hello", max_tokens=32, temperature=0)
        for event in client.events(request_id):   # from the start: a late reader misses nothing
            ...
        done = client.result(request_id, timeout=60)   # or RequestFailed(code, message)

Any number of `events()` may run at once (in threads): one reader per client follows every
result stream on a few connections (`llmq.broker.result_reader`). A transient Redis failure (a
reset, a timeout, a failover, a full pool) is retried — a submit with the same request id, a
follower from the last entry it got — until `retry_timeout` (a follower: its own timeout); other
failures surface as `BrokerUnavailable` or `BrokerError` with a one-line message naming the cause.
`llmq.broker.aio.AsyncClient` is the asyncio twin; both take what has no IO from `ClientBase`
(`llmq.broker.client_base`: settings, request building, reply handling), build and parse their
commands with `llmq.broker.commands`, and follow a result stream with its `ResultFollower`
(which folds events with `llmq.broker.transcript.Transcript`), so only the IO differs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import redis

from llmq.broker import replies
from llmq.broker.client_base import ClientBase
from llmq.broker.commands import (
    DEFAULT_REQUEST_TTL,
    DeadLetterEntry,
    Followed,
    QueueStats,
    ResultFollower,
    Submission,
    as_str,
    dead_letter_to_retry,
    group_created,
    parse_dead_letters,
    parse_heartbeats,
    queue_group_creation,
    queue_names,
)
from llmq.broker.connection import DEFAULT_MAX_CONNECTIONS, connect
from llmq.broker.functions import RETRY_FUNCTION, ensure_functions
from llmq.broker.lane_stats import LaneStats, lane_stats_reads, parse_lane_stats, queue_lanes
from llmq.broker.result_reader import FollowerGroup, ResultReader
from llmq.broker.retry import DEFAULT_RETRY_TIMEOUT, Backoff
from llmq.broker.settings import BrokerSettings
from llmq.protocol import Done, Encoding, Error, Event, WorkerHeartbeat
from llmq.protocol.errors import BrokerError, RequestFailed

__all__ = ["Client"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Client(ClientBase):
    """Synchronous producer client.

    redis_url:   None -> `LLMQ_REDIS_URL`, else the embedded server `llmq up` started.
    queue:       the default queue of the methods (None -> `LLMQ_QUEUE`, else "default").
    prefix:      key prefix (None -> `LLMQ_PREFIX`, else "llmq").
    encoding:    "json" or "msgpack" for the requests it sends (events come back the same way).
    request_ttl: seconds a request id is remembered: idempotent submit and the cancel flag.
    connection:  an existing `redis.Redis` (must not decode responses) instead of a URL.
    retry_timeout: seconds a call retries transient failures once the server was reached (None:
                 for ever); a server never reached fails at once. Followers use their timeout.
    max_connections: the pool's size for calls (callers beyond it wait for a free one); the
                 result reader adds one connection per 2,000 followed streams.
    client_name: the name its connections show in CLIENT LIST.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        queue: str | None = None,
        prefix: str | None = None,
        encoding: Encoding = "json",
        request_ttl: int = DEFAULT_REQUEST_TTL,
        settings: BrokerSettings | None = None,
        connection: redis.Redis | None = None,
        retry_timeout: float | None = DEFAULT_RETRY_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        client_name: str | None = None,
    ) -> None:
        self._configure(redis_url, queue, prefix, encoding, request_ttl, settings, connection,
                        retry_timeout)
        self._owns_connection = connection is None
        self.redis: redis.Redis = (
            connection if connection is not None
            else connect(self.url, max_connections=max_connections, client_name=client_name))
        self.reader = ResultReader(self.redis, self.url, self._policy)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.reader.close()
        if self._owns_connection:
            self.redis.close()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() (any redis-py calls on `self.redis`), tried again through transient failures
        (see `RetryPolicy`) and with its errors translated, as the client's own calls are."""
        deadline, backoff = self._policy.deadline(), Backoff()
        while True:
            try:
                result = fn()
            except redis.RedisError as exc:
                time.sleep(self._retrying(exc, deadline, backoff))
                continue
            self._policy.reached = True
            return result

    def ping(self) -> None:
        """Return when the server answers; BrokerUnavailable (saying how to fix it) when not."""
        self.call(self.redis.ping)

    # --- submitting ------------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[Mapping[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        queue: str | None = None,
        **params: Any,
    ) -> str:
        """Queue one request and return its id; nothing is sent when it fails validation.

        Give exactly one of `prompt`, `messages` ([{"role", "content"}]) or `prompt_token_ids`;
        `params` are the other request fields (max_tokens, temperature, stop, metadata...).
        With `request_id`, submitting is idempotent: while the id is remembered (`request_ttl`),
        a second submit of it queues nothing and returns the same id, once it has checked that
        the entry the id is marked with can be this request (RequestIdConflict if it was
        deleted unread, expired, or the marker was set by someone else). Without one, the stream
        entry id becomes the request id.
        Raises InvalidRequest (message names the field), RequestIdConflict, BrokerUnavailable,
        BrokerError.
        """
        submission = self._submission(prompt, messages, prompt_token_ids, request_id, params)
        queue = self._queue(queue)
        self._ensure_group_once(queue)
        self._ensure_lane_groups(queue, [submission])

        def send() -> Any:
            return self.redis.fcall(*self._fcall_args(submission, queue))

        reply = self._submitting(send, queue)
        self._verify_markers(queue, [(submission, reply)])
        return self._submitted_id(submission, reply)

    def _verify_markers(self, queue: str, sent: Iterable[tuple[Submission, Any]]) -> None:
        """For submits that queued nothing because the id is marked: check, with one round trip,
        that the marked entry can be this request (RequestIdConflict if not)."""
        if not (marked := self._marked_elsewhere(queue, sent)):
            return

        def read() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_marker_checks(pipe, queue, marked)
            return pipe.execute(raise_on_error=False)

        self._check_markers(marked, self.call(read))

    def submit_many(self, requests: Iterable[Mapping[str, Any]], *,
                    queue: str | None = None) -> list[str]:
        """Queue many requests in one round trip; returns their ids in order.

        Each item is a request object with the wire's field names (`id`, not `request_id`), as
        in a JSONL file. All are validated first: one invalid item raises InvalidRequest naming
        its index, and nothing is sent.
        """
        submissions = self._submissions(requests)
        queue = self._queue(queue)
        self._ensure_group_once(queue)
        self._ensure_lane_groups(queue, submissions)

        def send() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for submission in submissions:
                pipe.fcall(*self._fcall_args(submission, queue))
            return pipe.execute()

        replies = self._submitting(send, queue)
        self._verify_markers(queue, zip(submissions, replies, strict=True))
        return [self._submitted_id(s, r) for s, r in zip(submissions, replies, strict=True)]

    def _submitting(self, send: Callable[[], T], queue: str) -> T:
        """send() through `call`, loading the function library once if the server lacks it."""
        while True:
            try:
                return self.call(send)
            except BrokerError as exc:
                failure = self._submit_failed(exc, queue)
                if failure is not None:
                    raise failure from None
                try:
                    self.call(lambda: ensure_functions(self.redis))
                except BrokerError as load_error:
                    logger.info("could not load the function library: %s", load_error)

    def ensure_group(self, queue: str | None = None) -> bool:
        """Create the queue's stream and consumer group `workers` if missing; True if created.

        The group starts at id 0, so requests queued before it existed are still delivered.
        """
        queue = self._queue(queue)
        def create() -> bool:
            pipe = self.redis.pipeline(transaction=False)
            queue_group_creation(pipe, self.keys, queue)
            return group_created(pipe.execute(raise_on_error=False), self.keys, queue)

        created = self.call(create)
        self._groups_ready.add(queue)
        return created

    def _ensure_lane_groups(self, queue: str, submissions: list[Submission]) -> None:
        if not (lanes := self._new_lanes(queue, submissions)):
            return

        def create() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_lane_groups(pipe, lanes)
            return pipe.execute(raise_on_error=False)

        self._lane_groups_made(lanes, self.call(create))

    def _ensure_group_once(self, queue: str) -> None:
        if queue not in self._groups_ready:
            self.ensure_group(queue)

    # --- reading results -------------------------------------------------------------------------

    def events(self, request_id: str, *, timeout: float | None = None) -> Iterator[Event]:
        """The request's events from the start of its result stream, as they arrive.

        Follows the attempt rule (see `Transcript`): events of superseded attempts are skipped;
        a `Start` whose attempt is higher than a previous one tells the reader to drop the text
        shown so far. Ends after the terminal event (`Done` or `Error`) of the current attempt.
        Raises ResultTimeout when `timeout` seconds pass first (None waits for ever); Redis
        outages meanwhile are waited out.
        """
        for followed in self.follow(request_id, timeout=timeout):
            yield followed.event

    def follow(self, request_id: str, *, timeout: float | None = None,
               after: str | None = None) -> Iterator[Followed]:
        """Like `events()`, with each event's result stream entry id, to resume from.

        `after`: an entry id this reader saw last; events up to it come marked `replayed`.
        """
        yield from self.reader.follow(ResultFollower(self.keys, request_id, timeout,
                                                     after=after))

    def follow_many(self, request_ids: Iterable[str] = ()) -> FollowerGroup:
        """Follow many requests at once; the group's `poll()` returns those that ended."""
        group = FollowerGroup(self.reader, self.keys)
        group.add(request_ids)
        return group

    def result(self, request_id: str, timeout: float | None = None) -> Done:
        """The `Done` event of the request (finish_reason stop, length or cancelled).

        Raises RequestFailed (with `.code` and `.message`) if it ended with an error, and
        ResultTimeout if nothing final arrived within `timeout` seconds.
        """
        for event in self.events(request_id, timeout=timeout):
            if isinstance(event, Done):
                return event
            if isinstance(event, Error):
                raise RequestFailed(event)
        raise AssertionError("events() ends only after a terminal event")

    def cancel(self, request_id: str, *, queue: str | None = None) -> None:
        """Ask the workers to stop the request; it ends with done(finish_reason="cancelled").

        Sets the cancel flag (checked when a worker admits the request, for `request_ttl`) and
        notifies the workers of `queue` that may be running it.
        """
        queue = self._queue(queue)

        # NOTE: two round trips, flag first: in a Cluster the two keys live on different nodes,
        # and a worker that read the notice before the flag landed would ignore it.
        def send(queue_writes: Callable[[Any], None]) -> None:
            pipe = self.redis.pipeline(transaction=False)
            queue_writes(pipe)
            pipe.execute()

        self.call(lambda: send(lambda pipe: self._set_cancel_flag(pipe, request_id)))
        self.call(lambda: send(lambda pipe: self._notify_cancel(pipe, request_id, queue)))

    # --- inspecting ------------------------------------------------------------------------------

    def stats(self, queue: str | None = None) -> QueueStats:
        """Length, lag, pending, dead letters and consumers of a queue."""
        queue = self._queue(queue)

        def read() -> QueueStats:
            pipe = self.redis.pipeline(transaction=False)
            self._queue_stats_reads(pipe, queue)
            return self._parse_stats(queue, pipe.execute(raise_on_error=False))

        return self.call(read)

    def lane_stats(self, queue: str | None = None) -> list[LaneStats]:
        """Backlog, pending and entries read of each lane stream of a queue (its own first)."""
        queue = self._queue(queue)

        def read() -> list[LaneStats]:
            names = replies.texts(self.redis.hkeys(self.keys.lanes(queue)), "HKEYS")
            lanes = queue_lanes(self.keys, queue, names)
            pipe = self.redis.pipeline(transaction=False)
            lane_stats_reads(pipe, lanes)
            return parse_lane_stats(lanes, pipe.execute(raise_on_error=False))

        return self.call(read)

    def queues(self) -> list[str]:
        """Names of the queues that have a consumer group."""
        return queue_names(self.call(lambda: self.redis.smembers(self.keys.queues())))

    def workers(self) -> list[WorkerHeartbeat]:
        """Live workers' latest heartbeats; expired ones are removed from the registry."""
        def read() -> list[WorkerHeartbeat]:
            worker_ids = [as_str(m) for m in self.redis.zrange(self.keys.workers(), 0, -1)]
            pipe = self.redis.pipeline(transaction=False)
            for worker_id in worker_ids:
                pipe.hgetall(self.keys.worker(worker_id))
            live, dead = parse_heartbeats(worker_ids, pipe.execute())
            if dead:
                self._forget_workers(dead)
            return live

        return self.call(read)

    def _forget_workers(self, dead: list[str]) -> None:
        # NOTE: a user that may only read the registry (the gateway) still sees the live ones.
        try:
            self.redis.zrem(self.keys.workers(), *dead)
        except redis.exceptions.NoPermissionError:
            pass

    def dead_letters(self, queue: str | None = None, *, count: int = 100) -> list[DeadLetterEntry]:
        """The oldest `count` dead letters of a queue."""
        queue = self._queue(queue)
        entries = self.call(lambda: self.redis.xrange(self.keys.dlq(queue), count=count))
        return parse_dead_letters(entries)

    def retry_dead_letter(self, dlq_entry_id: str, *, queue: str | None = None) -> str:
        """Queue a dead letter's original request again and drop it from the DLQ; the new entry id.

        The request keeps its id when its payload has one (else the new entry id is its id).
        """
        queue = self._queue(queue)
        entries = self.call(lambda: self.redis.xrange(self.keys.dlq(queue), dlq_entry_id,
                                                       dlq_entry_id))
        entry = dead_letter_to_retry(entries, dlq_entry_id, queue)
        old_result, fcall_args = self._retry_args(entry, queue)
        # NOTE: two steps, as the result stream lives in the request's slot and the rest in the
        # queue's. The old stream goes first: its failed attempts would otherwise hide the new
        # run's attempt 1. Should the function then fail, the dead letter stays to retry again.
        if old_result is not None:
            self.call(lambda: self.redis.delete(old_result))
        return as_str(self._submitting(
            lambda: self.redis.fcall(RETRY_FUNCTION, *fcall_args), queue))

    def purge_dead_letters(self, queue: str | None = None) -> int:
        """Delete every dead letter of a queue; how many there were."""
        queue = self._queue(queue)

        def purge() -> int:
            pipe = self.redis.pipeline(transaction=True)
            pipe.xlen(self.keys.dlq(queue))
            pipe.delete(self.keys.dlq(queue))
            return int(pipe.execute()[0])

        return self.call(purge)


# rq's own Redis, when it is not llmq's (gateway/batch_store.py reads it too)
RQ_URL_VAR = "LLMQ_RQ_REDIS_URL"


def client_for_rq_job(rq_connection: redis.Redis, *, prefix: str, queue: str) -> Client:
    """The llmq client of a job rq runs (a batch, a dataset job): with rq on a Redis of its own
    (RQ_URL_VAR), llmq's traffic goes to LLMQ_REDIS_URL (a cluster, say); otherwise both share
    rq's connection."""
    if os.environ.get(RQ_URL_VAR, "").strip():
        return Client(prefix=prefix, queue=queue)
    return Client(connection=rq_connection, prefix=prefix, queue=queue)
