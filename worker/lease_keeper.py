"""LeaseKeeper: the worker's thread that beats, keeps its leases, and hands work back.

Every `heartbeat_interval` (heartbeat_timeout / 5, one second by default):

1. Heartbeat: `HSET llmq:w:<worker_id>` (model, queue, running, waiting, KV use, tokens/s) with
   `PEXPIRE heartbeat_timeout`, and the registry's `ZADD llmq:workers`. A worker whose hash has
   expired is dead: peers take its requests at once (worker/reclaimer.py). Each beat's outcome
   feeds `Liveness`, which tells the reclaimer whether Redis has been answering steadily.
2. Every `renew_interval` (about lease_timeout / 3): fence, then renew. One function of the
   llmq library (`llmq_claim_owned`, broker/functions.py) checks, per in-flight entry, that
   XPENDING still lists it under this consumer and re-claims only those (XCLAIM to itself,
   min-idle 0, JUSTID: idle back to 0, delivery count unchanged). An entry it no longer owns
   was taken by a peer (this worker's heartbeat lapsed, or its lease: a stall, a partition, a
   paused process): the engine aborts it and nothing more is written for it, so the stale
   owner stops within one renewal (docs/reliability.md, scenario 14). Check and claim are one
   atomic call, so the keeper never steals an entry back from the peer that took it.

Beats and renewals share this one light thread and nothing heavy ever runs on it (reclaims,
which tokenize, are the reclaimer's), so a live worker's heartbeat never lapses behind work.

The same function with a huge IDLE hands entries back on shutdown (`hand_back`): a peer's next
scan takes them at once. After an engine-fatal error the entries that were in the engine are
handed back as suspects (an even larger IDLE): each runs alone on its next delivery, so only
the one that kills the engine reaches `max_deliveries` (worker/reclaimer.py).

References: Redis streams docs (XPENDING/XCLAIM, "recovering from permanent failures"); the
Celery visibility-timeout failure mode that lease renewal avoids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import redis

from llmq.broker import replies
from llmq.broker.commands import as_fields
from llmq.broker.functions import CLAIM_OWNED_FUNCTION, is_missing_function, reload_missing
from llmq.broker.keys import GROUP
from llmq.broker.work_lanes import WorkLane
from llmq.worker.backoff import REDIS_ERRORS, TRANSIENT_ERRORS, Backoff
from llmq.worker.inbox import AbortRequests
from llmq.worker.io_thread import IOThread
from llmq.worker.liveness import Liveness
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)

# Lua's unpack has a stack limit in the thousands: renew in slices well below it.
_SLICE = 500
# Idle set on handed-back entries: far past any lease, yet below the server's clock in ms
# (XCLAIM resets a delivery time before the epoch to "now", which would be idle 0).
HAND_BACK_IDLE_MS = 10**10
# Idle set on entries handed back after an engine-fatal error (suspects: one of them may have
# killed the engine). Readers tell them apart by idle >= SUSPECT_MIN_IDLE_MS: the two values
# stay apart for 58 days of waiting.
SUSPECT_IDLE_MS = 2 * 10**10
SUSPECT_MIN_IDLE_MS = (HAND_BACK_IDLE_MS + SUSPECT_IDLE_MS) // 2
# The hand-back counts outlive any entry's stay in the PEL; acked entries' counts are deleted.
HANDBACK_TTL_S = 7 * 24 * 3600


class LeaseKeeper(IOThread):
    """`heartbeat()` gives the fields of this worker's heartbeat hash; `ensure_group()`
    recreates the consumer group when Redis lost it."""

    def __init__(self, ctx: WorkerContext, *, heartbeat: Callable[[], dict[str, str]],
                 ensure_group: Callable[[], None]) -> None:
        super().__init__("llmq-lease-keeper", ctx)
        config = ctx.config
        assert config.renew_interval is not None
        self.renew_interval = config.renew_interval
        self.heartbeat_interval = config.heartbeat_interval
        self.heartbeat_ttl_ms = max(1, int(config.heartbeat_timeout * 1000))
        self.heartbeat = heartbeat
        self.ensure_group = ensure_group
        self.liveness = Liveness(self.heartbeat_interval, config.heartbeat_timeout)
        self.backoff = Backoff("lease keeper", ctx.state, stop=self.stop_event)
        self._refused: dict[str, str] = {}  # what Redis last refused, per task (logged once)

    def _run(self) -> None:
        next_renew = 0.0
        while not self.stop_event.is_set():
            started = time.monotonic()
            # NOTE: each task on its own: a refused beat (OOM: HSET is denied, XCLAIM is not)
            # must not stop renewals, nor a failed renewal the heartbeat.
            if self._attempt("heartbeat", self.beat):
                self.liveness.beat_succeeded()
            else:
                self.liveness.beat_failed()
            if started >= next_renew and self._attempt("renewal", self.renew):
                next_renew = started + self.renew_interval
            self.stop_event.wait(max(0.0, self.heartbeat_interval
                                     - (time.monotonic() - started)))

    def _attempt(self, task: str, work: Callable[[], object]) -> bool:
        try:
            work()
        except TRANSIENT_ERRORS as e:
            self.backoff.failed(e)
            return False
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                self._on_nogroup()
            elif self._refused.get(task) != str(e):
                logger.error("lease keeper: Redis refused the %s: %s", task, e)
            self._refused[task] = str(e)
            return False
        self.backoff.succeeded()
        if self._refused.pop(task, None) is not None:
            logger.warning("lease keeper: the %s works again", task)
        return True

    # -- 1. heartbeat -----------------------------------------------------------------------------

    def beat(self) -> None:
        now_ms = int(time.time() * 1000)
        fields = self.heartbeat()
        key = self.keys.worker(self.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping=as_fields(fields))
        pipe.pexpire(key, self.heartbeat_ttl_ms)
        pipe.zadd(self.keys.workers(), {self.worker_id: now_ms})
        # NOTE: the live workers of the prefix, other queues' too (an overcount only makes this
        # worker's reads smaller, never leaves work unread; the even share counts this queue's
        # apart); ZRANGE, which the worker's ACL already grants, not ZCOUNT, so an upgrade needs
        # no new rule.
        pipe.zrange(self.keys.workers(), now_ms - self.heartbeat_ttl_ms, "+inf", byscore=True)
        self.ctx.live_worker_ids = frozenset(replies.texts(pipe.execute()[-1], "ZRANGE"))
        self.ctx.intake.num_workers = max(1, len(self.ctx.live_worker_ids))

    # -- 2. fence and renew -----------------------------------------------------------------------

    def renew(self) -> list[str]:
        """Renew every live in-flight entry; fence and abort the ones a peer took. Returns those."""
        entry_ids = self.table.live_entry_ids()
        lost, orphaned = self._claim_owned(entry_ids, idle_ms=0)
        if orphaned:
            self.table.orphan(orphaned)
            logger.warning("%d in-flight entries vanished with the request stream (Redis lost "
                           "its data?): finishing them without a lease", len(orphaned))
        # NOTE: an entry acked (and forgotten) by the result writer while the function ran is
        # "not pending" too; only entries still in the table were really taken.
        fenced = self.table.fence([e for e in lost if (held := self.table.get(e)) is not None
                                   and not held.terminal])
        if fenced:
            logger.warning("lease lost on %d entr%s (a peer reclaimed them): aborting %s",
                           len(fenced), "y" if len(fenced) == 1 else "ies", fenced[:5])
            self.ctx.inbox.put(AbortRequests(fenced))
        return fenced

    def hand_back(self, entry_ids: list[str], *, forgive: bool = False,
                  suspect: bool = False, lanes: Mapping[str, WorkLane] | None = None) -> int:
        """Make entries instantly reclaimable by peers (shutdown); returns how many were ours.

        With `forgive` (a drain, not a failure) each is also counted in `llmq:hb:{<queue>}`, so
        the delivery it used up is not held against it as poison. With `suspect` (they were in
        the engine when it failed) each runs alone on its next delivery. `lanes`: the lane of
        entries not in the in-flight table (read, not admitted); the table knows the others'."""
        lost, orphaned = self._claim_owned(entry_ids,
                                           SUSPECT_IDLE_MS if suspect else HAND_BACK_IDLE_MS,
                                           lanes)
        owned = sorted(set(entry_ids) - set(lost) - set(orphaned))
        if owned and forgive:
            key = self.keys.handbacks(self.ctx.queue)
            pipe = self.client.pipeline(transaction=False)
            for entry_id in owned:
                pipe.hincrby(key, entry_id, 1)
            pipe.expire(key, HANDBACK_TTL_S)
            pipe.execute()
        return len(owned)

    def hand_back_retrying(self, entry_ids: list[str], *, forgive: bool,
                           suspect: bool = False) -> int | None:
        # NOTE: the entries are in the in-flight table, which knows their lanes.
        """`hand_back` tried three times through Redis trouble; None (logged) when every try
        failed, and peers reclaim the entries once their lease lapses."""
        for attempt in range(3):
            try:
                return self.hand_back(entry_ids, forgive=forgive, suspect=suspect)
            except REDIS_ERRORS as e:
                logger.warning("hand-back failed (%s), attempt %d", e, attempt + 1)
                time.sleep(0.2 * (attempt + 1))
        logger.error("could not hand back %d entries: peers reclaim them after the %.1f s lease",
                     len(entry_ids), self.ctx.config.lease_timeout)
        return None

    def _claim_owned(self, entry_ids: list[str], idle_ms: int,
                     lanes: Mapping[str, WorkLane] | None = None) -> tuple[list[str], list[str]]:
        lost: list[str] = []
        orphaned: list[str] = []
        for stream, stream_ids in self._by_stream(entry_ids, lanes).items():
            for i in range(0, len(stream_ids), _SLICE):
                ids = stream_ids[i:i + _SLICE]
                try:
                    result = self.client.fcall(CLAIM_OWNED_FUNCTION, 1, stream,
                                               GROUP, self.worker_id, idle_ms, *ids)
                except redis.ResponseError as exc:
                    if is_missing_function(exc):
                        raise reload_missing(self.client) from None
                    raise
                lost_reply, orphaned_reply = replies.array(result, CLAIM_OWNED_FUNCTION)
                lost.extend(replies.texts(lost_reply, CLAIM_OWNED_FUNCTION))
                orphaned.extend(replies.texts(orphaned_reply, CLAIM_OWNED_FUNCTION))
        return lost, orphaned

    def _by_stream(self, entry_ids: list[str], lanes: Mapping[str, WorkLane] | None
                   ) -> dict[str, list[str]]:
        """Entry ids by the stream they are on: `lanes`, else the in-flight table's record,
        else the queue's own stream."""
        held = self.table.lanes_of(entry_ids)
        streams: dict[str, list[str]] = {}
        for entry_id in entry_ids:
            lane = (lanes or {}).get(entry_id) or held.get(entry_id)
            streams.setdefault(lane.stream if lane else self.queue_key, []).append(entry_id)
        return streams

    def _on_nogroup(self) -> None:
        # The group is gone (Redis restarted without persistence, or someone destroyed it): our
        # entries went with it, so nobody can take them from us; keep running and recreate it.
        logger.log(logging.WARNING if len(self.table) else logging.INFO,
                   "consumer group %s on %s is missing: creating it", GROUP, self.queue_key)
        try:
            self.ensure_group()
        except REDIS_ERRORS as e:
            self.backoff.failed(e)
