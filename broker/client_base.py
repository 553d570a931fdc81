"""ClientBase: what the sync `Client` and the asyncio `AsyncClient` share, without IO.

Settings and key names, request building and validation, the retry policy, and the arguments
and reply handling of every command both clients send (submit through the function library,
cancel, queue stats, dead-letter retry, the id-marker checks). Each client subclasses it and adds
only the IO: `llmq.broker.client.Client` on redis-py, `llmq.broker.aio.AsyncClient` on
redis.asyncio. The commands themselves are built and parsed in `llmq.broker.commands`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from redis.exceptions import NoPermissionError

from llmq.broker.commands import (
    CANCEL_STREAM_MAXLEN,
    MARKER_CHECK_REPLIES,
    DeadLetterEntry,
    QueueStats,
    Submission,
    as_str,
    build_submission,
    check_marker,
    exhausted_message,
    parse_queue_stats,
    queue_marker_check,
)
from llmq.broker.connection import describe_connection, resolve_redis_url, translate
from llmq.broker.functions import (
    SUBMIT_FUNCTION,
    SUBMIT_LANE_FUNCTION,
    is_missing_function,
    submit_error,
)
from llmq.broker.keys import GROUP, NAME_PATTERN, Keys, is_valid_name, validate_name
from llmq.broker.retry import Backoff, RetryPolicy
from llmq.broker.settings import BrokerSettings
from llmq.broker.tracing import submit_traceparent
from llmq.broker.work_lanes import WorkLane, lane_for_request
from llmq.protocol import Encoding, encode_cancel
from llmq.protocol.errors import InvalidRequest
from llmq.protocol.requests import ENTRY_ID_RE

__all__ = ["ClientBase"]

logger = logging.getLogger(__name__)


class ClientBase:
    """What the sync and asyncio clients share: settings, keys, and request building."""

    def _configure(self, redis_url: str | None, queue: str | None, prefix: str | None,
                   encoding: Encoding, request_ttl: int, settings: BrokerSettings | None,
                   connection: Any, retry_timeout: float | None) -> None:
        overrides: dict[str, Any] = {k: v for k, v in
                     {"redis_url": redis_url, "queue": queue, "prefix": prefix}.items()
                     if v is not None}
        self.settings = (replace(settings, **overrides) if settings is not None
                         else BrokerSettings.from_env(**overrides))
        if encoding not in ("json", "msgpack"):
            raise ValueError(f"encoding must be 'json' or 'msgpack', got {encoding!r}")
        if request_ttl < 1:
            raise ValueError(f"request_ttl must be >= 1 second, got {request_ttl}")
        self.keys: Keys = self.settings.keys
        self.encoding: Encoding = encoding
        self.request_ttl = request_ttl
        self.url = (describe_connection(connection) if connection is not None
                    else resolve_redis_url(self.settings.redis_url))
        self._groups_ready: set[str] = set()
        self._functions_tried = False  # loaded the function library after a "not found"
        self._policy = RetryPolicy(retry_timeout)

    def _retrying(self, exc: Exception, deadline: float | None, backoff: Backoff) -> float:
        """The delay before trying a failed call again; raises the translated error if none."""
        if not self._policy.should_retry(exc, deadline):
            raise (translate(exc, self.url) or exc) from None
        delay = backoff.delay()
        logger.warning("Redis at %s: %s; retrying in %.2fs", self.url, exc, delay)
        return delay

    def _queue(self, queue: str | None) -> str:
        return validate_name("queue", queue or self.settings.queue)

    def _submission(self, prompt: str | None, messages: Any, prompt_token_ids: Any,
                    request_id: str | None, params: Mapping[str, Any]) -> Submission:
        if "id" in params:
            raise InvalidRequest("pass the request id as `request_id=`")
        if request_id is not None and not is_valid_name(request_id):
            raise InvalidRequest(f"invalid request_id {request_id!r:.60}: must match "
                                 f"{NAME_PATTERN}")
        body = {"id": request_id, "prompt": prompt, "messages": messages,
                "prompt_token_ids": prompt_token_ids, **params}
        if (traceparent := submit_traceparent(request_id, params)) is not None:
            body["traceparent"] = traceparent
        return build_submission(body, self.encoding)

    def _submissions(self, requests: Iterable[Mapping[str, Any]]) -> list[Submission]:
        """Every request of a batch validated before any is sent; InvalidRequest names the index."""
        submissions = []
        for index, body in enumerate(requests):
            if (traceparent := submit_traceparent(body.get("id"), body)) is not None:
                body = {**body, "traceparent": traceparent}
            try:
                submissions.append(build_submission(body, self.encoding))
            except InvalidRequest as exc:
                raise InvalidRequest(f"request {index}: {exc}") from None
        return submissions

    def _set_cancel_flag(self, pipe: Any, request_id: str) -> None:
        """Queue a cancel's first write: the flag, which only the request's owner may set and
        without which no worker aborts it (worker/cancel_listener.py)."""
        pipe.set(self.keys.cancel_flag(request_id), b"1", ex=self.request_ttl)

    def _notify_cancel(self, pipe: Any, request_id: str, queue: str) -> None:
        """Queue a cancel's second write, once the flag is set: the notice workers follow."""
        pipe.xadd(self.keys.cancel(queue), encode_cancel(request_id),
                  maxlen=CANCEL_STREAM_MAXLEN, approximate=True)

    def _queue_stats_reads(self, pipe: Any, queue: str) -> None:
        """Queue the reads `_parse_stats` expects; execute them with raise_on_error=False."""
        pipe.xlen(self.keys.queue(queue))
        pipe.xinfo_groups(self.keys.queue(queue))
        pipe.xlen(self.keys.dlq(queue))
        pipe.xinfo_stream(self.keys.queue(queue))
        pipe.get(self.keys.lost_unread(queue))

    @staticmethod
    def _parse_stats(queue: str, replies: list[Any]) -> QueueStats:
        length, groups, dead, info, lost = replies
        for reply in (length, dead):
            if isinstance(reply, Exception):
                raise reply
        return parse_queue_stats(queue, length, groups, dead, info, lost)

    def _retry_args(self, entry: DeadLetterEntry, queue: str) -> tuple[str | None, list[Any]]:
        """(old result stream to delete first or None, FCALL llmq_retry's numkeys, keys and
        args: broker/functions.py)."""
        keys = [self.keys.queue(queue), self.keys.dlq(queue), self.keys.submissions(queue)]
        request_id = entry.dead_letter.request_id
        old_result = None
        # NOTE: only a producer-given id outlives its entry; a default id (the old entry id)
        # gives way to the new entry's id, and the old result stream stays as it was.
        if request_id and request_id != entry.dead_letter.entry_id:
            keys.append(self.keys.idempotency(queue, request_id))
            old_result = self.keys.result(request_id)
        else:
            request_id = ""
        fields = [x for pair in entry.payload.items() for x in pair]
        return old_result, [len(keys), *keys, entry.dlq_entry_id, self.request_ttl, request_id,
                            *fields]

    def _lane(self, submission: Submission, queue: str) -> WorkLane:
        """The stream a submission goes to: its `lane` (interactive unless it says batch), and
        the tenant its id names (broker/work_lanes.py)."""
        return lane_for_request(self.keys, queue, submission.lane, submission.request_id)

    def _new_lanes(self, queue: str, submissions: Iterable[Submission]) -> list[WorkLane]:
        """The lane streams of `submissions` whose consumer group this client has not made
        sure of yet (the queue's own stream has `ensure_group`)."""
        lanes = {lane.stream: lane for s in submissions
                 if not (lane := self._lane(s, queue)).is_queue_stream
                 and lane.stream not in self._groups_ready}
        return list(lanes.values())

    @staticmethod
    def _queue_lane_groups(pipe: Any, lanes: list[WorkLane]) -> None:
        """Queue XGROUP CREATE (at id 0, MKSTREAM) of each lane: like the queue's, made by
        producers too, so lag counts their entries before any worker ran (KEDA)."""
        for lane in lanes:
            pipe.xgroup_create(lane.stream, GROUP, id="0", mkstream=True)

    def _lane_groups_made(self, lanes: list[WorkLane], results: list[Any]) -> None:
        for lane, result in zip(lanes, results, strict=True):
            if isinstance(result, NoPermissionError):
                continue  # another tenant's lane: the submit itself is refused, and says so
            if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
                raise translate(result, self.url) or result
            self._groups_ready.add(lane.stream)

    def _fcall_args(self, submission: Submission, queue: str) -> list[Any]:
        """FCALL's function, then its arguments: numkeys, keys, then args (broker/functions.py):
        llmq_submit for the queue's own stream, llmq_submit_lane for a lane stream."""
        lane = self._lane(submission, queue)
        keys = [lane.stream, lane.submissions]
        if not lane.is_queue_stream:
            keys.append(self.keys.lanes(queue))
        args: list[Any] = [submission.encoding, submission.payload]
        if submission.request_id is not None:
            keys.append(self.keys.idempotency(queue, submission.request_id))
            args += [self.request_ttl, submission.request_id]
        function = SUBMIT_FUNCTION if lane.is_queue_stream else SUBMIT_LANE_FUNCTION
        return [function, len(keys), *keys, *args]

    def _marked_elsewhere(self, queue: str, sent: Iterable[tuple[Submission, Any]]
                          ) -> list[tuple[str, str, WorkLane]]:
        """(request id, entry id its marker names, the lane it was sent to) of the submits the
        script did not queue."""
        return [(submission.request_id, as_str(reply[1]), self._lane(submission, queue))
                for submission, reply in sent
                if submission.request_id is not None and not int(reply[0])]

    def _queue_marker_checks(self, pipe: Any, queue: str,
                             marked: list[tuple[str, str, WorkLane]]) -> None:
        for request_id, entry_id, lane in marked:
            if ENTRY_ID_RE.fullmatch(entry_id):
                queue_marker_check(pipe, self.keys, queue, request_id, entry_id, lane)

    @staticmethod
    def _check_markers(marked: list[tuple[str, str, WorkLane]], replies: list[Any]) -> None:
        """RequestIdConflict for the first marker that cannot be its request's (see
        `commands.check_marker`): raised rather than pretend the request is queued."""
        at = 0
        for request_id, entry_id, _ in marked:
            if not ENTRY_ID_RE.fullmatch(entry_id):
                check_marker(request_id, entry_id, None)
            check_marker(request_id, entry_id, replies[at:at + MARKER_CHECK_REPLIES])
            at += MARKER_CHECK_REPLIES

    @staticmethod
    def _submitted_id(submission: Submission, reply: Any) -> str:
        """The request id, from the submit function's reply {queued, entry id}."""
        if submission.request_id is None:
            return as_str(reply[1])
        if not int(reply[0]):
            logger.debug("request %s was already submitted; not queued again",
                         submission.request_id)
        return submission.request_id

    def _submit_failed(self, exc: Exception, queue: str) -> Exception | None:
        """The producer's error for a refused submit; None when loading the library may cure
        it (the caller then loads it and tries once more)."""
        if is_missing_function(exc) and not self._functions_tried:
            self._functions_tried = True
            return None
        # NOTE: anything else (NOPERM: another tenant's id, a refused write) is the error.
        return submit_error(exc, self.keys.queue(queue),
                            exhausted_message(self.keys, queue)) or exc
