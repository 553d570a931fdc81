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

from llmq.broker.keys import GROUP, Keys
from llmq.protocol import as_str, parse_entry_id

__all__ = ["trim_acked_requests"]

logger = logging.getLogger(__name__)


def trim_acked_requests(client: redis.Redis, keys: Keys, queue: str) -> int:
    """Remove the request entries of `queue` that were delivered and acked; returns how many."""
    key = keys.queue(queue)
    try:
        groups = client.xinfo_groups(key)
    except redis.ResponseError:  # no such stream yet
        return 0
    group = next((g for g in groups if as_str(g["name"]) == GROUP), None)
    if group is None:
        return 0
    floor = as_str(group["last-delivered-id"])
    pending = client.xpending(key, GROUP)
    if pending["pending"]:
        floor = min(floor, as_str(pending["min"]), key=parse_entry_id)
    if floor == "0-0":
        return 0
    # NOTE: exact, not `~`: approximate trimming only drops whole radix-tree nodes (100
    # entries), so a small queue would never shrink; an exact MINID trim is cheap enough once
    # a minute.
    removed = int(client.xtrim(key, minid=floor, approximate=False))
    if removed:
        logger.debug("trimmed %d acked entries from %s (below %s)", removed, key, floor)
    return removed
