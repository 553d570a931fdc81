"""LaneRegistry: the streams of the worker's queue, its own and every lane stream.

The queue's own stream (interactive work without a tenant, and every plain XADD) is always
there; lane streams (broker/work_lanes.py) are those the submit function recorded in
llmq:lanes:{<queue>}. The registry reads that hash at most every REFRESH_S seconds and creates
the consumer group of each new lane (XGROUP CREATE at id 0 with MKSTREAM, as for the queue's
stream: entries added before the group are still delivered). Everything that reads, renews,
acks or reclaims entries finds their stream here (the lane an in-flight entry came from is kept
on it: worker/inflight_table.py).

A name in the hash that is no lane's (someone who may submit may write it) is skipped, and at
most MAX_LANES lanes are followed, so a flood of made-up tenants cannot make every worker scan
without end.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from llmq.broker import replies
from llmq.broker.keys import GROUP, Keys
from llmq.broker.work_lanes import (
    BATCH,
    INTERACTIVE,
    PriorityClass,
    WorkLane,
    lane_from_name,
    work_lane,
)

__all__ = ["MAX_LANES", "REFRESH_S", "LaneRegistry"]

logger = logging.getLogger(__name__)

REFRESH_S = 1.0
MAX_LANES = 1024


class LaneRegistry:
    def __init__(self, keys: Keys, queue: str) -> None:
        self.keys = keys
        self.queue = queue
        self.queue_lane = work_lane(keys, queue)
        self._lanes: dict[str, WorkLane] = {"": self.queue_lane}
        self._grouped: set[str] = {""}  # the queue's own group is the worker's ensure_group's
        self._lock = threading.Lock()
        self._next_refresh = 0.0
        self._warned_full = False

    def all(self) -> list[WorkLane]:
        """The lanes whose consumer group exists (the queue's own always counts)."""
        with self._lock:
            return [lane for name, lane in self._lanes.items() if name in self._grouped]

    def of_class(self, priority_class: PriorityClass) -> list[WorkLane]:
        return [lane for lane in self.all() if lane.priority_class == priority_class]

    def interactive(self) -> list[WorkLane]:
        return self.of_class(INTERACTIVE)

    def batch(self) -> list[WorkLane]:
        return self.of_class(BATCH)

    def groups_lost(self) -> None:
        """NOGROUP on some lane: create every lane's group again at the next refresh."""
        with self._lock:
            self._grouped = {""}
            self._next_refresh = 0.0

    def refresh(self, client: redis.Redis, *, force: bool = False) -> list[WorkLane]:
        """Read the lanes the submit function recorded (at most every REFRESH_S unless
        `force`), create the groups of new ones; returns every lane."""
        now = time.monotonic()
        with self._lock:
            due = force or now >= self._next_refresh
            if due:
                self._next_refresh = now + REFRESH_S
        if not due:
            return self.all()
        names = replies.texts(client.hkeys(self.keys.lanes(self.queue)), "HKEYS")
        found: dict[str, WorkLane] = {}
        for name in sorted(names):
            if name in self._lanes:
                continue
            lane = lane_from_name(self.keys, self.queue, name)
            if lane is not None:
                found[name] = lane
        with self._lock:
            room = MAX_LANES - len(self._lanes)
            if len(found) > room and not self._warned_full:
                self._warned_full = True
                logger.error("llmq:lanes of %s names more than %d lanes: following the first "
                             "%d only", self.queue, MAX_LANES, MAX_LANES)
            for name in list(found)[:max(0, room)]:
                self._lanes[name] = found[name]
            ungrouped = [lane for name, lane in self._lanes.items() if name not in self._grouped]
        if ungrouped:
            self._create_groups(client, ungrouped)
        return self.all()

    def _create_groups(self, client: redis.Redis, lanes: list[WorkLane]) -> None:
        pipe = client.pipeline(transaction=False)
        for lane in lanes:
            pipe.xgroup_create(lane.stream, GROUP, id="0", mkstream=True)
        results = pipe.execute(raise_on_error=False)
        for lane, result in zip(lanes, results, strict=True):
            if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
                logger.error("cannot create the consumer group of %s: %s", lane.stream, result)
                continue
            if not isinstance(result, Exception):
                logger.info("following lane %s (%s)", lane.label, lane.stream)
            with self._lock:
                self._grouped.add(lane.name)
