"""The worker runs as deploy/acl.conf's least-privilege `worker` user, producers as `producer`.

Every command a live worker sends (reads, the lease script, reclaim, result writes, dead
letters, heartbeats, cancel follow-up, the stop path) must be within the `worker` user's
permissions, or the worker would fail only in production. The server is the one test_acl.py
starts: deploy/redis.conf + deploy/acl.conf, on both server kinds.
"""

from __future__ import annotations

import pytest
import redis

from llmq import protocol
from llmq.broker import Client
from llmq.broker.functions import ensure_functions
from llmq.broker.keys import GROUP
from tests.fixtures.acl_server import PASSWORDS, acl_url
from tests.integration.worker_harness import (
    KEYS,
    QUEUE_KEY,
    InProcessWorker,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.redis


def test_worker_serves_reclaims_cancels_and_stops_as_the_worker_user(acl_server, tiny_model
                                                                     ) -> None:
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    admin.function_flush()
    try:
        # Given the submit function, loaded with the worker user's rights (as a worker does)
        with redis.Redis.from_url(acl_url(port, "worker")) as worker_user:
            assert ensure_functions(worker_user) == 1
        with Client(acl_url(port, "producer")) as producer:
            # Given an entry a dead consumer left pending, and a producer queueing more
            stale = producer.submit("Hi", request_id="left-behind", max_tokens=3)
            admin.xreadgroup(GROUP, "dead-worker", {QUEUE_KEY: ">"}, count=1)
            bad = admin.xadd(QUEUE_KEY, {"json": b'{"prompt": '}).decode()
            with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="acl-worker",
                                 fault="slow_step:20"):
                # When the worker serves as the `worker` user
                done = producer.result(producer.submit("Hi", max_tokens=4), timeout=30)
                reclaimed = producer.result(stale, timeout=30)
                long_id = producer.submit("Hi", max_tokens=400, ignore_eos=True)
                wait_for(lambda: len(admin.xrange(KEYS.result(long_id))) > 3, 30, "deltas")
                producer.cancel(long_id)
                cancelled = producer.result(long_id, timeout=30)
                wait_for(lambda: admin.xlen(KEYS.dlq("default")), 10, "a dead letter")
                assert admin.exists(KEYS.worker("acl-worker"))
        # Then generation, reclaim, cancel, dead letters and heartbeats all worked ...
        assert done.finish_reason == "length" and reclaimed.attempt == 2
        assert cancelled.finish_reason == "cancelled"
        assert protocol.decode_dead_letter(admin.xrange(KEYS.dlq("default"))[0][1])[0].entry_id \
            == bad
        # ... nothing is left pending, and the clean stop removed the heartbeat
        assert admin.xpending(QUEUE_KEY, GROUP)["pending"] == 0
        assert not admin.exists(KEYS.worker("acl-worker"))
        assert isinstance(wait_terminal(admin, stale), protocol.Done)
    finally:
        admin.flushall()
        admin.close()


def test_the_worker_user_may_hand_entries_over_and_take_them(acl_server) -> None:
    """Cache affinity's commands (broker/affinity_handover.py, worker/affinity_keeper.py) as
    the `worker` user: a summary, a hand-over, the owner's renewal, a peer's take."""
    from llmq.broker.affinity_handover import AffinityHandover

    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    with redis.Redis.from_url(acl_url(port, "worker")) as worker:
        worker.xgroup_create(QUEUE_KEY, GROUP, "0", mkstream=True)
        entry_id = admin.xadd(QUEUE_KEY, {"json": b'{"prompt": "Hi"}'}).decode()
        worker.xreadgroup(GROUP, "wb", {QUEUE_KEY: ">"}, count=1)
        # Given wa's summary, published the way its keeper does
        pipe = worker.pipeline(transaction=False)
        pipe.set(KEYS.affinity_summary("default", "wa"), b"\x01" * 8, px=5000)
        pipe.pexpire(KEYS.affinity_summary("default", "wa"), 5000)
        pipe.zadd(KEYS.affinity_members("default"), {"wa": 1})
        pipe.zrange(KEYS.affinity_members("default"), 0, -1)
        pipe.get(KEYS.affinity_summary("default", "wa"))
        pipe.xlen(KEYS.affinity_tickets("default", "wa"))
        pipe.execute()
        handover = AffinityHandover(worker, KEYS, "default")
        # When wb hands the entry to wa, wa renews it, and wb takes it back from the ticket
        assert handover.hand_over(worker, "wb", "wa", "01" * 8, [entry_id], 16) == ([entry_id],
                                                                                   [])
        assert handover.renew(worker, "wa") == 1
        worker.xread({KEYS.affinity_tickets("default", "wa"): "0-0"}, count=1, block=10)
        (ticket,) = handover.tickets(worker, "wa", 8)
        (taken,) = handover.take(worker, "wa", "wb", [ticket.ticket_id])
        # Then every command was the worker user's to send, and the entry is wb's again
        assert taken.entry.entry_id == entry_id and taken.attempt == 1
        worker.delete(KEYS.affinity_summary("default", "wa"))
        assert handover.forget(worker, "wa")
