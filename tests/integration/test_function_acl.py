"""The function library under deploy/acl.conf: who may load it, who may run which function.

All of llmq's server-side code is the `llmq` library (broker/functions.py), loaded by the admin
(`llmq admin load-functions`). Live, on the server test_acl.py starts (deploy/redis.conf +
deploy/acl.conf, Redis 7.0 and Valkey 8.1): the worker user runs its lease and ack functions
but can neither load, replace nor delete a library, nor run a script of its own; producers and
the gateway cannot use the workers' functions to ack, or hand back, an entry a worker holds
(what a function runs is checked against its caller's rights).
"""

from __future__ import annotations

import pytest
import redis

from llmq.broker.consumer_cleanup import drop_idle_consumer
from llmq.broker.functions import ensure_functions
from llmq.broker.keys import GROUP
from tests.fixtures.acl_server import PASSWORDS

pytestmark = pytest.mark.redis

Q, HB, DLQ, SUB = ("llmq:q:{default}", "llmq:hb:{default}", "llmq:dlq:{default}",
                   "llmq:sub:{default}")


@pytest.fixture
def connect(acl_users, acl_server):
    yield acl_users
    # NOTE: and the library, which these tests load and break on purpose
    with redis.Redis(port=acl_server[0], username="admin", password=PASSWORDS["admin"]) as admin:
        admin.function_flush()


def test_worker_runs_its_lease_and_ack_functions(connect):
    admin, worker = connect("admin"), connect("worker")
    ensure_functions(admin)
    # Given a request the worker holds
    worker.xgroup_create(Q, GROUP, id="0", mkstream=True)
    entry_id = admin.xadd(Q, {"json": "{}"})
    worker.xreadgroup(GROUP, "worker-1", {Q: ">"}, count=1)
    # When the worker's lease function renews it (XPENDING, XRANGE and XCLAIM inside)
    lost, orphaned = worker.fcall("llmq_claim_owned", 1, Q, GROUP, "worker-1", "0", entry_id)
    # Then its ACL allows every command the function runs, and the entry is still its own
    assert (lost, orphaned) == ([], [])
    assert worker.xpending(Q, GROUP)["consumers"] == [{"name": "worker-1", "pending": 1}]
    # And the ack function (XADD of a dead letter, XPENDING, XACK, HDEL inside) releases it
    assert worker.fcall("llmq_ack", 4, Q, HB, DLQ, SUB, GROUP, "worker-1", 1, entry_id,
                        1, "json", "{}") == []
    assert worker.xpending(Q, GROUP)["pending"] == 0
    assert admin.xlen(DLQ) == 1


def test_the_worker_user_can_neither_load_nor_run_code_of_its_own(connect):
    admin, worker = connect("admin"), connect("worker")
    ensure_functions(admin)
    library = admin.function_list(library="llmq", withcode=True)
    # When the worker user tries to replace llmq's library, add its own, or run a script
    for attempt in (lambda: worker.function_load("#!lua name=llmq\nredis.register_function("
                                                 "'llmq_ack', function() return 1 end)",
                                                 replace=True),
                    lambda: worker.function_load("#!lua name=mine\nredis.register_function("
                                                 "'f', function() return 1 end)"),
                    lambda: worker.function_delete("llmq"),
                    lambda: worker.function_flush(),
                    lambda: worker.eval("return 1", 0),
                    lambda: worker.eval("return redis.call('XLEN', KEYS[1])", 1, Q),
                    lambda: worker.script_load("return 1"),
                    lambda: worker.evalsha("e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0)):
        # Then each is refused with NOPERM
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    # And llmq's library is the admin's, unchanged
    assert admin.function_list(library="llmq", withcode=True) == library
    (only,) = admin.function_list()  # RESP2: [name, value, ...] per library
    assert only[only.index("library_name") + 1] == "llmq"


@pytest.mark.parametrize("user", ["producer", "gateway"])
def test_producers_cannot_ack_or_steal_a_workers_entry_through_its_functions(connect, user):
    admin, worker, caller = connect("admin"), connect("worker"), connect(user)
    ensure_functions(admin)
    # Given an entry a worker holds
    worker.xgroup_create(Q, GROUP, id="0", mkstream=True)
    entry_id = admin.xadd(Q, {"json": "{}"})
    worker.xreadgroup(GROUP, "worker-1", {Q: ">"}, count=1)
    # When a producer calls the workers' functions on it: hand it back in the worker's name (a
    # huge idle), ack it (also with keys it may name in the hand-back counts' place). (Naming
    # another consumer only reads: the entry is reported as someone else's, as XPENDING says.)
    for attempt in (
            lambda: caller.fcall("llmq_claim_owned", 1, Q, GROUP, "worker-1", 10**10, entry_id),
            lambda: caller.fcall("llmq_ack", 4, Q, SUB, SUB, SUB, GROUP, "worker-1", 1,
                                 entry_id),
            lambda: caller.fcall("llmq_ack", 4, Q, HB, DLQ, SUB, GROUP, "worker-1", 1,
                                 entry_id)):
        # Then each is refused: what the function runs is checked against the caller's rights
        with pytest.raises(redis.ResponseError, match="(?i)no permissions|can.t (access|run)"):
            attempt()
    # And the entry is still the worker's, pending, its lease untouched
    (pending,) = worker.xpending_range(Q, GROUP, min="-", max="+", count=10)
    assert (pending["message_id"], pending["consumer"]) == (entry_id, "worker-1")
    assert pending["time_since_delivered"] < 10**9


def test_a_gone_workers_consumer_is_deleted_only_while_it_holds_nothing(connect):
    admin, worker = connect("admin"), connect("worker")
    ensure_functions(admin)
    worker.xgroup_create(Q, GROUP, id="0", mkstream=True)
    entry_id = admin.xadd(Q, {"json": "{}"})
    # Given a worker that lost its heartbeat while paused, then woke and read an entry after a
    # peer's cleanup had listed its consumer as holding nothing
    worker.xreadgroup(GROUP, "paused-w", {Q: ">"}, count=1)
    # When the peer deletes that consumer (the worker user's own rights)
    assert drop_idle_consumer(worker, Q, "paused-w") is False
    # Then it is kept with the entry, which stays pending (a delete would have dropped it from
    # the group for good, unread and never reclaimed)
    assert worker.xpending(Q, GROUP)["consumers"] == [{"name": "paused-w", "pending": 1}]
    # And once it holds nothing it goes
    worker.xack(Q, GROUP, entry_id)
    assert drop_idle_consumer(worker, Q, "paused-w") is True
    assert worker.xinfo_consumers(Q, GROUP) == []
