"""StreamReader: the worker's input thread; new requests from the consumer groups of the lanes.

After vLLM v1's EngineCoreProc input thread (socket -> decode -> queue for the busy loop) on
Redis consumer groups, one per lane stream of the queue (broker/work_lanes.py; the queue's own
stream is the interactive lane of producers without a tenant):

    XREADGROUP GROUP workers <worker_id> COUNT <n> STREAMS <lane streams with credit> > > ...

Interactive lanes first, then batch lanes in what room is left; within a class, tenants' lanes
in weighted fair shares of tokens (deficit round robin, worker/fair_share.py). Room is what the
engine can start within a step or two, less what it holds that has not started, and never more
than max_num_seqs - entries in flight; batch work also leaves the interactive headroom free
(worker/intake_window.py). While entries wait unread and peers read the same queue, it holds no
more than an even part of what the queue's groups hold (worker/even_share.py, from XINFO GROUPS
and XINFO CONSUMERS at most every OBSERVE_S, and only when it holds or would hold more than its
intake window). With no room it reads nothing, so unread work stays with the groups for idle
peers and the groups' lag is a true scaling signal (KEDA's redis-streams scaler reads it). With
nothing to read it blocks on every lane there is room for. What it reads goes through
`Admission`, with the lane each entry came from.

On NOGROUP (a fresh queue, or Redis restarted without persistence) it creates the group with
MKSTREAM at id 0 (so entries a producer added before any worker existed are delivered) and goes
on. After `stop()` it issues no new XREADGROUP and a read blocking at that moment is woken
(CLIENT UNBLOCK); entries a racing read still returns are handed straight back (XCLAIM with a
huge IDLE) for a peer to take.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from llmq.broker import replies
from llmq.broker.connection import is_cluster
from llmq.broker.keys import GROUP
from llmq.broker.replies import StreamEntry
from llmq.broker.work_lanes import BATCH, INTERACTIVE, PriorityClass, WorkLane
from llmq.worker.admission import Admission
from llmq.worker.backoff import REDIS_ERRORS, TRANSIENT_ERRORS, Backoff
from llmq.worker.even_share import EvenShare
from llmq.worker.fair_share import FairShare, entry_cost, parse_weights
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)

# While batch work waits for room, a blocking read on the interactive lanes alone is this short.
BATCH_RECHECK_MS = 50
# Batch entries read (and admitted: tokenized) at most per pass, so an interactive entry that
# arrives meanwhile waits for a few admissions, not for a whole window's.
BATCH_READ_MAX = 8
# The queue's groups are read for the even share at most this often.
OBSERVE_S = 0.1


class StreamReader:
    """`ensure_group()` creates the consumer group when there is none; `hand_back(entry_ids,
    forgive=True)` gives entries read after a stop straight back to peers."""

    def __init__(self, ctx: WorkerContext, admission: Admission, *,
                 ensure_group: Callable[[], None], hand_back: Callable[..., int]) -> None:
        self.ctx = ctx
        self.client = ctx.connect()
        self.queue_key = ctx.queue_key
        self.worker_id = ctx.worker_id
        self.table = ctx.table
        self.admission = admission
        self.intake = ctx.intake
        self.block_ms = ctx.config.read_block_ms
        self.ensure_group = ensure_group
        self.hand_back = hand_back
        # Room left for entries peers handed to this worker (worker/affinity_keeper.py).
        self.reserved: Callable[[], int] = lambda: 0
        self.stop_event = threading.Event()
        self.awake = threading.Event()  # cleared while the worker sleeps: no reads
        self.awake.set()
        self.backoff = Backoff("stream reader", ctx.state, stop=self.stop_event)
        self.num_read = 0
        weights = parse_weights(ctx.config.tenant_weights)
        self.shares = {INTERACTIVE: FairShare(weights), BATCH: FairShare(weights)}
        self.batch_left_unread = False  # the last read found no room for batch work
        self.even_share = EvenShare()
        self._next_observe = 0.0
        self._client_id: int | None = None
        self._thread = threading.Thread(target=self._run, name="llmq-stream-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, admin: redis.Redis | None = None) -> None:
        """No XREADGROUP is issued after this returns. With `admin` (another connection), one
        that is blocking right now is woken with CLIENT UNBLOCK, so it cannot take entries a
        peer should get; entries a racing read still returns are handed back."""
        self.stop_event.set()
        self.unblock(admin)

    def pause(self) -> None:
        """Read nothing until `resume()` (a sleeping worker); a read racing this is handed back.
        Follow with `unblock` on another thread to wake a read blocking now."""
        self.awake.clear()

    def resume(self) -> None:
        self.awake.set()

    def unblock(self, admin: redis.Redis | None) -> None:
        """Wake a read blocking right now with CLIENT UNBLOCK on `admin` (another connection)."""
        client_id = self._client_id
        if admin is not None and client_id:
            try:
                admin.client_unblock(client_id)
            except REDIS_ERRORS:
                pass  # NOPERM under a strict ACL, or Redis away: the hand-back covers it

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            if not self.awake.is_set():
                self.awake.wait(0.5)
                continue
            interactive_room, batch_room = self._rooms()
            if interactive_room <= 0 and batch_room <= 0:
                self.table.wait_for_change(timeout=0.5)
                continue
            try:
                if self._client_id is None:
                    self._client_id = self._fetch_client_id()
                self.ctx.lanes.refresh(self.client)
                read = self._read_lanes(interactive_room, batch_room)
                if not read:
                    read = self._read_blocking(interactive_room, batch_room)
                    if read:
                        # NOTE: Redis wakes a blocked reader after the first XADD of a
                        # producer's pipeline, so a batch submitted at once would otherwise
                        # reach the engine one entry first and the rest a step later; taking
                        # them together lets their prefills share the first step.
                        read += self._read_lanes(*self._rooms(len(read)))
                self.backoff.succeeded()
            except TRANSIENT_ERRORS as e:
                self._client_id = None  # a new connection comes with a new id
                self.backoff.failed(e)
                continue
            except redis.ResponseError as e:
                # NOGROUP: no group (yet, or any more). UNBLOCKED: the stream was deleted while
                # we waited on it (Redis 7 wakes blocked readers with this error).
                if "NOGROUP" not in str(e) and "UNBLOCKED" not in str(e):
                    logger.error("XREADGROUP refused: %s", e)
                    self.stop_event.wait(1.0)
                    continue
                self.ctx.lanes.groups_lost()
                try:
                    self.ensure_group()
                except REDIS_ERRORS as e2:
                    self.backoff.failed(e2)
                continue
            if not read:
                continue
            entries = [entry for _, entry in read]
            lanes = {entry.entry_id: lane for lane, entry in read}
            if self.stop_event.is_set():
                self._hand_back_late(entries, lanes)
                return
            if not self.awake.is_set():
                self._hand_back_late(entries, lanes)
                continue
            self.num_read += len(entries)
            self.admission.admit(self.client, entries, self.backoff, lanes=lanes)

    def _rooms(self, just_read: int = 0) -> tuple[int, int]:
        """(interactive, batch) entries to read now (worker/intake_window.py), less
        `just_read` entries read but not admitted yet, within this worker's even share of the
        queue (worker/even_share.py)."""
        waiting = self.table.count_lanes(not_started=True)
        interactive_waiting = waiting.get(None, 0) + waiting.get(INTERACTIVE, 0)
        num_held = len(self.table) + just_read
        interactive, batch = self.intake.lane_rooms(
            num_held, sum(waiting.values()) + just_read, interactive_waiting + just_read)
        # NOTE: seats kept for entries peers hand this worker for its cache (cache affinity)
        reserved = self.reserved()
        interactive, batch = interactive - reserved, batch - reserved
        # NOTE: the share never binds below the intake window: then no need to ask Redis
        if self.ctx.config.even_share and num_held + max(interactive, batch) > self.intake.window:
            self._observe_queue(just_read)
            share = self.even_share.room(num_held, floor=self.intake.window)
            if share is not None:
                interactive, batch = min(interactive, share), min(batch, share)
        return self.intake.per_read(interactive), self.intake.per_read(batch)

    def _observe_queue(self, just_read: int) -> None:
        """Feed the even share what the queue's groups hold and how many live workers read
        them (at most every OBSERVE_S; alone, without asking Redis)."""
        live = self.ctx.live_worker_ids
        if not live - {self.worker_id}:
            self.even_share.observe(num_workers=1, lag=0, pending=0, group_reads=0, own_reads=0)
            return
        now = time.monotonic()
        if now < self._next_observe:
            return
        self._next_observe = now + OBSERVE_S
        lanes = self.ctx.lanes.all()
        pipe = self.client.pipeline(transaction=False)
        pipe.xinfo_consumers(self.queue_key, GROUP)
        for lane in lanes:
            pipe.xinfo_groups(lane.stream)
        try:
            consumers, *lane_groups = pipe.execute(raise_on_error=False)
        except REDIS_ERRORS:
            # NOTE: no share rather than a stale one; the read that follows meets the same
            # trouble and backs off.
            self.even_share.observe(num_workers=1, lag=None, pending=0, group_reads=None,
                                    own_reads=0)
            return
        if isinstance(consumers, redis.ResponseError):
            readers = {self.worker_id}  # NOGROUP: the reader recreates it on its next read
        else:
            readers = {c.name for c in replies.consumers(consumers)} | {self.worker_id}
        lag: int | None = 0
        pending = 0
        group_reads: int | None = 0
        for reply in lane_groups:
            if isinstance(reply, redis.ResponseError) or (
                    group := replies.group(reply, GROUP)) is None:
                continue  # a lane whose group is gone holds nothing to share
            lag = None if lag is None or group.lag is None else lag + group.lag
            pending += group.pending
            group_reads = (None if group_reads is None or group.entries_read is None
                           else group_reads + group.entries_read)
        # NOTE: a live worker that has not read this queue yet is not a consumer of it: leaving
        # it out only makes this worker's share larger, never leaves work unread.
        num_workers = len(readers & (live | {self.worker_id}))
        self.even_share.observe(num_workers=num_workers, lag=lag, pending=pending,
                                group_reads=group_reads, own_reads=self.num_read + just_read,
                                step_s=self.intake.longest_step_s)

    def _read_lanes(self, interactive_room: int, batch_room: int
                    ) -> list[tuple[WorkLane, StreamEntry]]:
        """Without blocking: interactive lanes first, then batch lanes in what room is left,
        each lane's tenants in fair shares (worker/fair_share.py)."""
        read = self._read_fair(INTERACTIVE, self.ctx.lanes.interactive(), interactive_room)
        batch_room = min(batch_room - len(read), BATCH_READ_MAX)  # read ones take seats too
        self.batch_left_unread = batch_room <= 0
        if batch_room > 0:
            read += self._read_fair(BATCH, self.ctx.lanes.batch(), batch_room)
        return read

    def _read_fair(self, priority_class: PriorityClass, lanes: list[WorkLane], room: int
                   ) -> list[tuple[WorkLane, StreamEntry]]:
        """Up to `room` entries of one class's lanes, by deficit round robin over tenants: each
        round reads a few entries from every lane with credit left, in one XREADGROUP, and
        charges what they cost; a lane found empty drops out."""
        shares = self.shares[priority_class]
        by_tenant = {lane.tenant or "": lane for lane in lanes}
        active = list(by_tenant)
        read: list[tuple[WorkLane, StreamEntry]] = []
        while room > 0 and active:
            chosen = shares.eligible(active)[:room]
            count = max(1, room // len(chosen))
            reply = self.client.xreadgroup(
                GROUP, self.worker_id, {by_tenant[t].stream: ">" for t in chosen}, count=count)
            got = dict(replies.read_streams(reply, "XREADGROUP"))
            for tenant in chosen:
                lane = by_tenant[tenant]
                entries = got.get(lane.stream, [])
                if not entries:
                    shares.emptied(tenant)
                    active.remove(tenant)
                    continue
                for entry in entries:
                    shares.charge(tenant, entry_cost(entry.entry_id, entry.fields))
                    read.append((lane, entry))
                room -= len(entries)
        return read

    def _read_blocking(self, interactive_room: int, batch_room: int
                       ) -> list[tuple[WorkLane, StreamEntry]]:
        """Wait for the next entry on any lane there is room for, one per lane at most."""
        lanes = self.ctx.lanes.interactive() if interactive_room > 0 else []
        if batch_room > 0:
            lanes += self.ctx.lanes.batch()
        block_ms = self.block_ms
        if batch_room <= 0 and self.batch_left_unread:
            # NOTE: batch work may wait for room that opens while this read blocks on the
            # interactive lanes alone: look again soon.
            block_ms = min(block_ms, BATCH_RECHECK_MS)
        if not lanes:
            self.table.wait_for_change(timeout=block_ms / 1000.0)
            return []
        by_stream = {lane.stream: lane for lane in lanes}
        reply = self.client.xreadgroup(GROUP, self.worker_id, dict.fromkeys(by_stream, ">"),
                                       count=1, block=block_ms)
        return [(by_stream[key], entry)
                for key, entries in replies.read_streams(reply, "XREADGROUP")
                for entry in entries if key in by_stream]

    def _fetch_client_id(self) -> int:
        """This connection's id, for CLIENT UNBLOCK on stop; 0 when the ACL does not allow
        CLIENT ID (then a read racing the stop is handed back instead)."""
        # NOTE: only this thread uses this client, so its pool holds one connection and this
        # id is the one the XREADGROUP after it blocks on. A cluster client keeps a pool per
        # node: the id would name some other connection, so none (the hand-back covers it).
        if is_cluster(self.client):
            return 0
        try:
            return replies.integer(self.client.client_id(), "CLIENT ID")
        except redis.ResponseError as e:
            logger.info("CLIENT ID refused (%s): a stop will not interrupt a blocking read", e)
            return 0

    def _hand_back_late(self, entries: list[StreamEntry], lanes: dict[str, WorkLane]) -> None:
        ids = [entry.entry_id for entry in entries]
        for _ in range(3):
            try:
                self.hand_back(ids, forgive=True, lanes=lanes)  # never started: no failure
                logger.info("handed back %d entries read after a stop or sleep", len(ids))
                return
            except TRANSIENT_ERRORS as e:
                self.backoff.failed(e)
        logger.warning("could not hand back %d entries: peers reclaim them after the lease",
                       len(ids))

