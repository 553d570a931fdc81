"""The llmq Redis Function library: how producers submit, and how it gets onto the servers.

Producers submit with `FCALL llmq_submit`, and the gateway retries dead letters with `FCALL
llmq_retry`, never with scripts of their own, so neither ACL needs EVAL or SCRIPT (a producer
could otherwise run any loop it likes and freeze the server) and every submission is an
`XADD <queue> * <field> <payload>`: a `*` id and no trimming, whatever the producer would have
written. A function library is stored by the server itself and
survives restarts in the RDB and the AOF; workers load it when they start, and `llmq admin
load-functions` does for an operator.

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

Every submission (and retry) is also recorded in `llmq:sub:{<queue>}` (entry id -> request id)
until a worker acks it, so an entry that vanishes unread (trimmed, deleted) is still answered with
`lost_payload` on its result stream (worker/lease_keeper.py). All keys are in the queue's slot.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from llmq.broker import replies
from llmq.broker.work_lanes import COUNT_FIELD, LANE_SEQ_BASE, LAST_FIELD, MAX_LANE_NUMBER
from llmq.protocol.errors import BrokerError, LLMQError, StreamExhausted

__all__ = ["LIBRARY", "LIBRARY_NAME", "LIBRARY_VERSION", "RETRY_FUNCTION", "SUBMIT_FUNCTION",
           "SUBMIT_LANE_FUNCTION",
           "ensure_functions", "ensure_functions_async", "is_missing_function",
           "load_functions", "submit_error"]

logger = logging.getLogger(__name__)

LIBRARY_NAME = "llmq"
LIBRARY_VERSION = 3  # up with every change of the code below: loaders replace older versions
SUBMIT_FUNCTION = "llmq_submit"
SUBMIT_LANE_FUNCTION = "llmq_submit_lane"
RETRY_FUNCTION = "llmq_retry"
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
"""


def is_missing_function(exc: BaseException) -> bool:
    return "function not found" in str(exc).lower() or "no such function" in str(exc).lower()


def submit_error(exc: BaseException, queue_key: str, fix: str) -> LLMQError | None:
    """What an FCALL error means to a producer; None for errors the caller handles itself."""
    text = str(exc)
    if EXHAUSTED in text:
        return StreamExhausted(fix)
    if is_missing_function(exc):
        return BrokerError(
            f"the llmq function library is not loaded on the server of {queue_key}: start a "
            "worker (it loads it), or run `llmq admin load-functions`")
    return None


def _targets(client: Any) -> list[dict[str, Any]]:
    """One call target per server that must hold the library (each primary of a cluster)."""
    from llmq.broker.redis_url import is_cluster

    if is_cluster(client):
        return [{"target_nodes": node} for node in client.get_primaries()]
    return [{}]


def _version_reply(reply: object) -> int:
    if isinstance(reply, dict):  # a cluster client answers per node when given a node
        (reply,) = reply.values()
    return replies.integer(reply, "FCALL_RO llmq_version")


def _loaded_version(client: Any, target: dict[str, Any]) -> int:
    try:
        return _version_reply(client.execute_command("FCALL_RO", "llmq_version", 0, **target))
    except redis.ResponseError as exc:
        if is_missing_function(exc):
            return 0
        raise


def load_functions(client: Any) -> int:
    """FUNCTION LOAD REPLACE the library on every server; how many servers got it."""
    targets = _targets(client)
    for target in targets:
        client.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY, **target)
    return len(targets)


def ensure_functions(client: Any) -> int:
    """Load the library where it is missing or older; how many servers were (re)loaded.

    Harmless when a peer does the same at the same time: loading is idempotent."""
    changed = 0
    for target in _targets(client):
        if _loaded_version(client, target) < LIBRARY_VERSION:
            client.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY, **target)
            changed += 1
    if changed:
        logger.info("loaded the llmq function library (version %d) on %d server(s)",
                    LIBRARY_VERSION, changed)
    return changed


async def ensure_functions_async(client: Any) -> int:
    """`ensure_functions` for an asyncio client."""
    changed = 0
    for target in _targets(client):
        try:
            version = _version_reply(await client.execute_command(
                "FCALL_RO", "llmq_version", 0, **target))
        except redis.ResponseError as exc:
            if not is_missing_function(exc):
                raise
            version = 0
        if version < LIBRARY_VERSION:
            await client.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY, **target)
            changed += 1
    return changed
