"""ACK_SCRIPT: a batch's dead letters and acks, in the request stream's slot, as one script.

The result writer (worker/result_writer.py) runs it after the batch's events: in the same
MULTI/EXEC on one server, on its own on a cluster once the events are on their nodes. It acks
only the entries still pending under this worker (a fence: see the NOTE on ACK_SCRIPT), and
returns the ones a peer owns now, which the writer logs and leaves to that peer.
"""

from __future__ import annotations

from typing import Any

from llmq.broker.keys import GROUP

__all__ = ["ACK_SCRIPT", "ACK_SLICE", "ack_calls", "ack_script_args"]

# Dead letters added, then XACK of the entries still pending under this consumer and their
# hand-back counts deleted, and the submit function's record of those and of entries no longer
# pending at all; returns the ids a peer owns now.
#   KEYS[1] request stream   KEYS[2] hand-back counts   KEYS[3] dead-letter stream
#   KEYS[4] submissions
#   ARGV[1] group   ARGV[2] consumer   ARGV[3] n   ARGV[4 .. 3+n] entry ids
#   then each dead letter: its number of fields k, then k field / value pairs
# NOTE: a plain XACK removes an entry from the PEL whoever owns it: a stalled worker finishing
# late would ack the entry a peer reclaimed and is running as the next attempt, which then could
# never be reclaimed again if that peer died. Its late terminal event (a lower attempt) is
# harmless: readers follow the highest attempt.
ACK_SCRIPT = """
local n = tonumber(ARGV[3])
local i = 4 + n
while i <= #ARGV do
  local k = tonumber(ARGV[i])
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, i + 1, i + 2 * k))
  i = i + 1 + 2 * k
end
local mine, taken, done = {}, {}, {}
for j = 4, 3 + n do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[j], ARGV[j], 1)
  if p[1] then
    if p[1][2] == ARGV[2] then
      mine[#mine + 1] = ARGV[j]
      done[#done + 1] = ARGV[j]
    else
      taken[#taken + 1] = ARGV[j]
    end
  else
    done[#done + 1] = ARGV[j]
  end
end
if #mine > 0 then
  redis.call('XACK', KEYS[1], ARGV[1], unpack(mine))
  redis.call('HDEL', KEYS[2], unpack(mine))
end
if #done > 0 then redis.call('HDEL', KEYS[4], unpack(done)) end
return taken
"""
# Lua's unpack has a stack limit in the thousands: ack in slices well below it.
ACK_SLICE = 500


def ack_script_args(consumer: str, entry_ids: list[str],
                    dead_letters: list[dict[str, bytes]]) -> list[Any]:
    """ACK_SCRIPT's ARGV."""
    args: list[Any] = [GROUP, consumer, len(entry_ids), *entry_ids]
    for fields in dead_letters:
        args.append(len(fields))
        for name, value in fields.items():
            args += [name, value]
    return args


def ack_calls(keys: list[str], consumer: str, ack_ids: list[str],
              dead_letters: list[dict[str, bytes]]) -> list[tuple[list[str], list[Any]]]:
    """ACK_SCRIPT's (keys, args) for a batch's acks and dead letters, in slices of ACK_SLICE
    acks (the dead letters go with the first); none when there is nothing to ack or add.
    `keys`: the request stream, hand-back counts, dead-letter stream and submissions keys."""
    calls = []
    for start in range(0, max(len(ack_ids), 1), ACK_SLICE):
        ids = ack_ids[start:start + ACK_SLICE]
        letters = dead_letters if start == 0 else []
        if not ids and not letters:
            break
        calls.append((keys, ack_script_args(consumer, ids, letters)))
    return calls
