"""LeaseKeeper: the worker's threads that keep its leases, take over dead peers' work, and beat.

Every `renew_interval` (about lease_timeout / 3), step 1 on the lease-keeper thread and steps
2-4 on the reclaimer thread (so a slow reclaim never delays a renewal):

1. Fence, then renew. One Lua script checks, per in-flight entry, that XPENDING still lists it
   under this consumer and re-claims only those (XCLAIM to itself, min-idle 0, JUSTID: idle
   back to 0, delivery count unchanged). An entry it no longer owns was reclaimed by a peer
   after our lease lapsed (a stall, a partition, a paused process): the engine aborts it and
   nothing more is written for it, so the stale owner stops within one renewal interval
   (RELIABILITY.md #14). Check and claim are one atomic script, so the keeper never steals an
   entry back from the peer that took it.
2. Reclaim. XAUTOCLAIM entries idle past `lease_timeout` (a dead or stalled worker's, or ones a
   draining worker handed back), at most as many as there is room for, and admit them as
   attempt n = their delivery count (XPENDING times_delivered). Admission dead-letters them
   past `max_deliveries` (poison). Entries trimmed away while pending come back from Redis 7's
   XAUTOCLAIM as deleted ids, already out of the PEL: they are dead-lettered (`lost_payload`).
3. Heartbeat: `HSET llmq:w:<worker_id>` (model, queue, running, waiting, KV use, tokens/s) with
   EXPIRE, and the worker registry's `ZADD llmq:workers`.
4. Once a minute: remove dead workers' idle consumers, and trim acked entries from the request
   stream (broker/retention.py) so it does not grow forever.

The same script with a huge IDLE hands entries back on shutdown (`hand_back`): a peer's next
XAUTOCLAIM takes them at once, without waiting for the lease to lapse.

References: Redis streams docs (XPENDING/XCLAIM/XAUTOCLAIM, "recovering from permanent
failures"); the Celery visibility-timeout failure mode that lease renewal avoids.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from llmq.broker.errors import ErrorCode
from llmq.broker.keys import GROUP
from llmq.broker.protocol import as_str
from llmq.broker.retention import trim_acked_requests
from llmq.worker.admission import Admission
from llmq.worker.backoff import TRANSIENT_ERRORS, Backoff
from llmq.worker.inbox import AbortRequests
from llmq.worker.result_writer import EntryWrite, ResultWriter
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)

# KEYS[1] request stream; ARGV: group, consumer, idle ms, entry ids...
# Re-claims (with the given IDLE) the entries still pending under this consumer. Returns
# {lost, orphaned}: lost = pending under another consumer, or acked while the entry still exists
# (a peer took it over); orphaned = neither pending nor in the stream (the stream and group were
# lost with a Redis restart without persistence: nobody else can have it).
_CLAIM_OWNED = """
local owned, lost, orphaned = {}, {}, {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    owned[#owned + 1] = ARGV[i]
  elseif p[1] or #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i]) > 0 then
    lost[#lost + 1] = ARGV[i]
  else
    orphaned[#orphaned + 1] = ARGV[i]
  end
end
if #owned > 0 then
  local args = {KEYS[1], ARGV[1], ARGV[2], 0}
  for _, id in ipairs(owned) do args[#args + 1] = id end
  args[#args + 1] = 'IDLE'
  args[#args + 1] = ARGV[3]
  args[#args + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(args))
end
return {lost, orphaned}
"""
# Lua's unpack has a stack limit in the thousands: renew in slices well below it.
_SLICE = 500
# Idle set on handed-back entries: far past any lease, yet below the server's clock in ms
# (XCLAIM resets a delivery time before the epoch to "now", which would be idle 0).
HAND_BACK_IDLE_MS = 10**10
# The hand-back counts outlive any entry's stay in the PEL; acked entries' counts are deleted.
HANDBACK_TTL_S = 7 * 24 * 3600
# Idle consumers with nothing pending are removed after this long (dead workers' names).
CONSUMER_CLEANUP_IDLE_MS = 10 * 60 * 1000


class LeaseKeeper:
    """`heartbeat()` gives the fields of this worker's heartbeat hash; `ensure_group()`
    recreates the consumer group when Redis lost it."""

    def __init__(self, ctx: WorkerContext, admission: Admission, writer: ResultWriter, *,
                 heartbeat: Callable[[], dict[str, str]],
                 ensure_group: Callable[[], None]) -> None:
        config = ctx.config
        assert config.renew_interval is not None and config.claim_interval is not None
        self.ctx = ctx
        self.client = ctx.connect()
        self.keys = ctx.keys
        self.queue_key = ctx.queue_key
        self.worker_id = ctx.worker_id
        self.table = ctx.table
        self.admission = admission
        self.writer = writer
        self.lease_ms = int(config.lease_timeout * 1000)
        self.renew_interval = config.renew_interval
        self.claim_interval = config.claim_interval
        self.heartbeat = heartbeat
        self.ensure_group = ensure_group
        self.heartbeat_ttl = max(10, int(3 * max(self.renew_interval, 1.0)))
        self.stop_event = threading.Event()
        self.reclaiming = True  # off while draining: a draining worker takes nothing new
        self.backoff = Backoff("lease keeper", ctx.state, stop=self.stop_event)
        self.reclaim_backoff = Backoff("reclaimer", ctx.state, stop=self.stop_event)
        self._script = self.client.register_script(_CLAIM_OWNED)
        self._cursor = "0-0"
        self._next_claim = 0.0
        self._next_cleanup = time.monotonic() + 60.0
        # NOTE: two threads: renewals must never wait behind a reclaim, whose admission
        # tokenizes (and chat-templates) up to max_num_seqs prompts; a late renewal lets peers
        # take live work.
        self._threads = [
            threading.Thread(target=self._loop, args=(self._renew_once, self.backoff),
                             name="llmq-lease-keeper", daemon=True),
            threading.Thread(target=self._loop, args=(self._maintain_once, self.reclaim_backoff),
                             name="llmq-reclaimer", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def is_alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self._threads:
            thread.join(timeout=10)

    # -- the threads ------------------------------------------------------------------------------

    def _renew_once(self, _started: float) -> None:
        self.renew()

    def _maintain_once(self, started: float) -> None:
        if self.reclaiming and started >= self._next_claim:
            self._next_claim = started + self.claim_interval
            self.reclaim()
        self.beat()
        if started >= self._next_cleanup:
            self._next_cleanup = started + 60.0
            self._cleanup_consumers()
            trim_acked_requests(self.client, self.keys, self.ctx.queue)

    def _loop(self, work: Callable[[float], None], backoff: Backoff) -> None:
        while not self.stop_event.is_set():
            started = time.monotonic()
            try:
                work(started)
                backoff.succeeded()
            except TRANSIENT_ERRORS as e:
                backoff.failed(e)
                continue
            except redis.ResponseError as e:
                if "NOGROUP" in str(e):
                    self._on_nogroup()
                else:
                    logger.error("lease keeper: Redis refused a command: %s", e)
                    self.stop_event.wait(self.renew_interval)
                continue
            self.stop_event.wait(max(0.0, self.renew_interval - (time.monotonic() - started)))

    # -- 1. fence and renew -----------------------------------------------------------------------

    def renew(self) -> list[str]:
        """Renew every live in-flight entry; fence and abort the ones a peer took. Returns those."""
        entry_ids = self.table.live_entry_ids()
        lost, orphaned = self._claim_owned(entry_ids, idle_ms=0)
        if orphaned:
            self.table.orphan(orphaned)
            logger.warning("%d in-flight entries vanished with the request stream (Redis lost "
                           "its data?): finishing them without a lease", len(orphaned))
        # NOTE: an entry acked (and forgotten) by the result writer while the script ran is
        # "not pending" too; only entries still in the table were really taken.
        fenced = self.table.fence([e for e in lost if self.table.get(e) is not None
                                   and not self.table.get(e).terminal])  # type: ignore[union-attr]
        if fenced:
            logger.warning("lease lost on %d entr%s (a peer reclaimed them): aborting %s",
                           len(fenced), "y" if len(fenced) == 1 else "ies", fenced[:5])
            self.ctx.inbox.put(AbortRequests(fenced))
        return fenced

    def hand_back(self, entry_ids: list[str], *, forgive: bool = False) -> int:
        """Make entries instantly reclaimable by peers (shutdown); returns how many were ours.

        With `forgive` (a drain, not a failure) each is also counted in `llmq:hb:<queue>`, so
        the delivery it used up is not held against it as poison."""
        lost, orphaned = self._claim_owned(entry_ids, HAND_BACK_IDLE_MS)
        owned = sorted(set(entry_ids) - set(lost) - set(orphaned))
        if owned and forgive:
            key = self.keys.handbacks(self.ctx.queue)
            pipe = self.client.pipeline(transaction=False)
            for entry_id in owned:
                pipe.hincrby(key, entry_id, 1)
            pipe.expire(key, HANDBACK_TTL_S)
            pipe.execute()
        return len(owned)

    def hand_back_retrying(self, entry_ids: list[str], *, forgive: bool) -> int | None:
        """`hand_back` tried three times through Redis trouble; None (logged) when every try
        failed, and peers reclaim the entries once their lease lapses."""
        for attempt in range(3):
            try:
                return self.hand_back(entry_ids, forgive=forgive)
            except (redis.RedisError, *TRANSIENT_ERRORS) as e:  # type: ignore[misc]
                logger.warning("hand-back failed (%s), attempt %d", e, attempt + 1)
                time.sleep(0.2 * (attempt + 1))
        logger.error("could not hand back %d entries: peers reclaim them after the %.1f s lease",
                     len(entry_ids), self.ctx.config.lease_timeout)
        return None

    def _claim_owned(self, entry_ids: list[str], idle_ms: int) -> tuple[list[str], list[str]]:
        lost: list[str] = []
        orphaned: list[str] = []
        for i in range(0, len(entry_ids), _SLICE):
            ids = entry_ids[i:i + _SLICE]
            result = self._script(keys=[self.queue_key],
                                  args=[GROUP, self.worker_id, idle_ms, *ids])
            lost.extend(as_str(r) for r in result[0])
            orphaned.extend(as_str(r) for r in result[1])
        return lost, orphaned

    # -- 2. reclaim -------------------------------------------------------------------------------

    def reclaim(self) -> int:
        """Take over entries idle past the lease; returns how many were admitted."""
        room = self.ctx.max_num_seqs - len(self.table)
        if room <= 0:
            return 0
        reply = self.client.xautoclaim(self.queue_key, GROUP, self.worker_id, self.lease_ms,
                                       start_id=self._cursor, count=room)
        next_cursor, claimed = reply[0], reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        self._cursor = as_str(next_cursor)
        if deleted:
            self._dead_letter_deleted([as_str(d) for d in deleted])
        if not claimed:
            return 0
        ids = [as_str(i) for i, _ in claimed]
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xpending_range(self.queue_key, GROUP, min=entry_id, max=entry_id, count=1)
        pipe.hmget(self.keys.handbacks(self.ctx.queue), ids)
        *pendings, handbacks = pipe.execute()
        attempts = {}
        for entry_id, pending in zip(ids, pendings, strict=True):
            # NOTE: XAUTOCLAIM just counted this delivery, so times_delivered is this attempt.
            attempts[entry_id] = int(pending[0]["times_delivered"]) if pending else 1
        forgiven = {entry_id: int(n) for entry_id, n in zip(ids, handbacks, strict=True) if n}
        logger.warning("reclaimed %d entr%s idle past the %d ms lease: %s", len(ids),
                       "y" if len(ids) == 1 else "ies", self.lease_ms,
                       ", ".join(f"{i} (attempt {attempts[i]})" for i in ids[:5]))
        if self.ctx.metrics is not None:
            self.ctx.metrics.inc_reclaimed(len(ids))
        return self.admission.admit(self.client, claimed, self.reclaim_backoff, attempts,
                                    forgiven)

    def _dead_letter_deleted(self, entry_ids: list[str]) -> None:
        # NOTE: the payload is gone, so the request id is unknown (the producer may have given
        # its own): keep a dead letter for operators; Redis already dropped it from the PEL.
        message = "the entry was trimmed or deleted from the request stream while pending"
        code = ErrorCode.LOST_PAYLOAD
        logger.warning("%d pending entries lost their payload: %s", len(entry_ids), entry_ids[:5])
        for entry_id in entry_ids:
            self.writer.put(EntryWrite(
                entry_id, None, "json", [], ack=True, pop=False,
                dead_letter=self.admission.dead_letter(entry_id, None, code, message, 0, None)))

    # -- 3. heartbeat -----------------------------------------------------------------------------

    def beat(self) -> None:
        now_ms = int(time.time() * 1000)
        fields = self.heartbeat()
        key = self.keys.worker(self.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, self.heartbeat_ttl)
        pipe.zadd(self.keys.workers(), {self.worker_id: now_ms})
        pipe.execute()

    def _cleanup_consumers(self) -> None:
        """Delete consumers of dead workers: nothing pending and idle for a long time."""
        for consumer in self.client.xinfo_consumers(self.queue_key, GROUP):
            name = as_str(consumer["name"])
            if (name != self.worker_id and int(consumer["pending"]) == 0
                    and int(consumer["idle"]) > CONSUMER_CLEANUP_IDLE_MS):
                # NOTE: harmless even if that worker lives: XREADGROUP recreates its consumer.
                self.client.xgroup_delconsumer(self.queue_key, GROUP, name)
                logger.info("removed idle consumer %s", name)

    def _on_nogroup(self) -> None:
        # The group is gone (Redis restarted without persistence, or someone destroyed it): our
        # entries went with it, so nobody can take them from us; keep running and recreate it.
        logger.log(logging.WARNING if len(self.table) else logging.INFO,
                   "consumer group %s on %s is missing: creating it", GROUP, self.queue_key)
        try:
            self.ensure_group()
        except (redis.RedisError, *TRANSIENT_ERRORS) as e:  # type: ignore[misc]
            self.backoff.failed(e)

