"""AffinityHandover: moving a request entry to the worker whose prefix cache holds its prefix.

The entry never leaves the request stream: ownership in a consumer group is the PEL, so a
hand-over is `XCLAIM <entry> <target> JUSTID` (the target now owns it; its delivery count is
unchanged, so the hop is no attempt) plus a *ticket* on the target's stream
`llmq:aff:{<queue>}:t:<target>` that names it. The entry id, its request id, its idempotency
marker and its submission record all stay what they were, so a plain XADD producer, `llmq
result` and the reclaimer see nothing new. Every step is one function of the llmq library
(the code below, loaded with the rest by the admin: broker/functions.py), in the queue's slot:

- HAND_OVER (the reader that decided): per entry still pending under it, XCLAIM to the target
  and XADD its ticket, unless the target has no summary (dead, draining, asleep) or its ticket
  backlog is full: then the reader keeps the entry and runs it itself.
- TAKE (the target itself, or an idle peer, naming tickets it read): XDEL a ticket, and only
  if that deleted it (a ticket is taken once) and the entry is still pending under the
  ticket's owner and still in the stream, XCLAIM it to the taker (JUSTID) and return its
  fields. Ticket ids are the server's milliseconds at the hand-over: a peer takes only tickets
  older than its delay, or every ticket once the owner is gone.
- RENEW (the owner, every lease renewal): XCLAIM to itself (JUSTID, idle 0) the entries its
  tickets name that are still its own, dropping tickets of entries that are not, so entries
  waiting for it never lapse into a reclaim (a new attempt).

What the functions cannot see is covered by what already exists: an entry whose ticket was lost
is pending under a worker that does not renew it, so it is reclaimed after the lease
(worker/reclaimer.py); an entry deleted while pending is left to the reclaimer's
`lost_payload` answer.
"""

from __future__ import annotations

from typing import NamedTuple

import redis

from llmq.broker import replies
from llmq.broker.keys import GROUP, Keys
from llmq.broker.replies import StreamEntry

__all__ = ["LIBRARY_PART", "AffinityHandover", "TakenEntry", "Ticket"]

HAND_OVER_FUNCTION = "llmq_aff_hand_over"
TAKE_FUNCTION = "llmq_aff_take"
RENEW_FUNCTION = "llmq_aff_renew"
FORGET_FUNCTION = "llmq_aff_forget"

# KEYS: request stream, target's tickets, target's summary
# ARGV: group, source consumer, target consumer, max backlog, prefix, entry ids...
# -> {moved ids, lost ids}: lost = no longer pending under the source (a peer took it).
_HAND_OVER = """
local moved, lost = {}, {}
local open = redis.call('EXISTS', KEYS[3]) == 1
local backlog = redis.call('XLEN', KEYS[2])
for i = 6, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if not (p[1] and p[1][2] == ARGV[2]) then
    lost[#lost + 1] = id
  elseif open and backlog < tonumber(ARGV[4]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, id, 'JUSTID')
    redis.call('XADD', KEYS[2], '*', 'entry', id, 'prefix', ARGV[5], 'from', ARGV[2])
    backlog = backlog + 1
    moved[#moved + 1] = id
  end
end
return {moved, lost}
"""

# KEYS: request stream, owner's tickets, hand-back counts
# ARGV: group, owner consumer, taker consumer, ticket ids...
# -> {{entry id, delivery count, hand-backs, field, value, ...}, ...}
_TAKE = """
local out = {}
for i = 4, #ARGV do
  local ticket = redis.call('XRANGE', KEYS[2], ARGV[i], ARGV[i])[1]
  local id
  if ticket then
    for j = 1, #ticket[2], 2 do
      if ticket[2][j] == 'entry' then id = ticket[2][j + 1] end
    end
  end
  if ticket and redis.call('XDEL', KEYS[2], ARGV[i]) == 1 and id then
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
_RENEW = """
local renewed = 0
for _, ticket in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
  local id
  for j = 1, #ticket[2], 2 do
    if ticket[2][j] == 'entry' then id = ticket[2][j + 1] end
  end
  local p = id and redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if p and p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    renewed = renewed + 1
  else
    redis.call('XDEL', KEYS[2], ticket[1])
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


def _function(name: str, body: str) -> str:
    # NOTE: the bodies read KEYS and ARGV, as scripts do: the callback's parameters take those
    # names.
    return f"redis.register_function('{name}', function(KEYS, ARGV)\n{body}end)\n"


# The hand-over's part of the llmq function library (broker/functions.py appends it): the worker
# user may FCALL these and run no code of its own.
LIBRARY_PART = "".join(_function(name, body) for name, body in (
    (HAND_OVER_FUNCTION, _HAND_OVER), (TAKE_FUNCTION, _TAKE), (RENEW_FUNCTION, _RENEW),
    (FORGET_FUNCTION, _FORGET)))


class Ticket(NamedTuple):
    ticket_id: str
    entry_id: str
    prefix: str  # the landmark (hex) the hand-over was for: tickets of one prefix go together
    age_ms: int  # by the server's clock


class TakenEntry(NamedTuple):
    entry: StreamEntry  # the request entry, now pending under the taker
    attempt: int  # its delivery count (a hand-over or a take adds none)
    forgiven: int  # its drain hand-backs (llmq:hb:{<queue>})


class AffinityHandover:
    """The functions' calls for one queue; each call names the connection it runs on."""

    def __init__(self, keys: Keys, queue: str) -> None:
        self.keys = keys
        self.queue = queue
        self.queue_key = keys.queue(queue)

    def hand_over(self, client: redis.Redis, source: str, target: str, prefix: str,
                  entry_ids: list[str], max_backlog: int) -> tuple[list[str], list[str]]:
        """(moved, lost) of `entry_ids`, pending under `source`, handed to `target` for the
        `prefix` its cache holds; the rest stay with `source` (the target is gone or its
        backlog is full)."""
        reply = client.fcall(HAND_OVER_FUNCTION, 3, self.queue_key,
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
                              age_ms))
        return out

    def take(self, client: redis.Redis, owner: str, taker: str,
             ticket_ids: list[str]) -> list[TakenEntry]:
        """The entries these tickets of `owner` name, claimed for `taker`; each ticket is
        taken once (whoever deletes it), and only while its entry is still `owner`'s."""
        if not ticket_ids:
            return []
        reply = client.fcall(TAKE_FUNCTION, 3, self.queue_key,
                             self.keys.affinity_tickets(self.queue, owner),
                             self.keys.handbacks(self.queue), GROUP, owner, taker, *ticket_ids)
        taken = []
        for raw in replies.array(reply, "the take function"):
            row = replies.array(raw, "the take function")
            entry_id = replies.text(row[0], "the take function")
            fields = {replies.text(name, TAKE_FUNCTION): replies.blob(value, TAKE_FUNCTION)
                      for name, value in zip(row[3::2], row[4::2], strict=True)}
            taken.append(TakenEntry(StreamEntry(entry_id, fields),
                                    replies.integer(row[1], "the take function"),
                                    int(replies.text(row[2], "the take function") or 0)))
        return taken

    def renew(self, client: redis.Redis, owner: str) -> int:
        """Keep the leases of the entries waiting in `owner`'s tickets; how many."""
        return replies.integer(client.fcall(
            RENEW_FUNCTION, 2, self.queue_key, self.keys.affinity_tickets(self.queue, owner),
            GROUP, owner), "the renew function")

    def forget(self, client: redis.Redis, worker_id: str) -> bool:
        """Drop a worker from the members once it has neither summary nor tickets."""
        return bool(replies.integer(client.fcall(
            FORGET_FUNCTION, 3, self.keys.affinity_summary(self.queue, worker_id),
            self.keys.affinity_tickets(self.queue, worker_id),
            self.keys.affinity_members(self.queue), worker_id), "the forget function"))
