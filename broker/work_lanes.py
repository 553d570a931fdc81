"""WorkLane: the stream of a queue a request waits on, by priority class and tenant.

A queue has two priority classes, `interactive` (chat, completions: someone waits for the first
token) and `batch` (the Batch API, `llmq batch`, `llmq submit -f`, `llmq run`: throughput, not
latency), and within each, one stream per tenant, so that a worker can see tenant B's requests
without reading past the 4,000 tenant A queued first (docs/protocol.md, section 3a):

    interactive, no tenant   llmq:q:{<queue>}                      (a plain XADD lands here)
    interactive, tenant t    llmq:t:q:{<queue>}:interactive:<t>
    batch, no tenant         llmq:q:{<queue>}:batch
    batch, tenant t          llmq:t:q:{<queue>}:batch:<t>

A tenant's lanes are under `llmq:t:` as its ids' keys are, so ACL globs tell them apart
(broker/tenant_acl.py). Each lane stream has its own submission records
(`llmq:sub:{<queue>}:batch`, `llmq:t:sub:{<queue>}:<lane>:<t>`); dead letters,
hand-back counts, markers and cancellations stay the queue's. Every key is in the queue's slot.
The submit function (`llmq_submit_lane`, broker/functions.py) gives lane entries ids that are
unique across all of a queue's streams (`<ms>-<k * LANE_SEQ_BASE + c>`: k the lane's number, c
a per-millisecond count shared by the queue's lanes; the queue stream's own `*` ids stay below
LANE_SEQ_BASE), so an entry id names one entry of the queue whichever stream holds it, as
everything keyed by entry id (in-flight tables, hand-back counts, id-less result streams)
assumes, and an XADD by hand to a lane (its `*` id continues from the lane's last) stays in that
lane's range. It records each lane's number in `llmq:lanes:{<queue>}`, where workers find the
lanes to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmq.broker.keys import Keys, is_valid_tenant, tenant_of

__all__ = ["BATCH", "COUNT_FIELD", "INTERACTIVE", "LANE_SEQ_BASE", "LAST_FIELD",
           "MAX_LANE_NUMBER", "PRIORITY_CLASSES",
           "PriorityClass", "WorkLane", "lane_for_request", "lane_from_name", "work_lane"]

INTERACTIVE: Literal["interactive"] = "interactive"
BATCH: Literal["batch"] = "batch"
PriorityClass = Literal["interactive", "batch"]
PRIORITY_CLASSES: tuple[PriorityClass, ...] = (INTERACTIVE, BATCH)
# 2**40: lane k's entry ids are `<ms>-<k * 2**40 + c>`. The queue stream's `*` ids count from 0
# within each millisecond and would need a trillion entries in one to get past it.
LANE_SEQ_BASE = 1 << 40
# Lane numbers stay below 2**13, so k * 2**40 + c is exact in Lua's doubles (2**53).
MAX_LANE_NUMBER = (1 << 13) - 1
# Fields of llmq:lanes:{<queue>} besides the lanes' (no lane is named so): the last lane id's
# `<ms>-<c>`, and how many lane numbers were given out.
LAST_FIELD = "last"
COUNT_FIELD = "count"


@dataclass(frozen=True)
class WorkLane:
    queue: str
    priority_class: PriorityClass
    tenant: str | None
    stream: str  # the request stream's key
    submissions: str  # its submission records' key

    @property
    def name(self) -> str:
        """`batch`, `batch:<tenant>`, `interactive:<tenant>`; "" for the queue's own stream."""
        if self.priority_class == INTERACTIVE and self.tenant is None:
            return ""
        return self.priority_class + (f":{self.tenant}" if self.tenant else "")

    @property
    def is_queue_stream(self) -> bool:
        return self.name == ""

    @property
    def label(self) -> str:
        """How status tables name it: `interactive`, `batch`, `batch:acme`..."""
        return self.name or INTERACTIVE


def work_lane(keys: Keys, queue: str, priority_class: PriorityClass | None = None,
              tenant: str | None = None) -> WorkLane:
    """The lane of a request of `priority_class` (default interactive) from `tenant`."""
    cls: PriorityClass = priority_class or INTERACTIVE
    if cls not in PRIORITY_CLASSES:
        raise ValueError(f"invalid lane {cls!r}: interactive or batch")
    if tenant is not None and not is_valid_tenant(tenant):
        raise ValueError(f"invalid tenant {tenant!r:.60}")
    if cls == INTERACTIVE and tenant is None:
        return WorkLane(queue, cls, None, keys.queue(queue), keys.submissions(queue))
    name = cls + (f":{tenant}" if tenant else "")
    return WorkLane(queue, cls, tenant, keys.lane_stream(queue, name),
                    keys.lane_submissions(queue, name))


def lane_for_request(keys: Keys, queue: str, priority_class: PriorityClass | None,
                     request_id: str | None) -> WorkLane:
    """The lane a submission goes to: its class, and the tenant its id names (if any)."""
    return work_lane(keys, queue, priority_class,
                     tenant_of(request_id) if request_id is not None else None)


def lane_from_name(keys: Keys, queue: str, name: str) -> WorkLane | None:
    """The lane a field of llmq:lanes:{<queue>} names; None for anything else (the `last`
    field, or a name someone who may submit wrote by hand)."""
    cls, _, tenant = name.partition(":")
    if cls not in PRIORITY_CLASSES or (tenant and not is_valid_tenant(tenant)):
        return None
    if cls == INTERACTIVE and not tenant:
        return None  # the queue's own stream is never registered
    lane_class: PriorityClass = INTERACTIVE if cls == INTERACTIVE else BATCH
    return work_lane(keys, queue, lane_class, tenant or None)
