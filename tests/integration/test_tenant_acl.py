"""Tenants cannot hurt each other: `llmq acl tenant NAME`'s rule, loaded into a real server.

Two tenants, acme and bob, each a producer user made from the printed rule, on the server
test_acl.py starts (deploy/redis.conf + deploy/acl.conf; Redis 7.0 and Valkey 8.1), and a worker
running as the `worker` user. What the issue found a producer could do to another (read its
results, set its cancel flags, pre-set its markers) is refused with NOPERM, and what an ACL
cannot refuse (a plain XADD naming another tenant's id) the worker refuses: the entry runs
nowhere near the victim's stream, and the victim's own submit of that id still runs.
"""

from __future__ import annotations

import pytest
import redis
from click.testing import CliRunner

from llmq import protocol
from llmq.broker import Client
from llmq.broker.keys import GROUP, Keys
from llmq.broker.tenant_acl import TenantAcl
from llmq.cli.main import cli
from llmq.protocol.errors import BrokerError, RequestIdConflict
from tests.fixtures.acl_server import PASSWORDS, acl_url
from tests.integration.worker_harness import (
    KEYS,
    QUEUE_KEY,
    InProcessWorker,
    dead_letters,
    read_events,
    wait_terminal,
)

pytestmark = pytest.mark.redis

TENANTS = {"acme": "acme-password", "bob": "bob-password"}
SHA = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"


@pytest.fixture
def tenants(acl_server):
    """acme and bob as users made from `llmq acl tenant`'s output; yields the port."""
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    for name, password in TENANTS.items():
        result = CliRunner().invoke(cli, ["acl", "tenant", name, "--password", password])
        assert result.exit_code == 0, result.output
        rule = result.stdout.strip().split()
        assert rule[:2] == ["user", name]
        admin.execute_command("ACL", "SETUSER", *rule[1:])
    try:
        yield port
    finally:
        admin.flushall()
        for name in TENANTS:
            admin.execute_command("ACL", "DELUSER", name)
        admin.close()


def url(port: int, tenant: str) -> str:
    return f"redis://{tenant}:{TENANTS[tenant]}@127.0.0.1:{port}/0"


def dryrun(port: int, user: str, *command: str) -> str:
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"],
                        decode_responses=True)
    try:
        return admin.execute_command("ACL", "DRYRUN", user, *command)
    except redis.ResponseError as e:
        return str(e)
    finally:
        admin.close()


Q, CANCEL, SUB = KEYS.queue("default"), KEYS.cancel("default"), KEYS.submissions("default")
OWN = {"result": KEYS.result("acme:1"), "flag": KEYS.cancel_flag("acme:1"),
       "marker": KEYS.idempotency("default", "acme:1")}
BOBS = {"result": KEYS.result("bob:1"), "flag": KEYS.cancel_flag("bob:1"),
        "marker": KEYS.idempotency("default", "bob:1")}

ALLOWED = [
    ("PING",), ("TIME",),
    ("XADD", Q, "*", "json", "{}"),                                   # submit, any language
    ("XGROUP", "CREATE", Q, GROUP, "0", "MKSTREAM"), ("SADD", KEYS.queues(), "default"),
    ("FCALL", "llmq_submit", "3", Q, SUB, OWN["marker"], "json", "{}", "86400", "acme:1"),
    ("HSET", SUB, "1-0", "acme:1"),                                   # ... what it runs
    ("GET", OWN["marker"]), ("SET", OWN["marker"], "1-0", "EX", "86400"),
    ("SET", OWN["flag"], "1", "EX", "86400"),                         # cancel its own
    ("XADD", CANCEL, "MAXLEN", "~", "10000", "*", "json", "{}"),
    ("XREAD", "BLOCK", "1000", "STREAMS", OWN["result"], "0"),        # its own results
    ("XRANGE", OWN["result"], "-", "+"), ("XREVRANGE", OWN["result"], "+", "-"),
    ("XLEN", OWN["result"]), ("XINFO", "STREAM", OWN["result"]),
    ("XPENDING", Q, GROUP, "1-0", "1-0", "1"), ("XINFO", "GROUPS", Q),  # marker checks
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
    assert patterns["results"] == "tenantq:r:{acme:*}"
    assert patterns["markers"] == "tenantq:id:{*}:acme:*"
    with pytest.raises(ValueError):
        TenantAcl(Keys(), "ac:me")


def test_tenants_run_their_own_and_cannot_hijack_block_or_read_each_other(
        acl_server, tenants, tiny_model) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    bob_raw = redis.Redis.from_url(url(port, "bob"))
    with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="tenant-worker"), \
            Client(url(port, "acme")) as acme, Client(url(port, "bob")) as bob:
        # Given bob, before acme ever submits acme:2, XADDs an entry naming acme's id
        hijack = bob_raw.xadd(Q, {"json": '{"id": "acme:2", "prompt": "bob writes here"}'})
        hijack = hijack.decode()
        error = wait_terminal(admin, hijack)
        # Then the worker refused it without writing acme's stream: the error went to the
        # entry's own stream, and to the dead letters
        assert isinstance(error, protocol.Error) and error.code == "invalid_request", error
        assert "acme" in error.message and not admin.exists(KEYS.result("acme:2"))
        assert any(letter.entry_id == hijack for letter, _ in dead_letters(admin))
        # When acme submits and runs its own requests, acme:2 included (not blocked)
        first = acme.result(acme.submit("Hi", request_id="acme:1", max_tokens=4), timeout=30)
        second = acme.result(acme.submit("Hi", request_id="acme:2", max_tokens=4), timeout=30)
        assert (first.attempt, second.attempt) == (1, 1)
        # Then bob can read none of it, nor cancel it, nor take over its marker
        with pytest.raises(BrokerError, match="NOPERM|permission"):
            list(bob.events("acme:1", timeout=5))
        with pytest.raises(BrokerError, match="NOPERM|permission"):
            bob.cancel("acme:1")
        with pytest.raises(BrokerError, match="NOPERM|permission"):
            bob.submit("Hi", request_id="acme:3", max_tokens=4)
        with pytest.raises(redis.exceptions.NoPermissionError):
            bob_raw.set(KEYS.idempotency("default", "acme:4"), "1-0")
        # And a late raw duplicate of acme:1 leaves acme's finished stream untouched
        late = bob_raw.xadd(Q, {"json": '{"id": "acme:1", "prompt": "again"}'}).decode()
        assert wait_terminal(admin, late).code == "duplicate_id"
        assert [type(e).__name__ for e in read_events(admin, "acme:1")] == [
            "Start", "Delta", "Delta", "Delta", "Delta", "Done"]
    bob_raw.close()
    admin.close()


def test_submit_raises_when_the_marker_names_no_entry_of_this_request(tenants) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    with Client(url(port, "acme")) as acme:
        # Given entries delivered and acked long ago (a worker's read), and markers naming an
        # entry that is gone, garbage, or an entry from the future
        acme.submit("Hi", request_id="acme:old", max_tokens=2)
        old_entry = admin.get(KEYS.idempotency("default", "acme:old")).decode()
        admin.xreadgroup(GROUP, "w", {QUEUE_KEY: ">"})
        admin.xack(QUEUE_KEY, GROUP, old_entry)
        admin.xdel(QUEUE_KEY, old_entry)
        admin.set(KEYS.idempotency("default", "acme:junk"), "not-an-entry")
        admin.set(KEYS.idempotency("default", "acme:future"), "99999999999999-0")
        # When acme submits those ids again, Then it is told instead of left waiting
        for rid in ("acme:old", "acme:junk", "acme:future"):
            with pytest.raises(RequestIdConflict, match=rid):
                acme.submit("Hi", request_id=rid, max_tokens=2)
        # While a marked entry still queued, or one that has a result, is a plain duplicate
        queued = acme.submit("Hi", request_id="acme:queued", max_tokens=2)
        assert acme.submit("Hi", request_id=queued, max_tokens=2) == "acme:queued"
    admin.close()
