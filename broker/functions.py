"""The llmq Redis Function library: all the server-side code llmq runs, and how it gets loaded.

Producers submit with `FCALL llmq_submit`, the gateway retries dead letters with `FCALL
llmq_retry`, and workers ack (`llmq_ack`) and renew their leases (`llmq_claim_owned`) through
it, never with scripts of their own: no llmq user needs EVAL, SCRIPT or FUNCTION LOAD (a user
with them could run any loop it likes and freeze the server, or replace llmq's code), and every
submission is an `XADD <queue> * <field> <payload>`: a `*` id and no trimming, whatever the
producer would have written. The library is loaded by the admin at deploy (`llmq admin
load-functions`: compose's and k8s's one-shot `functions` step; `llmq up` loads it on its own
server) and is stored by the server itself: it survives restarts in the RDB and the AOF. A
worker that finds it missing or older than it needs loads it only when its user may, and
otherwise says so in one line naming that command and takes no work until it is there.

    FCALL llmq_submit 2 llmq:q:{<queue>} llmq:sub:{<queue>} json '{"prompt":"Hi"}'
        -> {1, entry_id}
    FCALL llmq_submit 3 llmq:q:{<queue>} llmq:sub:{<queue>} llmq:id:{<queue>}:<request_id> \
          json '{"id":"<request_id>",...}' 86400
        -> {1, entry_id}, or {0, first_entry_id} when the id was submitted before (marker TTL s)
        (a tenant's id `<tenant>:<id>` has its marker at llmq:t:id:<tenant>:<id>:{<queue>})

    FCALL llmq_submit_lane 3|4 llmq:q:{<queue>}:<lane> llmq:sub:{<queue>}:<lane> \
          llmq:lanes:{<queue>} [<marker>] json '{...}' [86400 <request_id>]
        -> as llmq_submit, to a lane stream (broker/work_lanes.py): the entry id is chosen here,
           `<ms>-<k * 2**40 + c>` (k: the lane's number), unique across the queue's streams

    FCALL llmq_retry 3|4 llmq:q:{<queue>} llmq:dlq:{<queue>} llmq:sub:{<queue>} [<marker>] \
          <dead letter id> <marker ttl s> <request id or ''> <field> <value> ...
        -> the new entry id (a dead letter queued again; the gateway's and `llmq dlq retry`'s)

    FCALL llmq_ack 4 llmq:q:{<queue>} llmq:hb:{<queue>} llmq:dlq:{<queue>} llmq:sub:{<queue>} \
          workers <consumer> <n> <entry id> x n [<k> <field> <value> x k] ...
        -> the entry ids a peer owns now (worker/ack_script.py)
    FCALL llmq_claim_owned 1 llmq:q:{<queue>} workers <consumer> <idle ms> <entry id> ...
        -> {lost, orphaned} (worker/lease_keeper.py)
    FCALL_RO llmq_version 0 -> the library's version

Every submission (and retry) is also recorded in `llmq:sub:{<queue>}` (entry id -> request id)
until a worker acks it, so an entry that vanishes unread (trimmed, deleted) is still answered with
`lost_payload` on its result stream (worker/lease_keeper.py). All keys are in the queue's slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis

from llmq.broker import replies
from llmq.broker.affinity_handover import LIBRARY_PART as AFFINITY_FUNCTIONS
from llmq.broker.consumer_cleanup import LIBRARY_PART as CLEANUP_FUNCTIONS
from llmq.broker.work_lanes import COUNT_FIELD, LANE_SEQ_BASE, LAST_FIELD, MAX_LANE_NUMBER
from llmq.protocol.errors import BrokerError, LLMQError, StreamExhausted

__all__ = ["ACK_FUNCTION", "CLAIM_OWNED_FUNCTION", "LIBRARY", "LIBRARY_NAME", "LIBRARY_VERSION",
           "LOAD_COMMAND", "RETRY_FUNCTION", "SUBMIT_FUNCTION", "SUBMIT_LANE_FUNCTION",
           "FunctionLibraryMissing", "ServerLibrary", "ensure_functions", "ensure_functions_async",
           "is_missing_function", "library_versions", "missing_message", "reload_missing",
           "submit_error"]

logger = logging.getLogger(__name__)

LIBRARY_NAME = "llmq"
# NOTE: up with every change of the code below: loaders replace older versions, and workers
# refuse to run on an older one. Keep every function's arguments and replies as they were (add,
# do not change): workers of the previous release run on the new library during a rollout.
# 5: the affinity functions hand over, take and renew entries of the lane stream their first key
# names, not only the queue's own (broker/affinity_handover.py); llmq_drop_idle_consumer
# (broker/consumer_cleanup.py).
LIBRARY_VERSION = 5
SUBMIT_FUNCTION = "llmq_submit"
SUBMIT_LANE_FUNCTION = "llmq_submit_lane"
RETRY_FUNCTION = "llmq_retry"
ACK_FUNCTION = "llmq_ack"
CLAIM_OWNED_FUNCTION = "llmq_claim_owned"
# What an operator runs, as the admin user, to load the library (named in every message).
LOAD_COMMAND = "llmq admin load-functions"
EXHAUSTED = "LLMQEXHAUSTED"

LIBRARY = f"""#!lua name={LIBRARY_NAME}
local VERSION = {LIBRARY_VERSION}

-- keys: request stream, submissions [, idempotency marker]
-- args: field, payload [, marker ttl seconds, request id]
local function submit(keys, args)
  local field, payload = args[1], args[2]
  if field ~= 'json' and field ~= 'msgpack' then
    return redis.error_reply('ERR llmq_submit: the field must be json or msgpack')
  end
  if payload == nil or #keys < 2 or #keys > 3 or (keys[3] and not args[4]) then
    return redis.error_reply('ERR llmq_submit: give 2 or 3 keys, a field and a payload')
  end
  if keys[3] then
    local first = redis.call('GET', keys[3])
    if first then return {{0, first}} end
  end
  local entry = redis.pcall('XADD', keys[1], '*', field, payload)
  if type(entry) == 'table' and entry.err then
    if string.find(entry.err, 'exhausted', 1, true) then
      return redis.error_reply('{EXHAUSTED} ' .. keys[1] .. ' reached the last possible id')
    end
    return entry
  end
  if keys[3] then
    redis.call('SET', keys[3], entry, 'EX', tonumber(args[3]) or 86400)
  end
  redis.call('HSET', keys[2], entry, args[4] or entry)
  return {{1, entry}}
end

-- The next entry id of a lane: `<ms>-<k * {LANE_SEQ_BASE} + c>`, where ms is the server's clock
-- (or the queue's last lane ms, if later), c counts the queue's lane entries within that ms
-- (`{LAST_FIELD}` holds `<ms>-<c>`) and k is the lane's own number (1, 2, ...: the queue's own
-- stream's `*` ids stay below {LANE_SEQ_BASE}). c makes the id unique across the queue's
-- streams; k keeps an XADD by hand to a lane (`*` continues from its last id) inside that
-- lane's own range. Returns nil and an error when the lane has no valid number.
local function next_lane_id(lanes, lane)
  local k = redis.call('HGET', lanes, lane)
  if not k then
    k = redis.call('HINCRBY', lanes, '{COUNT_FIELD}', 1)
    redis.call('HSET', lanes, lane, k)
  end
  k = tonumber(k)
  if not k or k < 1 or k > {MAX_LANE_NUMBER} or k ~= math.floor(k) then
    return nil, 'ERR llmq_submit_lane: lane ' .. lane .. ' has no valid number in ' .. lanes
  end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local ms, c = now, 0
  local last = redis.call('HGET', lanes, '{LAST_FIELD}')
  if last then
    local last_ms, last_c = string.match(last, '^(%d+)-(%d+)$')
    last_ms, last_c = tonumber(last_ms), tonumber(last_c)
    if last_ms and last_c and last_ms >= now and last_c < {LANE_SEQ_BASE} - 1 then
      ms, c = last_ms, last_c + 1
    end
  end
  redis.call('HSET', lanes, '{LAST_FIELD}', string.format('%.0f-%.0f', ms, c))
  return string.format('%.0f-%.0f', ms, k * {LANE_SEQ_BASE} + c)
end

-- keys: lane stream, its submissions, the queue's lanes [, idempotency marker]
-- args: field, payload [, marker ttl seconds, request id]
local function submit_lane(keys, args)
  local field, payload = args[1], args[2]
  if field ~= 'json' and field ~= 'msgpack' then
    return redis.error_reply('ERR llmq_submit_lane: the field must be json or msgpack')
  end
  if payload == nil or #keys < 3 or #keys > 4 or (keys[4] and not args[4]) then
    return redis.error_reply('ERR llmq_submit_lane: give 3 or 4 keys, a field and a payload')
  end
  local lane = string.match(keys[1], '}}:([^{{}}]+)$')
  if not lane then
    return redis.error_reply('ERR llmq_submit_lane: ' .. keys[1] .. ' is no lane stream')
  end
  if keys[4] then
    local first = redis.call('GET', keys[4])
    if first then return {{0, first}} end
  end
  local id, problem = next_lane_id(keys[3], lane)
  if not id then return redis.error_reply(problem) end
  local entry = redis.pcall('XADD', keys[1], id, field, payload)
  if type(entry) == 'table' and entry.err then return entry end
  if keys[4] then
    redis.call('SET', keys[4], entry, 'EX', tonumber(args[3]) or 86400)
  end
  redis.call('HSET', keys[2], entry, args[4] or entry)
  return {{1, entry}}
end

-- A dead letter queued again, atomically within the queue's slot: the new entry, recorded like a
-- submit's, the dead letter gone, and, when the request id is the producer's own, its marker
-- naming the new entry (so `llmq result` knows the id before a worker starts it).
-- keys: request stream, dead letters, submissions [, idempotency marker]
-- args: dead letter's entry id, marker ttl seconds, request id ('' for none), then the original
--       entry's fields and values
local function retry(keys, args)
  if #keys < 3 or #keys > 4 or #args < 5 or (#args - 3) % 2 ~= 0 then
    return redis.error_reply('ERR llmq_retry: give 3 or 4 keys, a dead letter id, a ttl, a '
                             .. 'request id and the fields')
  end
  if #redis.call('XRANGE', keys[2], args[1], args[1]) == 0 then
    return redis.error_reply('ERR llmq_retry: no dead letter ' .. args[1])
  end
  local entry = redis.call('XADD', keys[1], '*', unpack(args, 4))
  redis.call('XDEL', keys[2], args[1])
  if keys[4] then
    redis.call('SET', keys[4], entry, 'EX', tonumber(args[2]) or 86400)
  end
  local request_id = args[3]
  if request_id == '' then request_id = entry end
  redis.call('HSET', keys[3], entry, request_id)
  return entry
end

redis.register_function('{SUBMIT_FUNCTION}', submit)
redis.register_function('{SUBMIT_LANE_FUNCTION}', submit_lane)
redis.register_function('{RETRY_FUNCTION}', retry)
redis.register_function{{function_name='llmq_version', callback=function() return VERSION end,
                         flags={{'no-writes'}}}}

-- == {ACK_FUNCTION} =========================================================================
-- A worker's batch of dead letters and acks (worker/ack_script.py builds the call, the result
-- writer sends it): the dead letters added, then XACK of the entries still pending under this
-- consumer and their hand-back counts deleted, and the submit function's record of those and of
-- entries no longer pending at all; returns the ids a peer owns now.
-- keys: request stream, hand-back counts, dead letters, submissions
-- args: group, consumer, n, n entry ids, then each dead letter: its number of fields k, then k
--       field / value pairs
-- NOTE: a plain XACK removes an entry from the PEL whoever owns it: a stalled worker finishing
-- late would ack the entry a peer reclaimed and is running as the next attempt, which then could
-- never be reclaimed again if that peer died. Its late terminal event (a lower attempt) is
-- harmless: readers follow the highest attempt.
-- allow-oom: acks free memory, so they must run when the server is full (the dead letters are
-- small, and an OOM-refused result write aborts the whole transaction before this runs).
local function ack(keys, args)
  if #keys ~= 4 or #args < 3 then
    return redis.error_reply('ERR {ACK_FUNCTION}: give 4 keys, a group, a consumer and a count')
  end
  local n = tonumber(args[3])
  local i = 4 + n
  while i <= #args do
    local k = tonumber(args[i])
    redis.call('XADD', keys[3], '*', unpack(args, i + 1, i + 2 * k))
    i = i + 1 + 2 * k
  end
  local mine, taken, done = {{}}, {{}}, {{}}
  for j = 4, 3 + n do
    local p = redis.call('XPENDING', keys[1], args[1], args[j], args[j], 1)
    if p[1] then
      if p[1][2] == args[2] then
        mine[#mine + 1] = args[j]
        done[#done + 1] = args[j]
      else
        taken[#taken + 1] = args[j]
      end
    else
      done[#done + 1] = args[j]
    end
  end
  if #mine > 0 then
    redis.call('XACK', keys[1], args[1], unpack(mine))
    redis.call('HDEL', keys[2], unpack(mine))
  end
  if #done > 0 then redis.call('HDEL', keys[4], unpack(done)) end
  return taken
end
redis.register_function{{function_name='{ACK_FUNCTION}', callback=ack, flags={{'allow-oom'}}}}

-- == {CLAIM_OWNED_FUNCTION} ================================================================
-- A worker's lease renewal and hand-back (worker/lease_keeper.py): re-claims, with the given
-- IDLE, the entries still pending under this consumer. Returns {{lost, orphaned}}: lost = pending
-- under another consumer, or acked while the entry still exists (a peer took it over);
-- orphaned = neither pending nor in the stream (the stream and group were lost with a Redis
-- restart without persistence: nobody else can have it).
-- keys: request stream
-- args: group, consumer, idle ms, entry ids...
-- allow-oom: a lease must be renewed when the server is full, or peers take running work.
local function claim_owned(keys, args)
  if #keys ~= 1 or #args < 3 then
    return redis.error_reply('ERR {CLAIM_OWNED_FUNCTION}: give 1 key, a group, a consumer and '
                             .. 'an idle time')
  end
  local owned, lost, orphaned = {{}}, {{}}, {{}}
  for i = 4, #args do
    local p = redis.call('XPENDING', keys[1], args[1], args[i], args[i], 1)
    if p[1] and p[1][2] == args[2] then
      owned[#owned + 1] = args[i]
    elseif p[1] or #redis.call('XRANGE', keys[1], args[i], args[i]) > 0 then
      lost[#lost + 1] = args[i]
    else
      orphaned[#orphaned + 1] = args[i]
    end
  end
  if #owned > 0 then
    local claim = {{keys[1], args[1], args[2], 0}}
    for _, id in ipairs(owned) do claim[#claim + 1] = id end
    claim[#claim + 1] = 'IDLE'
    claim[#claim + 1] = args[3]
    claim[#claim + 1] = 'JUSTID'
    redis.call('XCLAIM', unpack(claim))
  end
  return {{lost, orphaned}}
end
redis.register_function{{function_name='{CLAIM_OWNED_FUNCTION}', callback=claim_owned,
                         flags={{'allow-oom'}}}}
""" + AFFINITY_FUNCTIONS + CLEANUP_FUNCTIONS  # affinity's hand-over; the consumer cleanup


class FunctionLibraryMissing(BrokerError):
    """The library is missing, or older than this llmq needs, on a server, and this connection
    may not load it; the message names the server, the versions and the command to run."""


@dataclass(frozen=True)
class ServerLibrary:
    """The library on one server (a cluster's primary): the version found (0: none), and
    whether it was loaded now."""
    server: str
    found: int
    loaded: bool = False


def is_missing_function(exc: BaseException) -> bool:
    return "function not found" in str(exc).lower() or "no such function" in str(exc).lower()


def missing_message(server: str, found: int) -> str:
    """One line: what is wrong with the library on `server`, and the command that fixes it."""
    state = ("missing" if not found
             else f"version {found}, older than the version {LIBRARY_VERSION} this llmq needs")
    return (f"the llmq function library on {server} is {state}: run `{LOAD_COMMAND}` as the "
            "admin user (docs/operations.md, \"Redis users and passwords\")")


def submit_error(exc: BaseException, queue_key: str, fix: str) -> LLMQError | None:
    """What an FCALL error means to a producer; None for errors the caller handles itself."""
    text = str(exc)
    if EXHAUSTED in text:
        return StreamExhausted(fix)
    if is_missing_function(exc):
        return BrokerError(
            f"the llmq function library is not loaded on the server of {queue_key}: run "
            f"`{LOAD_COMMAND}` as the admin user")
    return None


def _targets(client: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, call target) per server that must hold the library (each primary of a cluster;
    their replicas get it by replication)."""
    from llmq.broker.connection import describe_connection
    from llmq.broker.redis_url import is_cluster

    if is_cluster(client):
        return [(node.name, {"target_nodes": node}) for node in client.get_primaries()]
    pool = client.connection_pool
    if service := getattr(pool, "service_name", None):
        return [(f"the primary of Sentinel service {service!r}", {})]
    return [(describe_connection(client), {})]


def _version_reply(reply: object) -> int:
    if isinstance(reply, dict):  # a cluster client answers per node when given a node
        (reply,) = reply.values()
    return replies.integer(reply, "FCALL_RO llmq_version")


def _version_or_missing(reply: object) -> int:
    if isinstance(reply, redis.ResponseError):
        if is_missing_function(reply):
            return 0
        raise reply
    return _version_reply(reply)


def _should_load(found: int, replace_newer: bool) -> bool:
    if found > LIBRARY_VERSION and not replace_newer:
        logger.warning("the llmq function library (version %d) is newer than this llmq's "
                       "(version %d): left as it is", found, LIBRARY_VERSION)
    return found < LIBRARY_VERSION or (replace_newer and found != LIBRARY_VERSION)


def _is_refusal(exc: redis.ResponseError) -> bool:
    """NOPERM (redis-py names it by its class and drops the code from the text)."""
    return isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc)


def _refused(exc: redis.ResponseError, server: str, found: int) -> FunctionLibraryMissing:
    logger.debug("FUNCTION LOAD refused on %s: %s", server, exc)
    return FunctionLibraryMissing(missing_message(server, found))


def _found(client: Any, target: dict[str, Any]) -> int:
    try:
        reply: object = client.execute_command("FCALL_RO", "llmq_version", 0, **target)
    except redis.ResponseError as exc:
        reply = exc
    return _version_or_missing(reply)


def library_versions(client: Any) -> list[ServerLibrary]:
    """The library's version on every server (0: missing); nothing is loaded."""
    return [ServerLibrary(server, _found(client, target)) for server, target in _targets(client)]


def ensure_functions(client: Any, *, replace_newer: bool = False) -> list[ServerLibrary]:
    """Load the library where it is missing or older (also where newer, with `replace_newer`);
    every server's outcome. FunctionLibraryMissing when this connection may not load it where
    it must (NOPERM: a user that only runs it).

    Harmless when a peer does the same at the same time: loading is idempotent."""
    outcome = []
    for server, target in _targets(client):
        found = _found(client, target)
        loaded = _should_load(found, replace_newer)
        if loaded:
            try:
                client.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY, **target)
            except redis.ResponseError as exc:
                if _is_refusal(exc):
                    raise _refused(exc, server, found) from None
                raise
            logger.info("loaded the llmq function library (version %d) on %s",
                        LIBRARY_VERSION, server)
        outcome.append(ServerLibrary(server, found, loaded))
    return outcome


def reload_missing(client: Any) -> redis.ResponseError:
    """After an FCALL found no llmq function: the library loaded again where this connection may
    (the error returned says so, for the caller's retry), else the error that names the
    command to run. Raise what it returns; other Redis errors propagate."""
    try:
        loaded = [s.server for s in ensure_functions(client) if s.loaded]
    except FunctionLibraryMissing as exc:
        return redis.ResponseError(str(exc))
    if loaded:
        return redis.ResponseError(f"the llmq function library was missing on "
                                   f"{', '.join(loaded)}: loaded it again")
    return redis.ResponseError(f"an llmq function was not found though the library (version "
                               f"{LIBRARY_VERSION} or newer) is loaded everywhere: run "
                               f"`{LOAD_COMMAND} --replace` as the admin user")


async def ensure_functions_async(client: Any) -> int:
    """`ensure_functions` for an asyncio client; how many servers were (re)loaded."""
    changed = 0
    for server, target in _targets(client):
        try:
            reply: object = await client.execute_command("FCALL_RO", "llmq_version", 0,
                                                         **target)
        except redis.ResponseError as exc:
            reply = exc
        found = _version_or_missing(reply)
        if _should_load(found, replace_newer=False):
            try:
                await client.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY, **target)
            except redis.ResponseError as exc:
                if _is_refusal(exc):
                    raise _refused(exc, server, found) from None
                raise
            changed += 1
    return changed
