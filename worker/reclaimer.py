"""Reclaimer: the worker's thread that takes over other workers' requests, and tidies the queue.

Every `claim_interval` (heartbeat_timeout / 5, one second by default), while not draining:

Each scan covers every stream of the queue: its own and every lane stream
(worker/lane_registry.py), each with its own consumer group and pending list.

1. Dead workers. A consumer that holds pending entries and whose heartbeat hash
   `llmq:w:<name>` has expired is dead (SIGKILL, OOM kill, node loss): its entries are taken at
   once (XPENDING for that consumer, then XCLAIM with min-idle = heartbeat_timeout, so two
   peers never both take one) and rerun as attempt n = their delivery count. A SIGKILLed
   worker's requests restart within `WorkerConfig.takeover_bound` (8 s by default).
2. Lapsed leases. Entries idle past `lease_timeout` although their worker still beats (its
   busy loop or process stalled) are taken the same way, and so are entries handed back by a
   draining or failing worker (huge IDLE) at once.
3. Once a minute: remove dead workers' consumers that hold nothing (no heartbeat, or idle for
   ten minutes; the first time after two heartbeat timeouts), answer submissions whose entry
   vanished unread, report entries trimmed before any worker read them (worker/unread_loss.py),
   and trim acked entries from the request stream (broker/retention.py) so it does not grow
   forever. This runs whatever else fails: under OOM the trim (not refused: it frees memory)
   still goes on.

**Never during a Redis-wide stall.** Both takeovers need `Liveness.healthy_for(...)`: this
worker's own heartbeats have gone through steadily for a whole heartbeat timeout (dead
workers) or a whole lease (lapsed leases). When every heartbeat went stale together (CLIENT
PAUSE, a stopped or out-of-memory Redis, this worker paused), the owners are alive: they beat
and renew within that time, and nothing is taken from them.

**Suspects run alone.** Entries handed back after an engine-fatal error carry a distinctive
IDLE (lease_keeper.SUSPECT_IDLE_MS): one of them may have killed the engine. A worker takes at
most one suspect at a time, and none while it holds one; the busy loop runs it alone. So only
the request that really kills engines reaches `max_deliveries` and is dead-lettered, while its
batch-mates finish on their next delivery.

Entries that vanished from the request stream while pending (trimmed or deleted) are dropped
from the PEL by XCLAIM: they are answered `lost_payload` on llmq:r:{<entry id>} and dead-lettered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import redis
from redis.typing import StreamIdT

from llmq import protocol
from llmq.broker import replies
from llmq.broker.consumer_cleanup import drop_idle_consumer
from llmq.broker.keys import GROUP, is_valid_name
from llmq.broker.replies import PendingEntry
from llmq.broker.retention import trim_acked_requests
from llmq.broker.work_lanes import WorkLane
from llmq.protocol.errors import ErrorCode
from llmq.protocol.requests import ENTRY_ID_RE
from llmq.worker.admission import Admission
from llmq.worker.backoff import REDIS_ERRORS, TRANSIENT_ERRORS, Backoff
from llmq.worker.io_thread import IOThread
from llmq.worker.lease_keeper import HAND_BACK_IDLE_MS, SUSPECT_MIN_IDLE_MS
from llmq.worker.liveness import Liveness
from llmq.worker.result_writer import EntryWrite, ResultWriter
from llmq.worker.unread_loss import UnreadLoss
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)

# Idle consumers with nothing pending are removed after this long (dead workers' names).
CONSUMER_CLEANUP_IDLE_MS = 10 * 60 * 1000
# XPENDING rows read beyond the room there is, so suspects skipped do not hide other work.
_SCAN_SLACK = 32


class Reclaimer(IOThread):
    """`liveness` is the lease keeper's record of this worker's own heartbeats."""

    def __init__(self, ctx: WorkerContext, admission: Admission, writer: ResultWriter,
                 liveness: Liveness, *, ensure_group: Callable[[], None],
                 first_contact: Callable[[], bool] = lambda: True) -> None:
        super().__init__("llmq-reclaimer", ctx)
        config = ctx.config
        assert config.claim_interval is not None
        self.admission = admission
        self.writer = writer
        self.liveness = liveness
        self.ensure_group = ensure_group
        # called every round until it says it is done
        self.first_contact: Callable[[], bool] | None = first_contact
        self.lease_timeout = config.lease_timeout
        self.lease_ms = int(config.lease_timeout * 1000)
        self.heartbeat_timeout = config.heartbeat_timeout
        self.heartbeat_ms = int(config.heartbeat_timeout * 1000)
        self.claim_interval = config.claim_interval
        self.reclaiming = True  # off while draining: a draining worker takes nothing new
        self.backoff = Backoff("reclaimer", ctx.state, stop=self.stop_event)
        self._next_cleanup = time.monotonic() + 60.0
        # NOTE: consumers are first tidied once peers' heartbeats could have expired, so those
        # of a pool stopped just before this one started are gone within seconds.
        self._first_consumer_cleanup: float | None = (time.monotonic()
                                                      + 2 * config.heartbeat_timeout)
        self.unread_loss = UnreadLoss(ctx)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            started = time.monotonic()
            if self.first_contact is not None:
                self._guard(self._make_first_contact)
            if self.reclaiming:
                self._guard(self._refresh_lanes)
                for lane in self.ctx.lanes.all():
                    self._guard(partial(self.take_dead_workers, lane))
                    self._guard(partial(self.take_lapsed, lane))
            if self._first_consumer_cleanup is not None \
                    and started >= self._first_consumer_cleanup:
                self._first_consumer_cleanup = None
                for lane in self.ctx.lanes.all():
                    self._guard(partial(self._cleanup_consumers, lane))
            if started >= self._next_cleanup:
                self._next_cleanup = started + 60.0
                # NOTE: entries trimmed unread are counted on the queue's own stream, the one
                # plain XADDs reach; a lane's entries all have submission records, which
                # `answer_vanished_unread` answers.
                self._guard(lambda: self.unread_loss.check(self.client))
                for lane in self.ctx.lanes.all():
                    self._guard(partial(self._cleanup_consumers, lane))
                    self._guard(partial(self.answer_vanished_unread, lane))
                    self._guard(partial(trim_acked_requests, self.client, self.keys,
                                        self.ctx.queue, lane.stream))
            self.stop_event.wait(max(0.0, self.claim_interval - (time.monotonic() - started)))

    def _refresh_lanes(self) -> None:
        self.ctx.lanes.refresh(self.client)

    def _make_first_contact(self) -> None:
        assert self.first_contact is not None
        if self.first_contact():
            self.first_contact = None

    def _guard(self, work: Callable[[], object]) -> None:
        try:
            work()
            self.backoff.succeeded()
        except TRANSIENT_ERRORS as e:
            self.backoff.failed(e)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                try:
                    self.ensure_group()
                except REDIS_ERRORS as e2:
                    self.backoff.failed(e2)
            elif "no such key" not in str(e).lower():
                logger.error("reclaimer: Redis refused a command: %s", e)

    # -- 1. dead workers --------------------------------------------------------------------------

    def take_dead_workers(self, lane: WorkLane | None = None) -> int:
        """Take the entries of consumers whose heartbeat expired from `lane` (the queue's own
        stream by default); returns how many."""
        if not self.liveness.healthy_for(self.heartbeat_timeout) or self._room() <= 0:
            return 0
        lane = lane or self.ctx.lanes.queue_lane
        consumers = replies.consumers(self.client.xinfo_consumers(lane.stream, GROUP))
        holders = [c.name for c in consumers if c.pending and c.name != self.worker_id]
        # NOTE: a consumer name that is no valid worker id cannot have a heartbeat: dead.
        named = [h for h in holders if is_valid_name(h)]
        pipe = self.client.pipeline(transaction=False)
        for name in named:
            pipe.exists(self.keys.worker(name))
        alive = {name: bool(replies.integer(reply, "EXISTS"))
                 for name, reply in zip(named, pipe.execute(), strict=True)}
        taken = 0
        for name in (h for h in holders if not alive.get(h)):
            rows = replies.pending_entries(self.client.xpending_range(
                lane.stream, GROUP, "-", "+", self._room() + _SCAN_SLACK, consumername=name,
                idle=self.heartbeat_ms))
            got = self._take(rows, self.heartbeat_ms, f"from dead worker {name}", lane)
            taken += got
            if got:
                self.client.zrem(self.keys.workers(), name)
        return taken

    # -- 2. lapsed leases and handed-back entries -------------------------------------------------

    def take_lapsed(self, lane: WorkLane | None = None) -> int:
        """Take entries idle past the lease (or handed back) from `lane` (the queue's own stream
        by default); returns how many."""
        if self._room() <= 0:
            return 0
        lane = lane or self.ctx.lanes.queue_lane
        # NOTE: handed-back entries may go at any time; a lapsed lease only once this worker's
        # beats have been steady for a whole lease, so an owner alive through a common stall
        # has renewed first.
        steady = self.liveness.healthy_for(self.lease_timeout)
        min_idle = self.lease_ms if steady else HAND_BACK_IDLE_MS
        rows = replies.pending_entries(self.client.xpending_range(
            lane.stream, GROUP, "-", "+", self._room() + _SCAN_SLACK, idle=min_idle))
        return self._take(rows, min_idle, f"idle past the {self.lease_ms} ms lease", lane)

    # -- taking entries ---------------------------------------------------------------------------

    def _room(self) -> int:
        return self.ctx.max_num_seqs - len(self.table)

    def _take(self, rows: list[PendingEntry], min_idle_ms: int, why: str,
              lane: WorkLane) -> int:
        """XCLAIM the XPENDING `rows` there is room for (one suspect at most) and admit them."""
        room = self._room()
        holding_suspect = self.table.holds_solo()
        chosen: list[str] = []
        suspects: set[str] = set()
        for row in rows:
            if len(chosen) >= room:
                break
            entry_id = row.entry_id
            if self.table.get(entry_id) is not None:
                continue  # ours already: a renewal raced the scan
            if row.idle_ms >= SUSPECT_MIN_IDLE_MS:
                if holding_suspect:
                    continue  # one at a time: it runs alone
                holding_suspect = True
                suspects.add(entry_id)
            chosen.append(entry_id)
        if not chosen:
            return 0
        message_ids: list[StreamIdT] = [*chosen]  # NOTE: a list is invariant: redis-py's type
        claimed = replies.entries(self.client.xclaim(
            lane.stream, GROUP, self.worker_id, min_idle_ms, message_ids), "XCLAIM")
        got = [entry.entry_id for entry in claimed]
        if missing := [i for i in chosen if i not in set(got)]:
            self._answer_vanished(missing, lane)
        if not claimed:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for entry_id in got:
            pipe.xpending_range(lane.stream, GROUP, min=entry_id, max=entry_id, count=1)
        pipe.hmget(self.keys.handbacks(self.ctx.queue), got)
        *pendings, handbacks = pipe.execute()
        attempts = {}
        for entry_id, pending in zip(got, pendings, strict=True):
            rows = replies.pending_entries(pending)
            # NOTE: XCLAIM just counted this delivery, so times_delivered is this attempt.
            attempts[entry_id] = rows[0].times_delivered if rows else 1
        forgiven = {entry_id: int(n) for entry_id, n in zip(
            got, replies.optional_texts(handbacks, "HMGET"), strict=True) if n}
        logger.warning("took %d entr%s %s: %s", len(got), "y" if len(got) == 1 else "ies", why,
                       ", ".join(f"{i} (attempt {attempts[i]}"
                                 f"{', alone' if i in suspects else ''})" for i in got[:5]))
        if self.ctx.metrics is not None:
            self.ctx.metrics.inc_reclaimed(len(got))
        return self.admission.admit(self.client, claimed, self.backoff, attempts, forgiven,
                                    solo=suspects & set(got),
                                    lanes=dict.fromkeys(got, lane))

    def _answer_vanished(self, entry_ids: list[str], lane: WorkLane) -> None:
        """Chosen entries XCLAIM did not return: a peer took them first (still pending), or they
        were trimmed or deleted from the stream while pending (XCLAIM dropped them)."""
        pipe = self.client.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xpending_range(lane.stream, GROUP, min=entry_id, max=entry_id, count=1)
        gone = [i for i, pending in zip(entry_ids, pipe.execute(), strict=True)
                if not replies.pending_entries(pending)]
        if not gone:
            return
        message = "the entry was trimmed or deleted from the request stream while pending"
        logger.warning("%d pending entries lost their payload: %s", len(gone), gone[:5])
        # NOTE: the payload is gone; the request id is known only from the submit function's
        # record (a raw XADD leaves none), which anyone who may submit can forge: it counts only
        # when the id's marker names this entry back.
        submitted = replies.optional_texts(self.client.hmget(lane.submissions, gone), "HMGET")
        owners = self._confirmed_ids(dict(zip(gone, submitted, strict=True)))
        for entry_id in gone:
            self._answer_lost(entry_id, owners.get(entry_id), message, lane)

    def _answer_lost(self, entry_id: str, request_id: str | None, message: str,
                     lane: WorkLane) -> None:
        """`lost_payload` on the request's stream, or on llmq:r:{<entry id>} when its id is
        unknown (as for any entry without a usable id), and a dead letter for operators."""
        code = ErrorCode.LOST_PAYLOAD
        answered_on = request_id if request_id is not None else entry_id
        error = protocol.Error(request_id=answered_on, attempt=1, code=code, message=message)
        self.writer.put(EntryWrite(
            entry_id, answered_on, "json", [error], ack=True, pop=False, lane=lane,
            dead_letter=self.admission.dead_letter(entry_id, request_id, code, message, 0, None)))

    def answer_vanished_unread(self, lane: WorkLane | None = None) -> int:
        """Answer `lost_payload` for submissions whose entry left the request stream unread
        (someone trimmed or deleted it); returns how many. Runs once a minute.

        `llmq:sub:{queue}` names every entry the submit function added until a worker acks it;
        one that is neither in the stream nor pending vanished. Its request id counts only if
        its idempotency marker still names that entry (or the id is the entry id), so a
        record forged by another producer cannot fail someone else's request."""
        lane = lane or self.ctx.lanes.queue_lane
        answered, cursor = 0, 0
        while True:
            cursor, page = self.client.hscan(lane.submissions, cursor, count=500)
            if records := replies.string_hash(page, "HSCAN"):
                answered += self._answer_vanished_in(records, lane)
            if not cursor:
                return answered

    def _answer_vanished_in(self, records: dict[str, str], lane: WorkLane) -> int:
        # NOTE: anyone who may submit may HSET a record (the submit function runs with the
        # caller's rights): one that names no entry id must not fail the whole pass.
        if bad := [e for e in records if not ENTRY_ID_RE.fullmatch(e)]:
            logger.warning("dropping %d submission records naming no entry id: %r", len(bad),
                           bad[:3])
            self.client.hdel(lane.submissions, *bad)
            records = {e: r for e, r in records.items() if e not in bad}
            if not records:
                return 0
        pipe = self.client.pipeline(transaction=False)
        for entry_id in records:
            pipe.xrange(lane.stream, min=entry_id, max=entry_id, count=1)
            pipe.xpending_range(lane.stream, GROUP, min=entry_id, max=entry_id, count=1)
        results = pipe.execute()
        vanished = {entry_id: request_id for (entry_id, request_id), present, pending in zip(
            records.items(), results[0::2], results[1::2], strict=True)
            if not replies.entries(present) and not replies.pending_entries(pending)}
        if not vanished:
            return 0
        owners = self._confirmed_ids(dict(vanished))
        # NOTE: an answer on the entry's own stream (an id-less submit's, or a record naming no
        # one) is written only where that stream has no events: one that has them ran and was
        # answered, and the record is a forgery aimed at it.
        unnamed = [e for e in vanished if owners.get(e, e) == e]
        pipe = self.client.pipeline(transaction=False)
        for entry_id in unnamed:
            pipe.exists(self.keys.result(entry_id))
        answered = {e for e, found in zip(unnamed, pipe.execute() if unnamed else [],
                                          strict=True) if replies.integer(found, "EXISTS")}
        if answered:
            logger.warning("dropping %d submission records of entries answered already: %s",
                           len(answered), sorted(answered)[:3])
            self.client.hdel(lane.submissions, *answered)
        message = "the entry was trimmed or deleted from the request stream before a worker read it"
        for entry_id in vanished:
            if entry_id not in answered:
                self._answer_lost(entry_id, owners.get(entry_id), message, lane)
        logger.warning("%d submitted entries vanished unread from %s: answered lost_payload",
                       len(vanished), lane.stream)
        return len(vanished)

    def _confirmed_ids(self, records: dict[str, str | None]) -> dict[str, str]:
        """entry id -> request id, for the submission records that are genuine: the id is the
        entry's own (an id-less submit), or the id's marker names the entry back. A record
        forged by someone who may submit (the submit function runs with the caller's rights,
        so HSET on the records is theirs) names nothing, and its entry is answered on
        llmq:r:{<entry id>}, never on another request's stream."""
        named = [(e, r) for e, r in records.items()
                 if r is not None and r != e and is_valid_name(r)]
        pipe = self.client.pipeline(transaction=False)
        for _, request_id in named:
            pipe.get(self.keys.idempotency(self.ctx.queue, request_id))
        markers = pipe.execute() if named else []
        confirmed = {e: r for (e, r), marker in zip(named, markers, strict=True)
                     if replies.optional_text(marker, "GET") == e}
        own = {e: r for e, r in records.items() if r == e}
        return {**own, **confirmed}

    # -- 3. tidying -------------------------------------------------------------------------------

    def _cleanup_consumers(self, lane: WorkLane | None = None) -> None:
        """Delete consumers of dead workers once they hold nothing: those whose heartbeat is
        gone (idle past a heartbeat timeout), and any idle for a long time. So `llmq status`
        and the dashboard count the workers there are, not every one that ever ran."""
        stream = (lane or self.ctx.lanes.queue_lane).stream
        idle = [c for c in replies.consumers(self.client.xinfo_consumers(stream, GROUP))
                if c.name != self.worker_id and c.pending == 0 and c.idle_ms > self.heartbeat_ms]
        pipe = self.client.pipeline(transaction=False)
        for consumer in idle:
            pipe.exists(self.keys.worker(consumer.name))
        beats = pipe.execute() if idle else []
        for consumer, beat in zip(idle, beats, strict=True):
            if consumer.idle_ms > CONSUMER_CLEANUP_IDLE_MS or not replies.integer(beat, "EXISTS"):
                # NOTE: checked and deleted in one step on the server: a paused worker that
                # wakes and reads an entry in between must not lose it with its consumer
                # (broker/consumer_cleanup.py). A live one's next read recreates the consumer.
                if drop_idle_consumer(self.client, stream, consumer.name):
                    logger.info("removed idle consumer %s (no heartbeat, nothing pending)",
                                consumer.name)
