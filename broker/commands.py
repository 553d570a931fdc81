"""The Redis commands behind the producer API, built and parsed without doing any IO.

The sync client (client.py) and the asyncio client (aio.py) differ only in how they send these;
what they send and how they read the replies lives here once. The worker uses it too: it creates
the consumer group with `queue_group_creation()` and writes result events with `queue_events()`,
exactly the way the producer expects to read them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import msgspec
from redis.exceptions import NoPermissionError
from redis.typing import EncodableT, FieldT

from llmq.broker import replies
from llmq.broker.keys import GROUP, Keys, is_valid_name
from llmq.broker.multiplex import parse_entry_id
from llmq.broker.replies import StreamEntry
from llmq.broker.transcript import Fold, Transcript
from llmq.broker.work_lanes import WorkLane, work_lane
from llmq.protocol import (
    DeadLetter,
    Encoding,
    Event,
    WorkerHeartbeat,
    as_str,
    decode_dead_letter,
    decode_event,
    decode_heartbeat,
    encode_event,
    parse_request,
)
from llmq.protocol.errors import (
    InvalidRequest,
    LLMQError,
    ProtocolError,
    RequestIdConflict,
    ResultTimeout,
    SchemaMismatch,
    StreamExhausted,
)
from llmq.protocol.requests import ENTRY_ID_RE

__all__ = [
    "CANCEL_STREAM_MAXLEN",
    "MARKER_CHECK_REPLIES",
    "DEFAULT_REQUEST_TTL",
    "Followed",
    "DeadLetterEntry",
    "QueueStats",
    "ResultFollower",
    "Submission",
    "as_fields",
    "as_str",
    "build_submission",
    "check_marker",
    "dead_letter_to_retry",
    "decode_result_entry",
    "exhausted_message",
    "group_created",
    "legacy_stream_message",
    "stream_exhausted",
    "parse_dead_letters",
    "parse_heartbeats",
    "parse_queue_stats",
    "queue_event",
    "queue_events",
    "queue_group_creation",
    "queue_marker_check",
    "queue_names",
]

logger = logging.getLogger(__name__)

# Replies `queue_marker_check` queues per request id.
MARKER_CHECK_REPLIES = 5

# How long the broker remembers a request id: the idempotency marker and the cancel flag.
DEFAULT_REQUEST_TTL = 24 * 3600
CANCEL_STREAM_MAXLEN = 10_000  # workers follow it live; older entries only matter via the flag

_encoders: dict[str, msgspec.json.Encoder | msgspec.msgpack.Encoder] = {
    "json": msgspec.json.Encoder(), "msgpack": msgspec.msgpack.Encoder()}


@dataclass(frozen=True)
class Submission:
    """A validated request, ready to send."""

    request_id: str | None  # None: the entry id will be the request id
    encoding: Encoding
    payload: bytes
    lane: Literal["interactive", "batch"] | None = None  # the request's `lane` field


def build_submission(params: Mapping[str, Any], encoding: Encoding = "json") -> Submission:
    """Validate a request object (wire field names) exactly as a worker will; InvalidRequest if not.

    Keys whose value is None are dropped, so Python callers can pass "unset" for any field.
    """
    body = {k: v for k, v in params.items() if v is not None}
    try:
        payload = _encoders[encoding].encode(body)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise InvalidRequest(f"request cannot be encoded as {encoding}: {exc}") from None
    # NOTE: the worker's own decoder, on the very bytes that will be sent: what passes here
    # passes there (the worker adds only model-specific checks such as the context length).
    request = parse_request(payload, encoding)
    return Submission(request.id, encoding, payload, request.lane)


def decode_result_entry(request_id: str, entry_id: str, fields: replies.Fields) -> Event | None:
    """The event of one result stream entry; None (logged) for an entry this reader cannot read."""
    try:
        return decode_event(fields)
    except ProtocolError as exc:
        # NOTE: skipped, not raised: a newer worker may write event types this reader predates.
        logger.warning("skipping entry %r of request %s: %s", entry_id, request_id, exc)
        return None


class Followed(NamedTuple):
    """One event a follower should see, with the result stream entry that carried it."""

    entry_id: str
    event: Event
    fold: Fold  # ACCEPTED, or RESTARTED: a newer attempt began, drop the text shown so far
    replayed: bool  # at or before the `after` entry: already seen by whoever resumes


class ResultFollower:
    """Following one request's result stream, without IO: the client's reader feeds it entries.

        follower = ResultFollower(keys, request_id, timeout)
        while not follower.finished:
            entries = <the stream's next entries>          # or ResultTimeout at .deadline
            for followed in follower.feed(entries):
                ...

    Events are folded by the attempt rule (`Transcript`); only those the reader should see are
    returned, up to and including the terminal event of the current attempt. Resuming `after` an
    entry id folds the stream from its start, so the attempt rule holds exactly, and marks what
    comes up to that entry as `replayed`.
    """

    def __init__(self, keys: Keys, request_id: str, timeout: float | None, *,
                 after: str | None = None) -> None:
        self.request_id = request_id
        self.transcript = Transcript(request_id)
        self.key = keys.result(request_id)
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._after = None if after is None else parse_entry_id(after)

    @property
    def finished(self) -> bool:
        return self.transcript.finished

    def remaining(self) -> float | None:
        """Seconds left before the timeout (None: no timeout); ResultTimeout once it passed."""
        if self.deadline is None:
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ResultTimeout(self.request_id, self.timeout or 0.0)
        return remaining

    def feed(self, entries: Iterable[StreamEntry]) -> list[Followed]:
        """The events of these entries the reader should see; stops after the terminal one."""
        out: list[Followed] = []
        for entry_id, fields in entries:
            event = decode_result_entry(self.request_id, entry_id, fields)
            if event is None:
                continue
            fold = self.transcript.apply(event)
            if fold is Fold.IGNORED:
                continue
            replayed = self._after is not None and parse_entry_id(entry_id) <= self._after
            out.append(Followed(entry_id, event, fold, replayed))
            if self.transcript.finished:
                break
        return out


def as_fields(mapping: Mapping[str, bytes | str | int | float]) -> dict[FieldT, EncodableT]:
    """`mapping` as redis-py's XADD and HSET take an entry's or a hash's fields: a new dict,
    typed as their dict of any encodable names and values (a dict is invariant, so to a type
    checker a dict[str, bytes] is no such dict)."""
    return dict(mapping.items())


def queue_event(pipe: Any, keys: Keys, event: Event, encoding: Encoding, *,
                result_ttl: int, result_maxlen: int) -> None:
    """`queue_events` for one event."""
    queue_events(pipe, keys, [(event, encoding)], result_ttl=result_ttl,
                 result_maxlen=result_maxlen)


def queue_events(pipe: Any, keys: Keys, events: Iterable[tuple[Event, Encoding]], *,
                 result_ttl: int, result_maxlen: int) -> None:
    """Queue events' writes on a (sync or asyncio) pipeline: XADD capped, in order, then one
    EXPIRE per result stream touched.

    EXPIRE after every write makes a stream live `result_ttl` after its last event, and lets one
    that no worker ever finishes expire too.
    """
    touched: dict[str, None] = {}
    for event, encoding in events:
        key = keys.result(event.request_id)
        pipe.xadd(key, encode_event(event, encoding), maxlen=result_maxlen, approximate=True)
        touched[key] = None
    for key in touched:
        pipe.expire(key, result_ttl)


def queue_marker_check(pipe: Any, keys: Keys, queue: str, request_id: str,
                       entry_id: str, lane: WorkLane | None = None) -> None:
    """Queue the reads `check_marker` needs, for a submit the script answered "already marked
    as `entry_id`". Execute with raise_on_error=False. None of them reads a payload: a producer
    may not read the request stream.

    The submission record is read first: it lives from the submit until the worker's ack, so an
    entry that is neither recorded nor pending nor answered when the later reads run was never
    queued by the submit function, or is gone. `lane`: the stream it was submitted to (the
    queue's own by default)."""
    lane = lane or work_lane(keys, queue)
    pipe.hexists(lane.submissions, entry_id)
    pipe.time()
    pipe.xlen(keys.result(request_id))  # NOTE: XLEN, the result readers' right (not EXISTS)
    pipe.xpending_range(lane.stream, GROUP, min=entry_id, max=entry_id, count=1)
    pipe.xinfo_groups(lane.stream)


def check_marker(request_id: str, entry_id: str, marker_replies: Sequence[object] | None
                 ) -> None:
    """RequestIdConflict when the entry a request id's marker names cannot be this request:
    the marker is no entry id, names an entry from the future, one that was delivered, is not
    running and left no result (trimmed or deleted, its result expired, or the marker was set by
    someone else), or one not delivered yet that the submit function never recorded (nothing
    is queued: the marker was set by hand). Otherwise the request is running, finished or still
    queued.

    `marker_replies` are `queue_marker_check`'s (None: there is no entry id to check). A read
    this user may not make (NOPERM, an older ACL) leaves the answer open: no error then."""
    if marker_replies is None or not ENTRY_ID_RE.fullmatch(entry_id):
        raise RequestIdConflict(
            f"request id {request_id!r} is marked as submitted, but its marker holds "
            f"{entry_id[:40]!r}, which is no entry id: someone else set it; use another id")
    recorded, now, has_result, pending, groups = marker_replies
    if any(isinstance(r, Exception) for r in marker_replies):
        logger.debug("cannot check the marker of %s: %s", request_id, marker_replies)
        return
    if replies.integer(has_result, "XLEN") or replies.pending_entries(pending):
        return  # finished, or running
    marked = parse_entry_id(entry_id)
    if marked[0] > replies.server_time_ms(now) + 1000:
        raise RequestIdConflict(
            f"request id {request_id!r} is marked as entry {entry_id}, which is in the future: "
            "someone else set the marker; use another id")
    for group in replies.groups(groups):
        if group.name == GROUP:
            delivered = marked <= parse_entry_id(group.last_delivered_id)
            break
    else:
        delivered = False  # no group yet: nothing was delivered
    if not delivered and replies.integer(recorded, "HEXISTS"):
        return  # not read yet: it waits in the queue
    if not delivered:
        raise RequestIdConflict(
            f"request id {request_id!r} is marked as submitted (entry {entry_id}), but no such "
            "entry waits in the queue: the submit function never queued it (someone set the "
            "marker by hand) or it was trimmed or deleted unread. Submitting again would queue "
            "nothing: use another id")
    raise RequestIdConflict(
        f"request id {request_id!r} is marked as submitted (entry {entry_id}), but that entry "
        "was delivered, is not running and left no result: it was trimmed or deleted, its "
        "result expired, or someone else set the marker. Submitting again would queue nothing: "
        "use another id")


def queue_group_creation(pipe: Any, keys: Keys, queue: str) -> None:
    """Queue what creates a queue's stream and consumer group `workers` if missing: XGROUP
    CREATE ... MKSTREAM at id 0 (so requests queued before the group are delivered), and the
    queue's name in the registry `llmq status` lists; and a look for the queue's version-1
    stream. Execute with raise_on_error=False and read the replies with `group_created`."""
    pipe.xgroup_create(keys.queue(queue), GROUP, id="0", mkstream=True)
    pipe.sadd(keys.queues(), queue)
    pipe.exists(keys.legacy_queue(queue))
    pipe.xinfo_stream(keys.queue(queue))


def group_created(creation_replies: Sequence[object], keys: Keys, queue: str) -> bool:
    """True when `queue_group_creation` created the group, False when it existed (BUSYGROUP);
    SchemaMismatch beside a v1 stream, StreamExhausted on a stream at the last entry id; any
    other error is raised."""
    created, registered, legacy, info = creation_replies
    if isinstance(created, Exception) and "BUSYGROUP" not in str(created):
        raise created
    # NOTE: only workers register queues (a producer's credential may not: one bad name there
    # would break every reader's list); a NOPERM here is how producers and tenants find it.
    if isinstance(registered, Exception) and not isinstance(registered, NoPermissionError):
        raise registered
    # NOTE: a look at the v1 name this user may not take (NOPERM) finds nothing.
    if not isinstance(legacy, Exception) and replies.integer(legacy, "EXISTS"):
        raise SchemaMismatch(legacy_stream_message(keys, queue))
    if not isinstance(info, Exception) and stream_exhausted(info):
        raise StreamExhausted(exhausted_message(keys, queue))
    return not isinstance(created, Exception)


# The most queue names a registry read returns: more than any pool has, few enough that a
# registry someone flooded cannot stall a cancel or a dashboard view.
MAX_QUEUES = 256


def queue_names(members: object) -> list[str]:
    """The valid queue names of an SMEMBERS reply of the queue registry, sorted, at most
    MAX_QUEUES: a name that could not be written by llmq (someone else's SADD) is skipped and
    logged, never allowed to fail every reader of the list."""
    names = replies.texts(members, "SMEMBERS")
    valid = sorted(n for n in names if is_valid_name(n))
    if len(valid) < len(names):
        logger.warning("skipping %d invalid name(s) in the queue registry", len(names) - len(valid))
    if len(valid) > MAX_QUEUES:
        logger.warning("the queue registry holds %d names; using the first %d", len(valid),
                       MAX_QUEUES)
    return valid[:MAX_QUEUES]


def legacy_stream_message(keys: Keys, queue: str) -> str:
    return (f"found {keys.legacy_queue(queue)}, a request stream of key schema v1; this llmq "
            f"uses schema v2, where queue {queue!r} is {keys.queue(queue)} (Cluster hash tags "
            "in every key, see docs/protocol.md). Let the old workers drain it, then delete it "
            f"(`DEL {keys.legacy_queue(queue)}`), or re-add its entries to the new name; "
            "producers must write to the new name too")


# The last id a stream can take: an XADD with `*` after it can only fail.
LAST_ENTRY_ID = "18446744073709551615-18446744073709551615"


def stream_exhausted(info: object) -> bool:
    """Whether XINFO STREAM's reply shows a stream whose last id is the last possible one."""
    return replies.last_generated_id(info) == LAST_ENTRY_ID


def exhausted_message(keys: Keys, queue: str) -> str:
    key = keys.queue(queue)
    return (f"{key} reached the last possible entry id ({LAST_ENTRY_ID}: someone XADDed that "
            "id by hand), so no request can be added to it any more. Fix: let the workers "
            f"finish what is pending (`llmq status`), then `DEL {key}`: the next worker or "
            "producer creates it again; and take XADD away from whoever wrote that id "
            "(docs/operations.md, producer credentials)")


@dataclass(frozen=True)
class QueueStats:
    queue: str
    length: int  # entries in the request stream (unread + pending, plus acked ones not deleted)
    lag: int | None  # entries no worker has read yet; None when Redis cannot tell (after XDEL)
    pending: int  # read by a worker and not yet acked: running, or waiting to be reclaimed
    dead_letters: int
    consumers: int  # consumers the group knows, live or not (see `Client.workers()` for live)
    group_exists: bool
    exhausted: bool = False  # the stream reached the last possible entry id: XADD fails
    # Entries trimmed before any worker read them, as the workers reported (None: this user may
    # not read it); worker/unread_loss.py
    lost_unread: int | None = 0


def parse_queue_stats(queue: str, length: object, groups: object, dead_letters: object,
                      info: object = None, lost: object = None) -> QueueStats:
    """QueueStats from XLEN, XINFO GROUPS (its reply or its ResponseError), the DLQ's XLEN,
    XINFO STREAM and GET of the lost-unread count (each its reply, or an error when the key is
    missing or the user may not)."""
    exhausted = not isinstance(info, Exception | None) and stream_exhausted(info)
    lost_text = None if isinstance(lost, Exception) else replies.optional_text(lost, "GET")
    lost_unread = (None if isinstance(lost, Exception)
                   else int(lost_text) if lost_text and lost_text.isdigit() else 0)
    num_entries = replies.integer(length, "XLEN")
    num_dead = replies.integer(dead_letters, "XLEN")
    if isinstance(groups, Exception):
        if "no such key" not in str(groups).lower():
            raise groups
        groups = []
    for group in replies.groups(groups):
        if group.name == GROUP:
            return QueueStats(queue, num_entries, group.lag, group.pending, num_dead,
                              group.consumers, True, exhausted, lost_unread)
    # NOTE: without a group every entry is unread, so the lag is the length.
    return QueueStats(queue, num_entries, num_entries, 0, num_dead, 0, False, exhausted,
                      lost_unread)


@dataclass(frozen=True)
class DeadLetterEntry:
    dlq_entry_id: str  # the entry's id on the dead-letter stream
    dead_letter: DeadLetter  # why it was dead-lettered
    payload: dict[str, bytes]  # the original request fields ({} when not kept)


def parse_dead_letters(reply: object) -> list[DeadLetterEntry]:
    """DLQ entries from an XRANGE reply; ProtocolError for an entry that is not a dead letter."""
    parsed = []
    for entry_id, fields in replies.entries(reply, "XRANGE"):
        dead_letter, payload = decode_dead_letter(fields)
        parsed.append(DeadLetterEntry(entry_id, dead_letter, payload))
    return parsed


def dead_letter_to_retry(reply: object, dlq_entry_id: str, queue: str) -> DeadLetterEntry:
    """The one dead letter an XRANGE from and to `dlq_entry_id` found, for a retry; LLMQError
    when missing or without payload."""
    found = parse_dead_letters(reply)
    if not found:
        raise LLMQError(f"no dead letter {dlq_entry_id} in queue {queue}")
    (entry,) = found
    if not entry.payload:
        raise LLMQError(f"dead letter {dlq_entry_id} kept no payload to retry "
                        f"({entry.dead_letter.code}: {entry.dead_letter.message})")
    return entry


def parse_heartbeats(worker_ids: list[str], hashes: Sequence[object]
                     ) -> tuple[list[WorkerHeartbeat], list[str]]:
    """(live heartbeats, ids whose hash has expired) from the registry and HGETALL replies."""
    live, dead = [], []
    for worker_id, reply in zip(worker_ids, hashes, strict=True):
        fields = replies.string_hash(reply)
        if not fields:
            dead.append(worker_id)
            continue
        try:
            live.append(decode_heartbeat(fields))
        except ProtocolError as exc:
            logger.warning("skipping the heartbeat of worker %s: %s", worker_id, exc)
    return live, dead
