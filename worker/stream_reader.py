"""StreamReader: the worker's input thread; new requests from the consumer group.

After vLLM v1's EngineCoreProc input thread (socket -> decode -> queue for the busy loop) on a
Redis consumer group:

    XREADGROUP GROUP workers <worker_id> COUNT <room> BLOCK <ms> STREAMS llmq:q:{<queue>} >

where room is what the engine can start within a step or two, less what it holds that has not
started, and never more than max_num_seqs - entries in flight (worker/intake_window.py). With no
room it reads nothing, so unread work stays with the group for idle peers and the group's lag is
a true scaling signal (KEDA's redis-streams scaler reads it). What it reads goes through
`Admission`.

On NOGROUP (a fresh queue, or Redis restarted without persistence) it creates the group with
MKSTREAM at id 0 (so entries a producer added before any worker existed are delivered) and goes
on. After `stop()` it issues no new XREADGROUP and a read blocking at that moment is woken
(CLIENT UNBLOCK); entries a racing read still returns are handed straight back (XCLAIM with a
huge IDLE) for a peer to take.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from llmq.broker import replies
from llmq.broker.connection import is_cluster
from llmq.broker.keys import GROUP
from llmq.broker.replies import StreamEntry
from llmq.worker.admission import Admission
from llmq.worker.backoff import REDIS_ERRORS, TRANSIENT_ERRORS, Backoff
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)


class StreamReader:
    """`ensure_group()` creates the consumer group when there is none; `hand_back(entry_ids,
    forgive=True)` gives entries read after a stop straight back to peers."""

    def __init__(self, ctx: WorkerContext, admission: Admission, *,
                 ensure_group: Callable[[], None], hand_back: Callable[..., int]) -> None:
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
            room = self.intake.room(len(self.table), self.table.num_not_started()) \
                - self.reserved()
            if room <= 0:
                self.table.wait_for_change(timeout=0.5)
                continue
            try:
                if self._client_id is None:
                    self._client_id = self._fetch_client_id()
                reply = self.client.xreadgroup(GROUP, self.worker_id, {self.queue_key: ">"},
                                               count=room, block=self.block_ms)
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
                try:
                    self.ensure_group()
                except REDIS_ERRORS as e2:
                    self.backoff.failed(e2)
                continue
            # NOTE: one stream per read; RESP2 and RESP3 (`?protocol=3` URLs) shapes both parse.
            entries = replies.read_entries(reply, "XREADGROUP")
            if not entries:
                continue
            entries += self._read_more(room - len(entries))
            if self.stop_event.is_set():
                self._hand_back_late(entries)
                return
            if not self.awake.is_set():
                self._hand_back_late(entries)
                continue
            self.num_read += len(entries)
            self.admission.admit(self.client, entries, self.backoff)

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

    def _read_more(self, room: int) -> list[StreamEntry]:
        """Entries already queued behind the ones a blocking read returned, without blocking.

        NOTE: Redis wakes a blocked reader after the first XADD of a producer's pipeline, so a
        batch submitted at once would otherwise reach the engine one entry first and the rest a
        step later; taking them together lets their prefills share the first step.
        """
        more: list[StreamEntry] = []
        while room > 0:
            try:
                reply = self.client.xreadgroup(GROUP, self.worker_id, {self.queue_key: ">"},
                                               count=room)
            except REDIS_ERRORS:
                break  # the blocking loop deals with it; what was read is admitted
            got = replies.read_entries(reply, "XREADGROUP")
            if not got:
                break
            more += got
            room -= len(got)
        return more

    def _hand_back_late(self, entries: list[StreamEntry]) -> None:
        ids = [entry.entry_id for entry in entries]
        for _ in range(3):
            try:
                self.hand_back(ids, forgive=True)  # never started: no failure
                logger.info("handed back %d entries read after a stop or sleep", len(ids))
                return
            except TRANSIENT_ERRORS as e:
                self.backoff.failed(e)
        logger.warning("could not hand back %d entries: peers reclaim them after the lease",
                       len(ids))

