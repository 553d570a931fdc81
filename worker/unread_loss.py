"""UnreadLoss: requests trimmed from the queue before any worker read them, made visible.

Anyone who may XADD to a queue may add `MAXLEN 0` (or `MINID <now>`) and so trim every entry
still waiting: an ACL cannot restrict XADD's arguments (docs/operations.md). The submit
function's entries are answered `lost_payload` from their records (worker/reclaimer.py); a raw
XADD's cannot be named, so nobody would ever hear of them. This counts them all instead.

Redis keeps two counters that a trim does not touch: the stream's `entries-added` and the
consumer group's `entries-read`; XINFO GROUPS reports their difference as `lag`. When the group
has read everything in the stream (no entry after its last-delivered id), that lag is exactly
the number of entries that left the stream unread. (An XDEL past the last-delivered id makes
Redis report no lag at all: then nothing is counted, and trimming below it, broker/retention.py,
is done only with delivered entries.)

The total reported so far is kept in `llmq:lost:{<queue>}` and swapped with SET ... GET, so of
the workers that look at the same moment only one reports each loss: a dead-letter record (no
payload, no request id), the `llmq_entries_lost_unread` metric, an error in its log, and the
total in `llmq status`.
"""

from __future__ import annotations

import logging
import time

import redis

from llmq import protocol
from llmq.broker import replies
from llmq.broker.commands import as_fields
from llmq.broker.keys import GROUP
from llmq.protocol.errors import ErrorCode
from llmq.worker.worker_context import WorkerContext

__all__ = ["UnreadLoss"]

logger = logging.getLogger(__name__)


class UnreadLoss:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.queue_key = ctx.keys.queue(ctx.queue)
        self.total_key = ctx.keys.lost_unread(ctx.queue)

    def lost_so_far(self, client: redis.Redis) -> tuple[int, str] | None:
        """(entries ever trimmed from the queue unread, the group's last-delivered id); None
        when Redis cannot tell now (entries wait after the last delivery, or an XDEL blinded
        the counters)."""
        delivered = replies.group(client.xinfo_groups(self.queue_key), GROUP)
        if delivered is None:
            return None
        # NOTE: checked again in one transaction with the look past it: if no delivery moved
        # the group meanwhile, the lag and "nothing after it" are one snapshot.
        pipe = client.pipeline(transaction=True)
        pipe.xinfo_groups(self.queue_key)
        pipe.xrange(self.queue_key, f"({delivered.last_delivered_id}", "+", count=1)
        groups_reply, after = pipe.execute()
        group = replies.group(groups_reply, GROUP)
        if (group is None or group.lag is None
                or group.last_delivered_id != delivered.last_delivered_id
                or replies.entries(after, "XRANGE")):
            return None
        return group.lag, group.last_delivered_id

    def check(self, client: redis.Redis) -> int:
        """Report entries trimmed unread since the last report; returns how many were new."""
        seen = self.lost_so_far(client)
        if seen is None:
            return 0
        total, last_delivered = seen
        before = replies.optional_text(client.set(self.total_key, total, get=True), "SET GET")
        reported = int(before) if before and before.isdigit() else 0
        new = total - reported
        if new <= 0:
            return 0  # known already (or the stream was recreated: its count starts again)
        message = (f"{new} request entr{'y was' if new == 1 else 'ies were'} trimmed from "
                   f"{self.queue_key} before any worker read {'it' if new == 1 else 'them'} "
                   f"({total} in all): someone with XADD or XTRIM on the queue trimmed it "
                   "(`XADD ... MAXLEN 0`, `XTRIM`). Requests submitted through the submit "
                   "function are answered lost_payload; raw XADDs cannot be named, and their "
                   "producers are not told")
        logger.error("%s", message)
        # NOTE: no request id, no payload: only that they were added after this delivery.
        letter = protocol.DeadLetter(
            queue=self.ctx.queue, entry_id=last_delivered, request_id=None,
            code=ErrorCode.LOST_PAYLOAD, message=message, deliveries=0,
            worker=self.ctx.worker_id, at_ms=int(time.time() * 1000))
        client.xadd(self.ctx.keys.dlq(self.ctx.queue),
                    as_fields(protocol.encode_dead_letter(letter, None)))
        if self.ctx.metrics is not None:
            self.ctx.metrics.inc_lost_unread(new)
            self.ctx.metrics.inc_dead_letters(1)
        return new
