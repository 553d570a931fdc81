"""Admission: stream entries this worker now owns -> requests in the engine, or a final answer.

Shared by the stream reader (new entries, attempt 1) and the lease keeper (entries reclaimed
from a dead peer, attempt = delivery count), after vLLM v1's input thread, which decodes and
validates off the busy loop. Per entry, in order:

1. record it in the in-flight table (from here on the lease keeper renews it, and a cancel that
   arrives while it is being admitted is not lost); past `max_deliveries` (it keeps killing
   workers) it goes to the dead-letter stream with `error{poison}`;
2. decode with the broker's decoder, which never raises: an entry with a usable request id of its
   own gets `error{invalid_request}` on its result stream; one without (none given, or none
   readable) gets it on llmq:r:{<entry id>} and goes to the dead-letter stream too;
3. deadline: `deadline_ms` counts from the entry id's millisecond time, compared with Redis
   `TIME` (the server's clock, never the producer's or this worker's: docs/reliability.md,
   scenario 27);
4. ownership of the request id: `SET llmq:id:{<queue>}:<request_id> <entry id> NX GET` (the
   marker the producer's submit function sets, or the first worker to admit an entry of that
   id): an entry whose id another entry owns is a duplicate, dead-lettered as `duplicate_id` and
   answered on llmq:r:{<its entry id>}, never on the first run's stream. A tenant's id
   (`<tenant>:<id>`) is never claimed here: it runs only if its marker already names this entry
   (the tenant's own submit function queued it), so a foreign XADD can neither hijack nor block
   it; then the cancel flag `llmq:x:{<request_id>}` (a cancel sent before a worker read the
   request);
5. tokenize and check against the model (InputProcessor): `error{code}` without running;
6. with cache affinity on, a first delivery whose prefix a peer's cache holds deeper than this
   worker's is handed to that peer instead (worker/affinity_keeper.py): no event, no ack, the
   entry pending under the peer now, on the stream it was read from (the queue's or its lane's);
7. `start` event (attempt, worker, prompt_tokens), then hand the request to the busy loop.

Steps 2-5 end the entry with one terminal event and an XACK, written by the result writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import redis

from llmq import protocol
from llmq.broker import replies
from llmq.broker.keys import tenant_of
from llmq.broker.redis_url import cluster_client
from llmq.broker.replies import Fields, StreamEntry
from llmq.broker.work_lanes import BATCH, LANE_SEQ_BASE, WorkLane
from llmq.protocol.errors import ErrorCode, RequestRejected
from llmq.worker.backoff import TRANSIENT_ERRORS, Backoff
from llmq.worker.engine.input_processor import InputProcessor, ProcessedInput
from llmq.worker.inbox import AddRequest
from llmq.worker.inflight_table import InFlight
from llmq.worker.result_writer import EntryWrite, ResultWriter
from llmq.worker.worker_context import WorkerContext

if TYPE_CHECKING:
    from llmq.worker.affinity_keeper import AffinityKeeper
    from llmq.worker.affinity_router import Route

logger = logging.getLogger(__name__)

Decoded = protocol.DecodedRequest | protocol.RejectedEntry  # what the broker's decoder made of it


class _Diverted(NamedTuple):
    """An entry admission would hand to `peer`, and what it needs to start it here after all."""
    entry: InFlight
    processed: ProcessedInput
    now_ms: int
    waited_ms: int
    route: Route
    batch: bool
    lane: WorkLane | None  # the lane stream it is on (None: the queue's own)


class Admission:
    """`processor` is the engine's gate; `clock` the engine's clock, which arrival times use."""

    def __init__(self, ctx: WorkerContext, processor: InputProcessor, writer: ResultWriter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self.keys = ctx.keys
        self.table = ctx.table
        self.processor = processor
        self.writer = writer
        self.max_deliveries = ctx.config.max_deliveries
        self.clock = clock
        self.affinity: AffinityKeeper | None = None  # set by the worker when affinity is on
        # Called once an interactive request is in the inbox: the engine's running step gives
        # way to it (worker/engine/step_interrupt.py); set by the worker.
        self.on_interactive: Callable[[], None] | None = None

    def admit(self, client: redis.Redis, entries: list[StreamEntry], backoff: Backoff,
              attempts: dict[str, int] | None = None,
              forgiven: dict[str, int] | None = None, solo: set[str] | None = None,
              divert: bool = True, lanes: Mapping[str, WorkLane] | None = None) -> int:
        """Admit entries this worker owns (in its PEL). Returns how many were new to it.

        `attempts`: delivery counts of reclaimed entries (default 1); `forgiven`: their
        drain hand-backs; `solo`: the suspects among them, which run alone; `lanes`: the lane
        stream each came from (default the queue's own stream). `divert=False`: never hand one
        to a peer for its cache (the entries came from a peer's tickets).

        Makes one round trip (TIME, cancel flags, id ownership), retried through `backoff` while
        Redis is away; if the worker stops meanwhile the entries stay in the table and are
        handed back.
        """
        fresh: list[tuple[InFlight, Decoded, Fields]] = []
        for entry_id, fields in entries:
            attempt = (attempts or {}).get(entry_id, 1)
            decoded = protocol.decode_request_entry(entry_id, fields)
            entry = _entry_for(decoded, attempt)
            entry.forgiven = (forgiven or {}).get(entry_id, 0)
            entry.solo = entry_id in (solo or ())
            entry.lane = (lanes or {}).get(entry_id)
            if not self.table.add(entry):
                # Already ours and running: XAUTOCLAIM handed back our own entry after a stall.
                continue
            fresh.append((entry, decoded, fields))
        if not fresh:
            return 0
        # NOTE: an entry that does not fit its stream claims no marker and reads no flag.
        foreign = {e.entry_id: why for e, _, _ in fresh if (why := _off_its_lane(e))}
        flagged = [e for e, d, _ in fresh if isinstance(d, protocol.DecodedRequest)
                   and e.entry_id not in foreign]
        # NOTE: an id-less request's id is its entry id, which no other entry may name. A
        # rejected entry that names a tenant's id (an oversized payload, say) is answered on
        # that id's stream only when the tenant's submit function marked it for this entry.
        named = [e for e in flagged if e.request_id != e.entry_id] + [
            e for e, d, _ in fresh if isinstance(d, protocol.RejectedEntry)
            and d.request_id not in (None, e.entry_id) and tenant_of(e.request_id)
            and e.entry_id not in foreign]
        while True:
            try:
                now_ms, flags, owners = self._read_time_flags_and_markers(client, flagged, named)
                backoff.succeeded()
                break
            except TRANSIENT_ERRORS as e:
                if backoff.stop is not None and backoff.stop.is_set():
                    return len(fresh)
                backoff.failed(e)
            except Exception:
                # NOTE: Redis refused (BUSY, MASTERDOWN, NOPERM...): forget the entries, or the
                # lease keeper would renew them for ever without running them. They stay
                # pending under this worker and are reclaimed after the lease.
                for entry, _, _ in fresh:
                    self.table.pop(entry.entry_id)
                raise
        if self.ctx.spans is not None:
            for entry, decoded, _ in fresh:
                entry.trace = self.ctx.spans.read(decoded, now_ms)
        cancel_flags = {e.entry_id: flag for e, flag in zip(flagged, flags, strict=True)}
        # The entry that owns each id, when another one does ("" for a tenant's unmarked id).
        taken = {e.entry_id: owner or "" for e, owner in zip(named, owners, strict=True)
                 if (owner is not None or tenant_of(e.request_id)) and owner != e.entry_id}
        return self._admit_all(fresh, now_ms, cancel_flags, taken, foreign, backoff,
                               client if divert and self.affinity is not None else None)

    def _admit_all(self, fresh: list[tuple[InFlight, Decoded, Fields]], now_ms: int,
                   cancel_flags: dict[str, bool], taken: dict[str, str],
                   foreign: dict[str, str], backoff: Backoff,
                   divert_via: redis.Redis | None) -> int:
        """`divert_via`: the connection to hand entries to peers with (None: run them all)."""
        adds: list[AddRequest] = []
        diverted: dict[str, _Diverted] | None = {} if divert_via is not None else None
        for entry, decoded, fields in fresh:
            if entry.fenced:
                self.table.pop(entry.entry_id)  # a peer took it while we waited for Redis
                continue
            try:
                if entry.entry_id in foreign:
                    self._off_lane(entry, foreign[entry.entry_id], fields)
                    continue
                if entry.entry_id in taken:
                    self._duplicate(entry, taken[entry.entry_id], fields)
                    continue
                add = self._admit_one(entry, decoded, fields, now_ms,
                                      cancel_flags.get(entry.entry_id, False), diverted)
            except Exception:  # noqa: BLE001 - one bad request must never stop admission
                logger.exception("admitting entry %s failed", entry.entry_id)
                self._fail(entry, ErrorCode.ENGINE_ERROR,
                           "the worker failed to admit this request")
                continue
            if add is not None:
                adds.append(add)
        if diverted and divert_via is not None:
            adds += self._hand_over(divert_via, diverted, backoff)
        if adds:
            # NOTE: one inbox item per read, so the engine's next step sees the whole read
            # (prefills batched together, as if the requests had been added in-process).
            self.ctx.inbox.put(adds)
            if self.on_interactive is not None and not all(add.batch for add in adds):
                self.on_interactive()  # NOTE: after the put, so the busy loop finds it
        return len(fresh)

    def _admit_one(self, entry: InFlight, decoded: Decoded, fields: Fields, now_ms: int,
                   cancel_flag: bool, diverted: dict[str, _Diverted] | None = None
                   ) -> AddRequest | None:
        """The request for the engine, or None when the entry was answered here (or, with
        `diverted`, is to be handed to the peer whose cache holds its prefix: recorded there)."""
        # NOTE: hand-backs by draining workers are not failures: a request that outlived a few
        # scale-downs must not be dead-lettered as poison.
        if entry.attempt - entry.forgiven > self.max_deliveries:
            self._poison(entry, decoded, fields)
            return None
        if isinstance(decoded, protocol.RejectedEntry):
            self._reject(entry, decoded, fields)
            return None
        request = decoded.request
        entry_ms = protocol.entry_time_ms(entry.entry_id)
        waited_ms = max(0, now_ms - entry_ms)
        if request.deadline_ms is not None and waited_ms > request.deadline_ms:
            self._fail(entry, ErrorCode.DEADLINE_EXCEEDED,
                       f"deadline_ms: the request waited {waited_ms} ms in the queue, past its "
                       f"deadline of {request.deadline_ms} ms")
            return None
        if cancel_flag or entry.cancel_requested:
            self._cancelled(entry, waited_ms)
            return None
        try:
            processed = self.processor.process(request)
        except RequestRejected as e:
            self._fail(entry, e.code, e.message, e.details)
            return None
        entry.prompt_tokens = len(processed.prompt_token_ids)
        self.ctx.intake.note_prompt(entry.prompt_tokens)
        # NOTE: the stream decides the class of a lane entry; on the queue's own stream a
        # plain XADD may still say `"lane": "batch"`, which the engine then preempts first.
        lane = entry.lane if entry.lane is not None and not entry.lane.is_queue_stream else None
        batch = lane.priority_class == BATCH if lane is not None else request.lane == BATCH
        # NOTE: an entry is handed over within the stream it is on (broker/affinity_handover.py)
        # and taken with its lane.
        if diverted is not None and entry.attempt == 1 and not entry.solo \
                and self.affinity is not None \
                and (route := self.affinity.router.target(processed.prompt_token_ids,
                                                          on_lane=lane is not None)):
            diverted[entry.entry_id] = _Diverted(entry, processed, now_ms, waited_ms, route,
                                                 batch, lane)
            return None
        return self._start(entry, processed, now_ms, waited_ms, batch)

    def _start(self, entry: InFlight, processed: ProcessedInput, now_ms: int,
               waited_ms: int, batch: bool) -> AddRequest:
        """`start` queued, and the request for the busy loop (`batch`: in the batch class)."""
        if self.affinity is not None:
            self.affinity.router.claim(processed.prompt_token_ids)
        entry.admitted_ms = now_ms
        if entry.trace is not None:
            entry.trace.admitted_ns = time.time_ns()
        start = protocol.Start(request_id=entry.request_id, attempt=entry.attempt,
                               worker=self.ctx.worker_id, prompt_tokens=entry.prompt_tokens,
                               model=self.ctx.model_name)
        # NOTE: `start` is queued before the engine sees the request, so it precedes every delta
        # in the writer's FIFO.
        self.writer.put(EntryWrite(entry.entry_id, entry.request_id, entry.encoding, [start]))
        return AddRequest(entry.entry_id, processed.prompt_token_ids, processed.sampling_params,
                          processed.priority, arrival_time=self.clock() - waited_ms / 1000.0,
                          solo=entry.solo, batch=batch)

    def _hand_over(self, client: redis.Redis, diverted: dict[str, _Diverted],
                   backoff: Backoff) -> list[AddRequest]:
        """Hand diverted entries to their peers; those a peer cannot take (gone, backlog full)
        start here after all. Returns their requests."""
        assert self.affinity is not None
        # NOTE: out of the table first: a renewal racing the hand-over must not find an entry
        # we still hold pending under the peer and fence it.
        by_route: dict[tuple[Route, WorkLane | None], list[str]] = {}
        for entry_id, d in diverted.items():
            self.table.pop(entry_id)
            by_route.setdefault((d.route, d.lane), []).append(entry_id)
        gone = self.affinity.hand_over(client, by_route, backoff)
        return [self._start(d.entry, d.processed, d.now_ms, d.waited_ms, d.batch)
                for entry_id, d in diverted.items()
                if entry_id not in gone and self.table.add(d.entry)]

    def _reject(self, entry: InFlight, rejected: protocol.RejectedEntry, fields: Fields) -> None:
        if rejected.request_id not in (None, entry.entry_id):
            logger.info("entry %s rejected (%s): %s", entry.entry_id, rejected.code,
                        rejected.message)
            self._fail(entry, rejected.code, rejected.message)
            return
        # NOTE: no usable id of its own (none given, or unreadable): the error goes on
        # llmq:r:{<entry id>}, the stream an id-less producer follows (the XADD reply is all it
        # knows), and the payload is kept in the dead-letter stream for people. No other entry
        # can write there: an explicit `id` of the entry-id form is refused.
        logger.warning("entry %s dead-lettered (%s): %s", entry.entry_id, rejected.code,
                       rejected.message)
        self._fail(entry, rejected.code, rejected.message, dead_letter=self.dead_letter(
            entry.entry_id, None, rejected.code, rejected.message, entry.attempt, fields))

    def _duplicate(self, entry: InFlight, owner: str, fields: Fields) -> None:
        """Another entry owns this request id (`owner`; "" when it is a tenant's id that its
        submit function did not mark for this entry): answer on llmq:r:{<entry id>}, never on the
        id's own stream, whose run (attempts, events, ack) stays the owner's alone."""
        request_id = entry.request_id
        details: dict[str, str | None]
        if owner:
            code = ErrorCode.DUPLICATE_ID
            message = (f"request id {request_id!r} belongs to entry {owner}, submitted earlier: "
                       "this entry is a duplicate and did not run (use a new id to run it "
                       "again)")
            details = {"request_id": request_id, "owner_entry_id": owner}
        else:
            code = ErrorCode.INVALID_REQUEST
            message = (f"request id {request_id!r} is tenant {tenant_of(request_id)!r}'s: such "
                       "ids run only when queued by the submit function, which marks the id as "
                       "the entry's (a plain XADD cannot take or block a tenant's id)")
            details = {"request_id": request_id, "tenant": tenant_of(request_id)}
        logger.warning("entry %s not run (%s, request id %s, owner %s): dead-lettered",
                       entry.entry_id, code, request_id, owner or "none")
        entry.request_id = entry.entry_id  # cancels of the id must not reach it either
        # NOTE: request_id None in the dead letter: a `dlq retry` of it must not delete the
        # owner's result stream.
        self._fail(entry, code, message, details, dead_letter=self.dead_letter(
            entry.entry_id, None, code, message, entry.attempt, fields))

    def _off_lane(self, entry: InFlight, why: str, fields: Fields) -> None:
        """An entry that does not fit its stream (broker/work_lanes.py): not run, answered on no
        result stream (its id could be another stream's entry's), dead-lettered."""
        logger.warning("entry %s on %s not run: %s", entry.entry_id,
                       entry.lane.stream if entry.lane else self.ctx.queue_key, why)
        entry.terminal = True
        code = ErrorCode.INVALID_REQUEST
        self.writer.put(EntryWrite(entry.entry_id, None, entry.encoding, [], ack=True,
                                   dead_letter=self.dead_letter(entry.entry_id, None, code, why,
                                                                entry.attempt, fields)))

    def _poison(self, entry: InFlight, decoded: Decoded, fields: Fields) -> None:
        """Delivered more than max_deliveries times: it keeps killing workers, so stop here."""
        message = (f"the request was delivered {entry.attempt} times (max_deliveries="
                   f"{self.max_deliveries}) without finishing: moved to the dead-letter stream")
        logger.warning("entry %s is poison (%d deliveries): dead-lettered", entry.entry_id,
                       entry.attempt)
        code = ErrorCode.POISON
        # NOTE: without a usable id, entry.request_id is the entry id (answered there).
        self._fail(entry, code, message, dead_letter=self.dead_letter(
            entry.entry_id, decoded.request_id, code, message, entry.attempt, fields))

    def _fail(self, entry: InFlight, code: ErrorCode, message: str,
              details: dict[str, Any] | None = None, *,
              dead_letter: dict[str, bytes] | None = None) -> None:
        error = protocol.Error(request_id=entry.request_id, attempt=entry.attempt, code=code,
                               message=message, details=details, metadata=entry.metadata)
        entry.terminal = True
        self.writer.put(EntryWrite(entry.entry_id, entry.request_id, entry.encoding, [error],
                                   ack=True, dead_letter=dead_letter))

    def _cancelled(self, entry: InFlight, waited_ms: int) -> None:
        waited = waited_ms / 1000.0
        done = protocol.Done(request_id=entry.request_id, attempt=entry.attempt,
                             finish_reason="cancelled", text="", usage=protocol.Usage(0, 0, 0),
                             timings=protocol.Timings(waited, None, waited, None),
                             metadata=entry.metadata)
        entry.terminal = True
        self.writer.put(EntryWrite(entry.entry_id, entry.request_id, entry.encoding, [done],
                                   ack=True))

    def _read_time_flags_and_markers(self, client: redis.Redis, flagged: list[InFlight],
                                     named: list[InFlight]
                                     ) -> tuple[int, list[bool], list[str | None]]:
        """(TIME of the queue's server in unix ms, whether each flagged entry's cancel flag is
        set, the entry each named entry's id marker names: None when it named none and this
        entry claimed it), in one round trip on one server. A cluster pipeline takes no TIME: it
        goes to the queue's node first."""
        pipe = client.pipeline(transaction=False)
        cluster = cluster_client(client)
        now: object = None
        if cluster is not None:
            now = cluster.time(target_nodes=cluster.get_node_from_key(self.ctx.queue_key))
            if isinstance(now, dict):
                (now,) = now.values()
        else:
            pipe.time()
        for e in flagged:
            pipe.exists(self.keys.cancel_flag(e.request_id))
        for e in named:
            marker = self.keys.idempotency(self.ctx.queue, e.request_id)
            if tenant_of(e.request_id) is not None:
                # NOTE: a tenant's id is never claimed here: only the tenant's own submit
                # function marks it, so an entry someone else XADDed with it cannot take it
                # (nor block it).
                pipe.get(marker)
            else:
                # NOTE: SET NX GET (Redis 7.0): claim the id, or learn who has it.
                pipe.set(marker, e.entry_id, nx=True, get=True, ex=self.ctx.config.result_ttl)
        results = pipe.execute()
        if cluster is None:
            now, results = results[0], results[1:]
        flags = [bool(replies.integer(r, "EXISTS")) for r in results[:len(flagged)]]
        owners = replies.optional_texts(results[len(flagged):], "SET NX GET")
        return replies.server_time_ms(now), flags, owners

    def dead_letter(self, entry_id: str, request_id: str | None, code: ErrorCode,
                    message: str, deliveries: int, fields: Fields | None) -> dict[str, bytes]:
        letter = protocol.DeadLetter(queue=self.ctx.queue, entry_id=entry_id,
                                     request_id=request_id, code=code, message=message,
                                     deliveries=deliveries, worker=self.ctx.worker_id,
                                     at_ms=int(time.time() * 1000))
        return protocol.encode_dead_letter(letter, fields)


def _entry_for(decoded: Decoded, attempt: int) -> InFlight:
    if isinstance(decoded, protocol.DecodedRequest):
        request = decoded.request
        return InFlight(decoded.entry_id, decoded.request_id, attempt, decoded.encoding,
                        metadata=request.metadata, stream=request.stream, n=request.n)
    # A rejected entry still sits in the table until its error or dead letter is acked.
    return InFlight(decoded.entry_id, decoded.request_id or decoded.entry_id, attempt,
                    decoded.encoding or "json")


def _off_its_lane(entry: InFlight) -> str | None:
    """Why an entry does not fit the stream it is on, or None. Lane entry ids are the lane
    submit function's (sequence numbers from LANE_SEQ_BASE) and the queue's own stream's are
    `*` ids below it, so no entry id is two streams'; a tenant's lane carries that tenant's ids
    only and the shared batch lane none: an entry someone XADDed by hand with another stream's
    entry id cannot take over that entry's request id, marker or result stream."""
    on_lane = int(entry.entry_id.partition("-")[2] or 0) >= LANE_SEQ_BASE
    lane = entry.lane
    if lane is None or lane.is_queue_stream:
        return "a lane entry id on the queue's own stream" if on_lane else None
    if not on_lane:
        return f"added to {lane.stream} without the lane submit function (llmq_submit_lane)"
    tenant = tenant_of(entry.request_id)
    if lane.tenant is not None and tenant != lane.tenant:
        return f"lane {lane.label} carries only request ids `{lane.tenant}:<id>`"
    if lane.tenant is None and tenant is not None:
        return f"a tenant's request id on the shared lane {lane.label}"
    return None
