"""AffinityKeeper: the worker's thread for prefix-cache affinity across the pool.

A consumer group hands an entry to whichever worker reads first, so with N workers a shared
prefix (a system prompt, a document asked many questions) is computed on up to N of them and
each cache holds every prefix, which evicts sooner. With affinity, a request goes to the worker
whose cache holds its prefix, and nothing about delivery changes (the entry stays in its request
stream, the queue's own or a lane's; broker/affinity_handover.py):

1. Publish: every REFRESH_S, what this worker's cache holds (landmark hashes, 8 bytes each:
   worker/engine/prefix_landmarks.py) at `llmq:aff:{<queue>}:s:<worker_id>` with the
   heartbeat's TTL, so a dead worker's summary expires with its heartbeat; a draining or
   sleeping worker deletes it (no more hand-overs to it, and peers take its tickets at once).
   The summary also holds LANES_MARK: this worker takes tickets of lane entries (a worker of
   an older release, in a rolling update, takes only the queue stream's and is handed no other).
2. Refresh: every peer's summary and ticket backlog, for the router (worker/affinity_router.py)
   that admission asks once it has tokenized a first delivery (worker/admission.py).
3. Hand over (admission's thread): the entries the router sent to a peer, one function call
   per peer and lane stream.
4. Take: whenever this worker has room, its own tickets first (a new ticket wakes it at once;
   batch lanes' entries only into the room batch work may fill: worker/intake_window.py),
   and when it is idle (room, nothing waiting to start) a peer's tickets older than
   `steal_delay` by the server's clock, or all of a peer's tickets once its summary is gone
   (dead, draining, asleep): affinity never keeps a core idle while work waits, and a dead
   worker's tickets are taken like its pending entries (worker/reclaimer.py takes those too,
   after the heartbeat timeout, whichever comes first).
5. Renew: every `renew_interval`, the leases of the entries its tickets name, so an entry
   waiting for it never lapses into a reclaim.

The stream reader leaves room for the backlog (`reserved`), so a worker takes what was handed
to it before it reads new entries. A taken entry is admitted with its lane, so it runs in its
priority class and is acked, renewed and reclaimed on its own stream.
"""

from __future__ import annotations

import logging
import struct
import time
from collections import Counter
from collections.abc import Callable

import redis

from llmq.broker import replies
from llmq.broker.affinity_handover import AffinityHandover, TakenEntry, Ticket
from llmq.broker.keys import is_valid_name
from llmq.broker.work_lanes import BATCH, INTERACTIVE, WorkLane
from llmq.worker.admission import Admission
from llmq.worker.affinity_router import AffinityRouter, PeerCache, Route
from llmq.worker.backoff import REDIS_ERRORS, TRANSIENT_ERRORS, Backoff
from llmq.worker.engine.config import EngineConfig
from llmq.worker.io_thread import IOThread
from llmq.worker.stream_reader import StreamReader
from llmq.worker.worker_context import WorkerContext

__all__ = ["LANES_MARK", "AffinityKeeper", "choose_tickets", "pack_landmarks", "read_summary",
           "unpack_landmarks"]

logger = logging.getLogger(__name__)

REFRESH_S = 0.5  # publish and read the summaries this often
STEAL_SCAN = 512  # the oldest tickets of a peer looked at for a steal
WAIT_S = 0.25  # the longest the thread sleeps between looks at its tickets and its room
# A landmark no prompt has (b"llmqlane"; a real one matches it with odds of 2**-64), published
# with a worker's landmarks to say that it takes tickets of lane entries. In the summary rather
# than a key of its own: a worker of the previous release reads it as one more landmark.
LANES_MARK = int.from_bytes(b"llmqlane", "little")


def choose_tickets(ripe: list[Ticket], room: int, holds: Callable[[str], bool]
                   ) -> list[Ticket]:
    """What an idle worker steals: tickets of a prefix it holds already, else of the prefix most
    of them are for. Taking one prefix's requests whole moves that prefix here; taking the oldest
    of each would make this cache compute (and hold) every prefix of the peer's."""
    held = [t for t in ripe if holds(t.prefix)]
    if held or not ripe:
        return held[:room]
    counts = Counter(t.prefix for t in ripe)
    top = max(counts, key=lambda prefix: counts[prefix])
    return [t for t in ripe if t.prefix == top][:room]


def pack_landmarks(landmarks: list[int]) -> bytes:
    return struct.pack(f"<{len(landmarks)}Q", *landmarks)


def unpack_landmarks(blob: bytes) -> frozenset[int]:
    """A summary's landmarks; a malformed one (a length not a multiple of 8) counts as empty."""
    if len(blob) % 8:
        return frozenset()
    return frozenset(struct.unpack(f"<{len(blob) // 8}Q", blob))


def read_summary(worker_id: str, blob: bytes, backlog: int) -> PeerCache:
    """A peer's summary: its landmarks, and whether it takes lane entries' tickets."""
    landmarks = unpack_landmarks(blob)
    return PeerCache(worker_id, landmarks - {LANES_MARK}, backlog, LANES_MARK in landmarks)


def is_batch(lane: WorkLane | None) -> bool:
    return lane is not None and lane.priority_class == BATCH


def fit_rooms(tickets: list[Ticket], lanes: Callable[[str], WorkLane | None], room: int,
              batch_room: int) -> list[Ticket]:
    """The tickets, in order, that fit: at most `room`, of them at most `batch_room` of batch
    lanes' entries (`lanes`: the lane a ticket's lane name is)."""
    out: list[Ticket] = []
    for ticket in tickets:
        if len(out) >= room:
            break
        if is_batch(lanes(ticket.lane)):
            if batch_room <= 0:
                continue
            batch_room -= 1
        out.append(ticket)
    return out


class AffinityKeeper(IOThread):
    """`accepting()`: whether this worker takes work now (not draining, not asleep)."""

    def __init__(self, ctx: WorkerContext, admission: Admission, router: AffinityRouter, *,
                 accepting: Callable[[], bool], steal_delay: float) -> None:
        super().__init__("llmq-affinity", ctx)
        self.admission = admission
        self.router = router
        self.accepting = accepting
        self.steal_delay_ms = max(0, int(steal_delay * 1000))
        self.ttl_ms = max(1, int(ctx.config.heartbeat_timeout * 1000))
        assert ctx.config.renew_interval is not None
        self.renew_interval = ctx.config.renew_interval
        self.handover = AffinityHandover(self.keys, ctx.queue)
        self.summary_key = self.keys.affinity_summary(ctx.queue, self.worker_id)
        self.tickets_key = self.keys.affinity_tickets(ctx.queue, self.worker_id)
        self.members_key = self.keys.affinity_members(ctx.queue)
        self.backoff = Backoff("affinity keeper", ctx.state, stop=self.stop_event)
        self._cached: list[int] = []  # the engine's landmarks, set by the busy loop
        self._published: bytes | None = None
        self._backlog = 0  # own tickets at the last refresh
        self._gone: list[str] = []  # peers with tickets and no summary
        self._short_of_room = False  # own tickets wait for batch room (no wake-up by ticket)
        self.num_handed = 0  # entries this worker handed to peers
        self.num_taken = 0  # entries taken from its own tickets
        self.num_stolen = 0  # entries taken from a peer's tickets

    @classmethod
    def attach(cls, ctx: WorkerContext, admission: Admission, reader: StreamReader,
               engine_config: EngineConfig, accepting: Callable[[], bool]) -> AffinityKeeper:
        """The keeper of a worker, hooked into its admission and stream reader."""
        # NOTE: a backlog of a few batches; past it, an overloaded peer's surplus runs here.
        router = AffinityRouter(engine_config.block_size, ctx.config.affinity_min_tokens,
                                max_backlog=4 * engine_config.max_num_seqs)
        keeper = cls(ctx, admission, router, accepting=accepting,
                     steal_delay=ctx.config.affinity_steal_delay)
        admission.affinity = keeper
        reader.reserved = keeper.reserved
        return keeper

    def stop(self) -> None:
        """Stop the thread; delete the summary, so peers hand nothing more here and take the
        tickets left at once."""
        super().stop()
        try:
            self.client.delete(self.summary_key)
        except REDIS_ERRORS:
            pass  # it expires with the heartbeat

    # -- what other threads call ----------------------------------------------------------------

    def note_cache(self, landmarks: list[int]) -> None:
        """The busy loop's snapshot of what the engine's prefix cache holds."""
        self._cached = landmarks

    def reserved(self) -> int:
        """Room the stream reader leaves for entries handed to this worker."""
        return self._backlog if self.accepting() else 0

    def hand_over(self, client: redis.Redis,
                  by_route: dict[tuple[Route, WorkLane | None], list[str]],
                  backoff: Backoff) -> set[str]:
        """Hand entries to peers (on admission's thread, with its connection), by route and
        the lane stream they are on (None: the queue's own); returns those that left this worker
        (handed over, or taken by a peer meanwhile). The rest stay."""
        gone: set[str] = set()
        for ((peer, prefix), lane), entry_ids in by_route.items():
            while True:
                try:
                    moved, lost = self.handover.hand_over(client, self.worker_id, peer,
                                                          f"{prefix:016x}", entry_ids,
                                                          self.router.max_backlog, lane)
                    backoff.succeeded()
                    break
                except TRANSIENT_ERRORS as e:
                    # NOTE: retried, never run here instead: the script may have run before
                    # the connection broke, and a retry finds those entries gone.
                    if backoff.stop is not None and backoff.stop.is_set():
                        moved, lost = [], []
                        break
                    backoff.failed(e)
            if moved:
                logger.debug("handed %d entr%s to %s for its prefix cache", len(moved),
                             "y" if len(moved) == 1 else "ies", peer)
            self.num_handed += len(moved)
            gone.update(moved, lost)
        return gone

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        next_refresh = next_renew = 0.0
        while not self.stop_event.is_set():
            now = time.monotonic()
            try:
                if now >= next_refresh:
                    self._publish_and_refresh()
                    next_refresh = now + REFRESH_S
                if now >= next_renew:
                    self.handover.renew(self.client, self.worker_id)
                    next_renew = now + self.renew_interval
                worked = self._take_work()
                if not worked:
                    self._wait()
                self.backoff.succeeded()
            except TRANSIENT_ERRORS as e:
                self.backoff.failed(e)
            except redis.ResponseError as e:
                logger.error("affinity keeper: Redis refused a command: %s", e)
                self.stop_event.wait(1.0)

    def _publish_and_refresh(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        if self.accepting():
            blob = pack_landmarks([*self.router.own_landmarks(), LANES_MARK])
            if blob != self._published:
                pipe.set(self.summary_key, blob, px=self.ttl_ms)
            else:
                pipe.pexpire(self.summary_key, self.ttl_ms)
            pipe.zadd(self.members_key, {self.worker_id: int(time.time() * 1000)})
            self._published = blob
        else:
            pipe.delete(self.summary_key)
            self._published = None
        pipe.zrange(self.members_key, 0, -1)
        members = [m for m in replies.texts(pipe.execute()[-1], "ZRANGE")
                   if m != self.worker_id and is_valid_name(m)]
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.tickets_key)
        for member in members:
            pipe.get(self.keys.affinity_summary(self.ctx.queue, member))
            pipe.xlen(self.keys.affinity_tickets(self.ctx.queue, member))
        own_backlog, *rows = pipe.execute()
        self._backlog = replies.integer(own_backlog, "XLEN")
        peers, gone = [], []
        for member, blob, backlog in zip(members, rows[0::2], rows[1::2], strict=True):
            summary = replies.optional_blob(blob, "GET")
            num_tickets = replies.integer(backlog, "XLEN")
            if summary is not None:
                peers.append(read_summary(member, summary, num_tickets))
            elif num_tickets:
                gone.append(member)
            else:
                self.handover.forget(self.client, member)
        self._gone = gone
        self.router.update(self._cached, peers)

    def _room(self) -> int:
        return self.ctx.intake.room(len(self.table), self.table.num_not_started())

    def _rooms(self) -> tuple[int, int]:
        """(entries to take now, of which at most this many of batch lanes): batch work
        leaves the interactive headroom free, as the stream reader's does."""
        held, not_started = len(self.table), self.table.num_not_started()
        waiting = self.table.count_lanes(not_started=True)
        _, batch_room = self.ctx.intake.lane_rooms(
            held, not_started, waiting.get(None, 0) + waiting.get(INTERACTIVE, 0))
        room = self.ctx.intake.room(held, not_started)
        return room, min(room, batch_room)

    def _take_work(self) -> bool:
        """Take own tickets, or when idle a peer's; whether any entry was taken."""
        self._short_of_room = False
        if not self.accepting():
            return False
        room, batch_room = self._rooms()
        if room <= 0:
            return False
        # NOTE: past the first `room` when batch room is short: an interactive ticket behind
        # batch ones still fits.
        own = self.handover.tickets(self.client, self.worker_id,
                                    room if batch_room >= room else STEAL_SCAN)
        fitting = fit_rooms(own, self.handover.lane, room, batch_room)
        self._short_of_room = len(fitting) < min(room, len(own))
        taken = self.handover.take(self.client, self.worker_id, self.worker_id, fitting)
        if taken:
            self.num_taken += len(taken)
            self._backlog = max(0, self._backlog - len(taken))
        elif self.table.num_not_started() == 0:
            taken = self._steal(room, batch_room)
        if not taken:
            return False
        self.admission.admit(self.client, [t.entry for t in taken], self.backoff,
                             attempts={t.entry.entry_id: t.attempt for t in taken},
                             forgiven={t.entry.entry_id: t.forgiven for t in taken if t.forgiven},
                             divert=False, lanes={t.entry.entry_id: t.lane for t in taken})
        return True

    def _steal(self, room: int, batch_room: int) -> list[TakenEntry]:
        """A gone peer's tickets, else those of the busiest peer that waited past the delay."""
        candidates = [(peer, -1) for peer in self._gone] + [
            (p.worker_id, self.steal_delay_ms)
            for p in sorted(self.router.peers(), key=lambda p: -p.backlog) if p.backlog]
        for peer, min_age_ms in candidates:
            ripe = [t for t in self.handover.tickets(self.client, peer, STEAL_SCAN)
                    if t.age_ms >= min_age_ms
                    and (batch_room > 0 or not is_batch(self.handover.lane(t.lane)))]
            chosen = fit_rooms(choose_tickets(ripe, room, self._holds), self.handover.lane,
                               room, batch_room)
            taken = self.handover.take(self.client, peer, self.worker_id, chosen)
            if taken:
                self.num_stolen += len(taken)
                logger.info("took %d entr%s waiting for %s%s", len(taken),
                            "y" if len(taken) == 1 else "ies", peer,
                            " (gone)" if min_age_ms < 0 else
                            f" longer than {self.steal_delay_ms} ms")
                return taken
        return []

    def _holds(self, prefix: str) -> bool:
        try:
            return bool(prefix) and self.router.holds(int(prefix, 16))
        except ValueError:
            return False  # not a hand-over's hex landmark: taken like any other

    def _wait(self) -> None:
        """Until a ticket arrives (room to take it), the room changes, or WAIT_S pass."""
        if not self.accepting() or self._room() <= 0 or self._short_of_room:
            self.table.wait_for_change(WAIT_S)
            return
        # NOTE: from 0: returns at once while a ticket waits, else when the next one is added.
        self.client.xread({self.tickets_key: "0-0"}, count=1, block=int(WAIT_S * 1000))
