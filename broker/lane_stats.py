"""LaneStats: the backlog and progress of each lane stream of a queue (`llmq status`).

One row per stream of the queue (its own, and each lane the submit function recorded in
llmq:lanes:{<queue>}, broker/work_lanes.py): its length, the group's lag (entries no worker has
read: the backlog), pending (read, not acked: running) and entries read so far. Entries done
are `entries_read - pending`; two snapshots give a lane's throughput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmq.broker import replies
from llmq.broker.keys import GROUP, Keys
from llmq.broker.work_lanes import WorkLane, lane_from_name, work_lane

__all__ = ["LaneStats", "lane_stats_reads", "parse_lane_stats", "queue_lanes"]


@dataclass(frozen=True)
class LaneStats:
    queue: str
    lane: str  # `interactive`, `batch`, `batch:acme`...
    priority_class: str
    tenant: str | None
    length: int
    backlog: int  # entries no worker has read (the group's lag; the length without a group)
    pending: int  # read by a worker, not acked yet
    entries_read: int | None  # delivered so far; None when the server cannot tell

    @property
    def done(self) -> int | None:
        return None if self.entries_read is None else max(0, self.entries_read - self.pending)


def queue_lanes(keys: Keys, queue: str, lane_names: list[str]) -> list[WorkLane]:
    """The queue's own stream and the lanes HKEYS llmq:lanes:{<queue>} named."""
    lanes = [work_lane(keys, queue)]
    for name in sorted(lane_names):
        if (lane := lane_from_name(keys, queue, name)) is not None:
            lanes.append(lane)
    return lanes


def lane_stats_reads(pipe: Any, lanes: list[WorkLane]) -> None:
    """Queue XLEN and XINFO GROUPS of each lane; execute with raise_on_error=False."""
    for lane in lanes:
        pipe.xlen(lane.stream)
        pipe.xinfo_groups(lane.stream)


def parse_lane_stats(lanes: list[WorkLane], results: list[Any]) -> list[LaneStats]:
    stats = []
    for lane, length, groups in zip(lanes, results[0::2], results[1::2], strict=True):
        if isinstance(length, Exception):
            raise length
        num = replies.integer(length, "XLEN")
        group = None if isinstance(groups, Exception) else replies.group(groups, GROUP)
        backlog = num if group is None or group.lag is None else group.lag
        stats.append(LaneStats(lane.queue, lane.label, lane.priority_class, lane.tenant, num,
                               backlog, group.pending if group else 0,
                               group.entries_read if group else 0))
    return stats
