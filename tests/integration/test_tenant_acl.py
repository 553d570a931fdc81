"""Tenants cannot hurt each other: `llmq acl tenant NAME`'s rule, loaded into a real server.

Two tenants, acme and bob, each a producer user made from the printed rule (tenant_harness.py), on
the server test_acl.py starts (deploy/redis.conf + deploy/acl.conf; Redis 7.0 and Valkey 8.1): what
the rule lets a tenant run, and what it refuses with NOPERM (ACL DRYRUN). test_tenant_isolation.py
runs the attacks against a live worker.
"""

from __future__ import annotations

import pytest
import redis

from llmq.broker.keys import GROUP, Keys
from llmq.broker.tenant_acl import TenantAcl
from tests.fixtures.acl_server import PASSWORDS
from tests.integration.tenant_harness import CANCEL, LANES, OWN_LANE, SUB, Q
from tests.integration.tenant_harness import tenants as tenants  # a fixture
from tests.integration.worker_harness import KEYS

pytestmark = pytest.mark.redis

SHA = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"


def dryrun(port: int, user: str, *command: str) -> str:
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"],
                        decode_responses=True)
    try:
        return admin.execute_command("ACL", "DRYRUN", user, *command)
    except redis.ResponseError as e:
        return str(e)
    finally:
        admin.close()


OWN = {"result": KEYS.result("acme:1"), "flag": KEYS.cancel_flag("acme:1"),
       "marker": KEYS.idempotency("default", "acme:1")}
BOBS = {"result": KEYS.result("bob:1"), "flag": KEYS.cancel_flag("bob:1"),
        "marker": KEYS.idempotency("default", "bob:1")}
BOBS_LANE = {"stream": KEYS.lane_stream("default", "batch:bob"),
             "records": KEYS.lane_submissions("default", "batch:bob")}
SHARED_LANE = {"stream": KEYS.lane_stream("default", "batch"),
               "records": KEYS.lane_submissions("default", "batch")}
SHARED = {"result": KEYS.result("job-1"), "flag": KEYS.cancel_flag("job-1"),
          "marker": KEYS.idempotency("default", "job-1")}

ALLOWED = [
    ("PING",), ("TIME",),
    ("XADD", Q, "*", "json", "{}"),                                   # submit, any language
    ("XGROUP", "CREATE", Q, GROUP, "0", "MKSTREAM"),
    ("FCALL", "llmq_submit", "3", Q, SUB, OWN["marker"], "json", "{}", "86400", "acme:1"),
    ("HSET", SUB, "1-0", "acme:1"),                                   # ... what it runs
    ("GET", OWN["marker"]), ("SET", OWN["marker"], "1-0", "EX", "86400"),
    ("SET", OWN["flag"], "1", "EX", "86400"),                         # cancel its own
    ("XADD", CANCEL, "MAXLEN", "~", "10000", "*", "json", "{}"),
    ("XREAD", "BLOCK", "1000", "STREAMS", OWN["result"], "0"),        # its own results
    ("XRANGE", OWN["result"], "-", "+"), ("XREVRANGE", OWN["result"], "+", "-"),
    ("XLEN", OWN["result"]), ("XINFO", "STREAM", OWN["result"]),
    ("XPENDING", Q, GROUP, "1-0", "1-0", "1"), ("XINFO", "GROUPS", Q),  # marker checks
    ("HEXISTS", SUB, "1-0"),
    ("FCALL", "llmq_submit_lane", "4", OWN_LANE["stream"], OWN_LANE["records"], LANES,  # its
     OWN["marker"], "json", "{}", "86400", "acme:1"),                  # own batch lane
    ("XADD", OWN_LANE["stream"], "1-1", "json", "{}"), ("HSET", OWN_LANE["records"], "1-1", "a"),
    ("HGET", LANES, "last"), ("HSET", LANES, "batch:acme", "1"),
    ("HINCRBY", LANES, "count", "1"),
    ("XGROUP", "CREATE", OWN_LANE["stream"], GROUP, "0", "MKSTREAM"),
    ("XPENDING", OWN_LANE["stream"], GROUP, "1-0", "1-0", "1"),
    ("HEXISTS", OWN_LANE["records"], "1-0"),
]
DENIED = [
    ("XREAD", "STREAMS", BOBS["result"], "0"), ("XRANGE", BOBS["result"], "-", "+"),
    ("XLEN", BOBS["result"]),                                         # another's results
    ("SET", BOBS["flag"], "1"),                                       # another's cancel flag
    ("SET", BOBS["marker"], "1-0"), ("GET", BOBS["marker"]),          # another's marker
    ("FCALL", "llmq_submit", "3", Q, SUB, BOBS["marker"], "json", "{}", "86400", "bob:1"),
    ("EVALSHA", SHA, "0"), ("SCRIPT", "LOAD", "return 1"),            # no scripts of its own
    ("XRANGE", Q, "-", "+"), ("XINFO", "STREAM", Q),                  # request payloads
    ("XREADGROUP", "GROUP", GROUP, "a", "STREAMS", Q, ">"), ("XACK", Q, GROUP, "1-0"),
    ("XCLAIM", Q, GROUP, "a", "0", "1-0"), ("XGROUP", "DESTROY", Q, GROUP),
    ("XTRIM", Q, "MAXLEN", "0"), ("DEL", Q),
    ("XADD", OWN["result"], "*", "json", "{}"), ("DEL", OWN["result"]),  # forging results
    ("XADD", KEYS.dlq("default"), "*", "json", "{}"), ("XRANGE", KEYS.dlq("default"), "-", "+"),
    ("HSET", KEYS.worker("w"), "model", "m"), ("EVAL", "return 1", "0"),
    ("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("SCAN", "0"), ("INFO",),
    ("CLIENT", "KILL", "TYPE", "normal"), ("ACL", "LIST"),
    ("SADD", KEYS.queues(), "x"),                                     # the workers' registry
    ("HGET", SUB, "1-0"), ("HGETALL", SUB), ("HSCAN", SUB, "0"),      # whose entry is whose
    ("XINFO", "STREAM", Q, "FULL"),
    ("SET", SHARED["flag"], "1"), ("GET", SHARED["marker"]),          # the shared producer's
    ("SET", SHARED["marker"], "1-0"), ("XREAD", "STREAMS", SHARED["result"], "0"),
    ("FCALL", "llmq_submit", "3", Q, SUB, SHARED["marker"], "json", "{}", "86400", "job-1"),
    ("GET", KEYS.idempotency("default", "bob:acme:1")),               # bob's id, acme's name
    ("SET", KEYS.idempotency("default", "bob:acme:1"), "1-0"),
    ("XADD", BOBS_LANE["stream"], "*", "json", "{}"),                 # another tenant's lane
    ("XADD", SHARED_LANE["stream"], "*", "json", "{}"),               # the shared batch lane
    ("FCALL", "llmq_submit_lane", "3", BOBS_LANE["stream"], BOBS_LANE["records"], LANES,
     "json", "{}"),
    ("FCALL", "llmq_submit_lane", "3", SHARED_LANE["stream"], SHARED_LANE["records"], LANES,
     "json", "{}"),
    ("HSET", BOBS_LANE["records"], "1-1", "bob:1"), ("HEXISTS", BOBS_LANE["records"], "1-1"),
    ("XGROUP", "CREATE", BOBS_LANE["stream"], GROUP, "0", "MKSTREAM"),
    ("XRANGE", OWN_LANE["stream"], "-", "+"),                         # payloads, its own too
    ("XREADGROUP", "GROUP", GROUP, "a", "STREAMS", OWN_LANE["stream"], ">"),
    ("HGETALL", LANES), ("DEL", LANES),
]


@pytest.mark.parametrize("command", ALLOWED, ids=lambda c: " ".join(c)[:50])
def test_a_tenant_may_submit_cancel_and_read_its_own(tenants, command) -> None:
    assert dryrun(tenants, "acme", *command) == "OK"


@pytest.mark.parametrize("command", DENIED, ids=lambda c: " ".join(c)[:50])
def test_a_tenant_may_not_touch_another_or_the_queue(tenants, command) -> None:
    assert "OK" != dryrun(tenants, "acme", *command)


def test_the_rule_follows_the_key_schema() -> None:
    # Given another prefix, the patterns are built from Keys, not written out
    patterns = TenantAcl(Keys("tenantq"), "acme").patterns()
    assert patterns["results"] == "tenantq:t:r:{acme:*}"
    assert patterns["markers"] == "tenantq:t:id:acme:*:{*}"
    with pytest.raises(ValueError):
        TenantAcl(Keys(), "ac:me")
