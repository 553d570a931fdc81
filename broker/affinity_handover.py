"""AffinityHandover: moving a request entry to the worker whose prefix cache holds its prefix.

The entry never leaves its request stream (the queue's own, or the lane stream it was submitted
to: broker/work_lanes.py): ownership in a consumer group is the PEL, so a hand-over is `XCLAIM
<entry> <target> JUSTID` on that stream (the target now owns it; its delivery count is
unchanged, so the hop is no attempt) plus a *ticket* on the target's stream
`llmq:aff:{<queue>}:t:<target>` that names it, and names its lane (`lane`, absent for the
queue's own stream). The entry id, its request id, its idempotency marker and its submission
record all stay what they were, so a plain XADD producer, `llmq result` and the reclaimer see
nothing new, and the taker admits it with its lane (priority class, acks, renewals and reclaim
on its own stream). Every step is one function of the llmq library (the code below, loaded with
the rest by the admin: broker/functions.py), called with one request stream as its first key:

- HAND_OVER (the reader that decided): per entry still pending under it, XCLAIM to the target
  and XADD its ticket, unless the target has no summary (dead, draining, asleep) or its ticket
  backlog is full: then the reader keeps the entry and runs it itself.
- TAKE (the target itself, or an idle peer, naming tickets of one lane it read): XDEL a
  ticket, and only if that deleted it (a ticket is taken once) and the entry is still pending
  under the ticket's owner and still in the stream, XCLAIM it to the taker (JUSTID) and return
  its fields. Ticket ids are the server's milliseconds at the hand-over: a peer takes only
  tickets older than its delay, or every ticket once the owner is gone.
- RENEW (the owner, every lease renewal, once per lane its tickets name): XCLAIM to itself
  (JUSTID, idle 0) the entries its tickets name that are still its own, dropping tickets of
  entries that are not, so entries waiting for it never lapse into a reclaim (a new attempt).

Each function reads the lane off its stream key (`...}:<lane>`, as the lane submit function
does) and touches only the tickets of that lane: it moves entries within the stream it was
given, and a ticket of another lane stays (neither taken, renewed nor dropped) for a call that
names its stream. Every key is in the queue's slot, also a tenant's lane stream
(`llmq:t:q:{<queue>}:<lane>:<tenant>` is tagged with the queue, as the tickets are), so one
ticket stream per worker serves all the queue's lanes, in a cluster too.

What the functions cannot see is covered by what already exists: an entry whose ticket was lost
is pending under a worker that does not renew it, so it is reclaimed after the lease
(worker/reclaimer.py); an entry deleted while pending is left to the reclaimer's
`lost_payload` answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import redis

from llmq.broker import replies
from llmq.broker.keys import GROUP, Keys
from llmq.broker.library_part import script_function
from llmq.broker.replies import StreamEntry
from llmq.broker.work_lanes import WorkLane, lane_from_name, work_lane

__all__ = ["LIBRARY_PART", "AffinityHandover", "TakenEntry", "Ticket"]

HAND_OVER_FUNCTION = "llmq_aff_hand_over"
TAKE_FUNCTION = "llmq_aff_take"
RENEW_FUNCTION = "llmq_aff_renew"
FORGET_FUNCTION = "llmq_aff_forget"

# The lane of a request stream key (`llmq:q:{<queue>}:batch` -> `batch`, a tenant's
# `llmq:t:q:{<queue>}:batch:acme` -> `batch:acme`), '' for the queue's own `llmq:q:{<queue>}`;
# and the lane a ticket names ('' when it has no `lane` field: the queue's own stream, as every
# ticket of library version 4 was).
_LANE_HELPERS = """
local function aff_lane_of(key)
  return string.match(key, '}:([^{}]+)$') or ''
end
local function aff_ticket(fields)
  local id, lane = nil, ''
  for j = 1, #fields, 2 do
    if fields[j] == 'entry' then id = fields[j + 1] end
    if fields[j] == 'lane' then lane = fields[j + 1] end
  end
  return id, lane
end
"""

# KEYS: request stream (the queue's or a lane's), target's tickets, target's summary
# ARGV: group, source consumer, target consumer, max backlog, prefix, entry ids...
# -> {moved ids, lost ids}: lost = no longer pending under the source (a peer took it).
_HAND_OVER = """
local moved, lost = {}, {}
local lane = aff_lane_of(KEYS[1])
local open = redis.call('EXISTS', KEYS[3]) == 1
local backlog = redis.call('XLEN', KEYS[2])
for i = 6, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if not (p[1] and p[1][2] == ARGV[2]) then
    lost[#lost + 1] = id
  elseif open and backlog < tonumber(ARGV[4]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, id, 'JUSTID')
    if lane == '' then
      redis.call('XADD', KEYS[2], '*', 'entry', id, 'prefix', ARGV[5], 'from', ARGV[2])
    else
      redis.call('XADD', KEYS[2], '*', 'entry', id, 'prefix', ARGV[5], 'from', ARGV[2],
                 'lane', lane)
    end
    backlog = backlog + 1
    moved[#moved + 1] = id
  end
end
return {moved, lost}
"""

# KEYS: request stream (the tickets' lane's), owner's tickets, hand-back counts
# ARGV: group, owner consumer, taker consumer, ticket ids...
# -> {{entry id, delivery count, hand-backs, field, value, ...}, ...}
# A ticket of another lane than KEYS[1]'s stays (a caller of library version 4 names the
# queue's own stream for every ticket: it must neither take nor drop a lane's).
_TAKE = """
local out = {}
local lane = aff_lane_of(KEYS[1])
for i = 4, #ARGV do
  local ticket = redis.call('XRANGE', KEYS[2], ARGV[i], ARGV[i])[1]
  local id, ticket_lane
  if ticket then id, ticket_lane = aff_ticket(ticket[2]) end
  if ticket and ticket_lane == lane and redis.call('XDEL', KEYS[2], ARGV[i]) == 1 and id then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
    local e = redis.call('XRANGE', KEYS[1], id, id)
    if p[1] and p[1][2] == ARGV[2] and e[1] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, id, 'JUSTID')
      local row = {id, p[1][4], redis.call('HMGET', KEYS[3], id)[1] or '0'}
      for _, v in ipairs(e[1][2]) do row[#row + 1] = v end
      out[#out + 1] = row
    end
  end
end
return out
"""

# KEYS: request stream, owner's tickets; ARGV: group, owner consumer -> entries renewed
# Only the tickets of KEYS[1]'s lane: the owner calls it once per lane its tickets name.
_RENEW = """
local renewed = 0
local lane = aff_lane_of(KEYS[1])
for _, ticket in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
  local id, ticket_lane = aff_ticket(ticket[2])
  if ticket_lane == lane then
    local p = id and redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
    if p and p[1] and p[1][2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
      renewed = renewed + 1
    else
      redis.call('XDEL', KEYS[2], ticket[1])
    end
  end
end
return renewed
"""

# KEYS: a worker's summary, its tickets, the members; ARGV: the worker
# A worker with neither summary nor tickets left leaves the members (1), else stays (0).
_FORGET = """
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('XLEN', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 1
end
return 0
"""


# The hand-over's part of the llmq function library (broker/functions.py appends it): the worker
# user may FCALL these and run no code of its own.
LIBRARY_PART = _LANE_HELPERS + "".join(script_function(name, body) for name, body in (
    (HAND_OVER_FUNCTION, _HAND_OVER), (TAKE_FUNCTION, _TAKE), (RENEW_FUNCTION, _RENEW),
    (FORGET_FUNCTION, _FORGET)))


class Ticket(NamedTuple):
    ticket_id: str
    entry_id: str
    prefix: str  # the landmark (hex) the hand-over was for: tickets of one prefix go together
    age_ms: int  # by the server's clock
    lane: str = ""  # the name of the lane stream the entry is on ("": the queue's own)


class TakenEntry(NamedTuple):
    entry: StreamEntry  # the request entry, now pending under the taker
    attempt: int  # its delivery count (a hand-over or a take adds none)
    forgiven: int  # its drain hand-backs (llmq:hb:{<queue>})
    lane: WorkLane  # the stream it is on: the taker admits it with this lane


class AffinityHandover:
    """The functions' calls for one queue; each call names the connection it runs on."""

    def __init__(self, keys: Keys, queue: str) -> None:
        self.keys = keys
        self.queue = queue
        self.queue_lane = work_lane(keys, queue)

    def lane(self, name: str) -> WorkLane | None:
        """The lane a ticket names; None for a name that is no lane of this queue's."""
        return self.queue_lane if not name else lane_from_name(self.keys, self.queue, name)

    def hand_over(self, client: redis.Redis, source: str, target: str, prefix: str,
                  entry_ids: list[str], max_backlog: int, lane: WorkLane | None = None
                  ) -> tuple[list[str], list[str]]:
        """(moved, lost) of `entry_ids`, pending under `source` on `lane`'s stream (default the
        queue's own), handed to `target` for the `prefix` its cache holds; the rest stay with
        `source` (the target is gone or its backlog is full)."""
        stream = (lane or self.queue_lane).stream
        reply = client.fcall(HAND_OVER_FUNCTION, 3, stream,
                             self.keys.affinity_tickets(self.queue, target),
                             self.keys.affinity_summary(self.queue, target),
                             GROUP, source, target, max_backlog, prefix, *entry_ids)
        moved, lost = replies.array(reply, "the hand-over function")
        return (replies.texts(moved, "the hand-over function"),
                replies.texts(lost, "the hand-over function"))

    def tickets(self, client: redis.Redis, owner: str, count: int) -> list[Ticket]:
        """The oldest `count` tickets of `owner` (read only: `take` decides)."""
        # NOTE: two round trips, not one pipeline: a cluster client refuses TIME in a pipeline
        # (it has no key to route by); any node's clock does for a delay of a second.
        now_ms = replies.server_time_ms(client.time())
        raw = client.xrange(self.keys.affinity_tickets(self.queue, owner), count=count)
        out = []
        for ticket_id, fields in replies.entries(raw, "XRANGE"):
            entry_id = fields.get("entry")
            if entry_id is None:
                continue  # not a ticket: `take` drops it
            age_ms = now_ms - int(ticket_id.partition("-")[0])
            out.append(Ticket(ticket_id, entry_id.decode(), fields.get("prefix", b"").decode(),
                              age_ms, fields.get("lane", b"").decode()))
        return out

    def take(self, client: redis.Redis, owner: str, taker: str,
             tickets: Sequence[Ticket]) -> list[TakenEntry]:
        """The entries these tickets of `owner` name, claimed for `taker` on their lanes'
        streams (one call per lane); each ticket is taken once (whoever deletes it), and only
        while its entry is still `owner`'s."""
        by_lane: dict[str, list[str]] = {}
        for ticket in tickets:
            by_lane.setdefault(ticket.lane, []).append(ticket.ticket_id)
        taken = []
        for name, ticket_ids in by_lane.items():
            lane = self.lane(name)
            if lane is None:
                # NOTE: no lane of this queue's, so no function call can take it: dropped, or
                # it would wake its owner for ever.
                client.xdel(self.keys.affinity_tickets(self.queue, owner), *ticket_ids)
                continue
            reply = client.fcall(TAKE_FUNCTION, 3, lane.stream,
                                 self.keys.affinity_tickets(self.queue, owner),
                                 self.keys.handbacks(self.queue), GROUP, owner, taker,
                                 *ticket_ids)
            for raw in replies.array(reply, "the take function"):
                row = replies.array(raw, "the take function")
                entry_id = replies.text(row[0], "the take function")
                fields = {replies.text(name, TAKE_FUNCTION): replies.blob(value, TAKE_FUNCTION)
                          for name, value in zip(row[3::2], row[4::2], strict=True)}
                taken.append(TakenEntry(StreamEntry(entry_id, fields),
                                        replies.integer(row[1], "the take function"),
                                        int(replies.text(row[2], "the take function") or 0),
                                        lane))
        return taken

    def renew(self, client: redis.Redis, owner: str) -> int:
        """Keep the leases of the entries waiting in `owner`'s tickets; how many. One call per
        lane the tickets name (the queue's own stream always: it drops what is no ticket)."""
        raw = client.xrange(self.keys.affinity_tickets(self.queue, owner))
        names = {""} | {fields.get("lane", b"").decode()
                        for _, fields in replies.entries(raw, "XRANGE")}
        renewed = 0
        for name in sorted(names):
            # NOTE: a ticket on a lane this call does not name stays, and is renewed at the
            # next renewal (the hand-over's XCLAIM reset its idle time just now).
            if (lane := self.lane(name)) is not None:
                renewed += replies.integer(client.fcall(
                    RENEW_FUNCTION, 2, lane.stream,
                    self.keys.affinity_tickets(self.queue, owner), GROUP, owner),
                    "the renew function")
        return renewed

    def forget(self, client: redis.Redis, worker_id: str) -> bool:
        """Drop a worker from the members once it has neither summary nor tickets."""
        return bool(replies.integer(client.fcall(
            FORGET_FUNCTION, 3, self.keys.affinity_summary(self.queue, worker_id),
            self.keys.affinity_tickets(self.queue, worker_id),
            self.keys.affinity_members(self.queue), worker_id), "the forget function"))
