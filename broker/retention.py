"""Trimming the request stream: entries every worker is done with are removed.

A request entry must stay while it is undelivered (a worker will read it) or pending (a reclaim
needs its payload: docs/reliability.md, scenario 13). Everything older than both the group's
last-delivered id and its oldest pending entry has been acked, so it goes. Trimming only below the
last-delivered id also keeps `XINFO GROUPS` `lag` computable (an XDEL past it makes Redis
report lag as NULL, which would blind KEDA's scaler).
"""

from __future__ import annotations

import logging

import redis

from llmq.broker import replies
from llmq.broker.keys import GROUP, Keys
from llmq.protocol import parse_entry_id

__all__ = ["trim_acked_requests"]

logger = logging.getLogger(__name__)


def trim_acked_requests(client: redis.Redis, keys: Keys, queue: str,
                        stream: str | None = None) -> int:
    """Remove the request entries of `queue` that were delivered and acked; returns how many.
    `stream`: one of its lane streams (broker/work_lanes.py) instead of its own."""
    key = stream or keys.queue(queue)
    try:
        groups = replies.groups(client.xinfo_groups(key))
    except redis.ResponseError:  # no such stream yet
        return 0
    group = next((g for g in groups if g.name == GROUP), None)
    if group is None:
        return 0
    floor = group.last_delivered_id
    pending = replies.pending_summary(client.xpending(key, GROUP))
    if pending.num_pending and pending.min_id is not None:
        floor = min(floor, pending.min_id, key=parse_entry_id)
    if floor == "0-0":
        return 0
    # NOTE: exact, not `~`: approximate trimming only drops whole radix-tree nodes (100
    # entries), so a small queue would never shrink; an exact MINID trim is cheap enough once
    # a minute.
    removed = replies.integer(client.xtrim(key, minid=floor, approximate=False), "XTRIM")
    if removed:
        logger.debug("trimmed %d acked entries from %s (below %s)", removed, key, floor)
    return removed
